"""The peers' steps differ from ours in the model's code alone: compiled, a peer's loss
is compiled with the settings the loop's policy compiles ours with, on a batch padded as
the loop pads ours (issue 50: the peers took a bare ``torch.compile``, static shapes
first and duck sizing, on the unpadded batch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.common import synthetic_batch
from bench.models import SCALES, seq2seq
from bench.steps import StepSettings, loop_step, peer_step
from pipeline.execution import PAD_MULTIPLE, ExecutionPolicy

TINY = SCALES["tiny"]


def test_a_compiled_peer_is_compiled_and_fed_as_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[dict[str, object]] = []
    shapes: list[tuple[int, ...]] = []
    real_compile, real_batches = nn.Module.compile, ExecutionPolicy.training_batches

    def compile_(module: nn.Module, *args: object, **kwargs: object) -> None:
        compiled.append(kwargs)
        return real_compile(module, *args, **kwargs)

    def training_batches(policy: ExecutionPolicy, batches):  # type: ignore[no-untyped-def]
        out = list(real_batches(policy, batches))
        shapes.extend(tuple(b.history.input_ids.shape) for b in out)
        return iter(out)

    monkeypatch.setattr(nn.Module, "compile", compile_)
    monkeypatch.setattr(ExecutionPolicy, "training_batches", training_batches)
    batch = synthetic_batch(2, 13, 5, TINY.vocab)
    settings = StepSettings(compile_backend="eager")
    torch.manual_seed(0)
    ours, _ = seq2seq("transformer", TINY)
    peer, peer_loss = seq2seq("torch", TINY)
    loop_step(ours, batch, "cpu", settings)  # built, not run: nothing compiles yet
    peer_step(peer, peer_loss, batch, "cpu", settings)
    assert compiled == [{"dynamic": True, "backend": "eager"}] * 2
    width = -(-13 // PAD_MULTIPLE) * PAD_MULTIPLE
    assert shapes == [(2, width)] * 2
