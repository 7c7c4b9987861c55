"""The training benchmark's candidates train on the same batch."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from bench.bench_train import CANDIDATES, SCALES, build, train_step
from bench.common import synthetic_batch
from pipeline.models.layers import MultiHeadAttention

TINY = SCALES["tiny"]
ARGS = argparse.Namespace(device="cpu", dtype="fp32")


@pytest.mark.parametrize(
    "name", [pytest.param(c, marks=pytest.mark.slow) if c == "bart" else c for c in CANDIDATES]
)
def test_candidate_learns_the_batch(name: str) -> None:
    torch.manual_seed(0)
    batch = synthetic_batch(3, 20, 6, TINY.vocab, seed=1)
    model, loss_fn = build(name, TINY)
    model.eval()  # no dropout: the loss only moves with the weights
    first = float(loss_fn(batch).detach())
    assert abs(first - math.log(TINY.vocab)) < 1.5  # near-uniform predictions at init
    step = train_step(model, loss_fn, batch, ARGS)
    for _ in range(5):
        step()
    model.eval()
    assert float(loss_fn(batch).detach()) < first
    if name == "transformer_p0":
        attention = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
        assert attention and all(m.dropout == 0.0 for m in attention)
