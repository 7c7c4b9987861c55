"""The training benchmark's candidates train on the same batch: ours through the
training loop's own step, the peers through their own code."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from bench import bench_train, steps
from bench.common import synthetic_batch
from bench.models import CANDIDATES, OURS, SCALES, seq2seq
from bench.steps import candidate_step
from pipeline.config import Precision
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
    model, loss_fn = seq2seq(name, TINY)
    model.eval()  # no dropout: the loss only moves with the weights
    first = float(loss_fn(batch).detach())
    assert abs(first - math.log(TINY.vocab)) < 1.5  # near-uniform predictions at init
    step = candidate_step(name, model, loss_fn, batch, "cpu", Precision.FP32)
    for _ in range(5):
        step()
    model.eval()
    assert float(loss_fn(batch).detach()) < first
    assert len(updates) == (5 if name in OURS else 0) and optimizers == [1]
    if name == "transformer_p0":
        attention = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
        assert attention and all(m.dropout == 0.0 for m in attention)


@pytest.mark.parametrize("flag", ["--dtype", "--precision", "--dtypes", "--precisions"])
def test_fp16_is_refused_as_the_loop_does_not_train_in_it(
    flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The benchmark's precisions are the training params' (the execution policy reads
    them): fp16 is not one, under the flag's older name too."""
    monkeypatch.setattr(sys, "argv", ["bench_train", flag, "fp16"])
    with pytest.raises(SystemExit):
        bench_train.main()
    assert "invalid Precision value: 'fp16'" in capsys.readouterr().err
