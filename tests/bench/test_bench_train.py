"""The training benchmark's candidates train on the same batch: ours through the
training loop's own step, the peers through their own code."""

from __future__ import annotations

import math

import pytest
import torch

from bench import steps
from bench.bench_train import CANDIDATES, OURS, SCALES, build, candidate_step
from bench.common import synthetic_batch
from pipeline.data.batch import Batch
from pipeline.models.layers import MultiHeadAttention
from pipeline.train import loop, optim

TINY = SCALES["tiny"]


@pytest.mark.parametrize(
    "name", [pytest.param(c, marks=pytest.mark.slow) if c == "bart" else c for c in CANDIDATES]
)
def test_candidate_learns_the_batch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every candidate's step lowers its loss on the batch; ours take the loop's own step
    (its ``update``), every one the project's optimizer (issue 40: the benchmark timed a
    step of its own, with its own optimizer)."""
    updates, optimizers = [], []
    real_update = loop._Run.update

    def update(run: loop._Run, b: Batch) -> object:
        updates.append(1)
        return real_update(run, b)

    def make_optimizer(*args: object) -> object:
        optimizers.append(1)
        return optim.make_optimizer(*args)

    monkeypatch.setattr(loop._Run, "update", update)
    for module in (loop, steps):  # where each step builds its optimizer
        monkeypatch.setattr(module, "make_optimizer", make_optimizer)
    torch.manual_seed(0)
    batch = synthetic_batch(3, 20, 6, TINY.vocab, seed=1)
    model, loss_fn = build(name, TINY)
    model.eval()  # no dropout: the loss only moves with the weights
    first = float(loss_fn(batch).detach())
    assert abs(first - math.log(TINY.vocab)) < 1.5  # near-uniform predictions at init
    step = candidate_step(name, model, loss_fn, batch, "cpu", "fp32")
    for _ in range(5):
        step()
    model.eval()
    assert float(loss_fn(batch).detach()) < first
    assert len(updates) == (5 if name in OURS else 0) and optimizers == [1]
    if name == "transformer_p0":
        attention = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
        assert attention and all(m.dropout == 0.0 for m in attention)


def test_fp16_is_refused_as_the_loop_does_not_train_in_it() -> None:
    model, loss_fn = build("transformer", TINY)
    batch = synthetic_batch(2, 10, 4, TINY.vocab)
    with pytest.raises(SystemExit, match="--dtype fp16: the loop trains in fp32 or bf16"):
        candidate_step("transformer", model, loss_fn, batch, "cpu", "fp16")
