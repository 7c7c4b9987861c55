"""The ``ptb-curve`` diagnostic of the GPU check (``bench/gpu_check/curve.py``): its two
arms differ in the feeding alone and are validated as the reference validates; its
table and projection by hand; it runs only when named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import cli
from bench.gpu_check.curve import REFERENCE, arm_params, curve_rows, projection
from pipeline.config import LMProtocol
from pipeline.plan import load_checked

REPO = Path(__file__).resolve().parents[2]
PROFILE = load_checked(REPO / "profiles" / "paper.yaml")


def test_the_arms_differ_in_the_feeding_alone() -> None:
    documents, stream = arm_params(PROFILE, "documents"), arm_params(PROFILE, "stream")
    a, b = documents.train.run("gpt", "ptb"), stream.train.run("gpt", "ptb")
    assert (a.batch_size, a.schedule.warmup_steps) == (32, 300)  # issue 33's profile
    profile = PROFILE.train.run("gpt", "ptb")
    assert (
        (b.batch_size, b.schedule.warmup_steps)
        == (10, 3000)
        == (
            profile.batch_size,
            profile.schedule.warmup_steps,
        )
    )
    assert a.model_dump(exclude={"batch_size", "schedule"}) == b.model_dump(
        exclude={"batch_size", "schedule"}
    )
    assert a.schedule.model_dump(exclude={"warmup_steps"}) == b.schedule.model_dump(
        exclude={"warmup_steps"}
    )
    lms = [p.tokenize.corpora["ptb"].lm for p in (documents, stream)]
    assert [lm.layout for lm in lms] == ["documents", "stream"]
    for params, lm in zip((documents, stream), lms, strict=True):
        # validated (and tested) as the reference validates: 10 tokens after 130, by tokens
        assert lm.validation == params.evaluate.for_corpus("ptb").lm
        assert lm.validation.protocol is LMProtocol.STREAM and lm.validation.unit == "model"
        assert lm.validation.window("tokens") == ("tokens", 130, 10)


def test_curve_rows_and_projection_by_hand() -> None:
    rows = curve_rows({"documents": {1: 500.0, 2: 400.0}, "stream": {1: 380.0}})
    assert rows == [[1, "500.0", "380.0", "370.4"], [2, "400.0", "", "234.4"]]
    assert REFERENCE[10] == pytest.approx(111.45)
    # 1,362 steps x 175 epochs at 40 steps/s: 99 min a run; 12 runs 2 at once: 6 waves
    assert projection(1362, 175, 40.0, 2) == (
        "1.7 h a run; the 4 runs x 3 seeds, 2 at once: 9.9 h (3.3 h a seed)"
    )
    assert projection(1362, 175, 0.0, 2).startswith("n/a")


def test_it_runs_only_when_named() -> None:
    args = cli.parser().parse_args([])
    assert "ptb-curve" not in args.parts and "ptb-curve" in cli.DIAGNOSTICS
    assert cli.parser().parse_args(["--parts", "ptb-curve"]).parts == ["ptb-curve"]
    assert "ptb-curve" not in cli.PARTS  # the default parts' budgets fill the 8 minutes


@pytest.mark.slow
def test_smoke_run(shared_data: Path) -> None:
    command = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--smoke"]
    command += ["--parts", "ptb-curve", "--ptb", str(shared_data / "ptb")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "| epoch | documents: valid PPL | stream: valid PPL | reference |" in out
    assert "| 2 |" in out and "ptb-curve, stream: valid PPL after epoch 2" in out
