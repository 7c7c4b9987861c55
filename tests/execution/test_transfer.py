"""Batches onto the device: each when taken on a CPU, one ahead on CUDA (the CUDA path runs
without a GPU, on batches that record how they are moved)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pytest
import torch

from pipeline.config import Precision
from pipeline.execution import ExecutionPolicy, moved, pinned, to_device
from tests.batches import chitchat_select_batch, random_generate_batch, tensors
from tests.train.helpers import VOCAB


def _pulled(items: Iterable, log: list) -> Iterator:
    """``items``, appending each to ``log`` when it is pulled."""
    for item in items:
        log.append(item)
        yield item


def test_to_device_on_cpu_moves_each_batch_when_taken():
    batches = [random_generate_batch(2, VOCAB, seed=s) for s in range(4)]
    pulled: list = []
    handed = to_device(_pulled(batches, pulled), torch.device("cpu"))
    first = next(handed)
    assert len(pulled) == 1 and torch.equal(first.target_ids, batches[0].target_ids)
    rest = list(handed)
    assert len(rest) == 3 and len(pulled) == 4
    for got, want in zip(rest, batches[1:], strict=True):
        assert torch.equal(got.target_ids, want.target_ids)
        assert torch.equal(got.history.input_ids, want.history.input_ids)


@dataclass
class _FakeTensor:
    """Records how ``to_device`` moves the batch that holds it (no GPU here)."""

    index: int
    log: list

    def pin_memory(self) -> _FakeTensor:
        self.log.append(("pin", self.index))
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> _FakeTensor:
        self.log.append(("copy", self.index, device.type, non_blocking))
        return self


@dataclass
class _FakeBatch:
    """A batch of one :class:`_FakeTensor`, mapped as a real batch maps its tensors."""

    tensor: _FakeTensor

    @property
    def index(self) -> int:
        return self.tensor.index

    def map_tensors(self, fn) -> _FakeBatch:
        return _FakeBatch(fn(self.tensor))


def test_to_device_on_cuda_copies_one_batch_ahead():
    log: list = []
    pulled: list = []
    batches = [_FakeBatch(_FakeTensor(i, log)) for i in range(4)]
    handed = to_device(_pulled(batches, pulled), torch.device("cuda"))
    assert next(handed).index == 0
    # batch 1 was pinned and its copy queued before batch 0 was handed out
    assert log == [("pin", 0), ("copy", 0, "cuda", True), ("pin", 1), ("copy", 1, "cuda", True)]
    assert next(handed).index == 1 and len(pulled) == 3
    handed.close()  # the consumer stops early: nothing more is pulled
    assert len(pulled) == 3
    log.clear()
    assert [b.index for b in to_device(iter(batches), torch.device("cuda"))] == [0, 1, 2, 3]
    assert [e for e in log if e[0] == "copy"] == [("copy", i, "cuda", True) for i in range(4)]
    assert list(to_device(iter([]), torch.device("cuda"))) == []


BATCHES = {
    "generate": lambda: random_generate_batch(3, 40, n_acts=4),
    "select": lambda: chitchat_select_batch(2, 3)[0],
}


@pytest.mark.parametrize("kind", BATCHES)
def test_a_batch_moves_and_pins_every_tensor_nested_ones_too(kind, monkeypatch):
    batch = BATCHES[kind]()
    on_meta = moved(batch, torch.device("meta"))
    assert type(on_meta) is type(batch) and on_meta.dialogue_id == batch.dialogue_id
    assert len(tensors(on_meta)) == len(tensors(batch)) > len(tensors(batch.history))
    assert all(t.device.type == "meta" for t in tensors(on_meta))
    pinned_ones: list[torch.Tensor] = []

    def pin(t: torch.Tensor) -> torch.Tensor:  # no accelerator here: record the call
        pinned_ones.append(t)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    out = pinned(batch)
    assert {id(t) for t in pinned_ones} == {id(t) for t in tensors(batch)}
    assert all(torch.equal(a, b) for a, b in zip(tensors(out), tensors(batch), strict=True))


def test_the_policy_places_a_module_on_its_device():
    policy = ExecutionPolicy.for_evaluation(Precision.FP32, torch.device("meta"))
    module = torch.nn.Linear(2, 2)
    assert policy.place(module) is module and module.weight.device.type == "meta"
