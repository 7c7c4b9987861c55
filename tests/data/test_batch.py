"""Batches move and pin every tensor they hold, nested histories included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.data.batch import History
from tests.batches import chitchat_select_batch, random_generate_batch


def tensors(batch: object) -> list[torch.Tensor]:
    out = []
    for f in dataclasses.fields(batch):  # type: ignore[arg-type]
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, History):
            out.extend(tensors(value))
    return out


BATCHES = {
    "generate": lambda: random_generate_batch(3, 40, n_acts=4),
    "select": lambda: chitchat_select_batch(2, 3)[0],
}


@pytest.mark.parametrize("kind", BATCHES)
def test_to_moves_nested_history_and_keeps_other_fields(kind: str) -> None:
    batch = BATCHES[kind]()
    moved = batch.to("meta")
    assert type(moved) is type(batch)
    assert len(tensors(moved)) == len(tensors(batch)) > len(tensors(batch.history))
    assert all(t.device.type == "meta" for t in tensors(moved))
    assert moved.dialogue_id == batch.dialogue_id


@pytest.mark.parametrize("kind", BATCHES)
def test_pin_memory_pins_every_tensor(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[torch.Tensor] = []

    def pin(t: torch.Tensor) -> torch.Tensor:  # no accelerator here: record the call
        pinned.append(t)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    batch = BATCHES[kind]()
    out = batch.pin_memory()
    assert {id(t) for t in pinned} == {id(t) for t in tensors(batch)}
    assert all(torch.equal(a, b) for a, b in zip(tensors(out), tensors(batch), strict=True))
