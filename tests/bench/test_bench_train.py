"""The training benchmark's candidates train on the same batch; the Ray step stamps."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from bench.bench_train import CANDIDATES, SCALES, StepStamps, build, train_step
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


def test_step_stamps_record_training_steps_only(tmp_path: Path) -> None:
    path = tmp_path / "stamps.jsonl"
    sink = StepStamps(str(path))()
    assert sink.recording  # the loop logs its training steps only to a recording sink
    sink.log_metrics({"train_loss": 1.0, "lr": 0.1}, step=1)
    sink.log_metrics({"valid_loss": 2.0, "epoch": 0.0}, step=1)
    sink.log_metrics({"train_loss": 0.9, "lr": 0.1}, step=2)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[0]["time"] <= lines[1]["time"] and lines[0]["threads"] >= 1
