"""Smoke runs of the benchmark scripts at toy sizes (no timing is asserted)."""

from __future__ import annotations

import sys

import pytest

from bench import bench_decode, bench_hier_attention, bench_train, profile_step

TOY = ["--repeats", "1", "--warmup", "0"]
RUNS = {
    "train": (
        bench_train,
        "--scale tiny --models transformer transformer_p0 unet torch --batch-size 2 "
        "--history 12 --target 5 --peak-tflops 100",
        "| TFLOP/s | MFU | speed vs bart |",
    ),
    "decode": (
        bench_decode,
        "--scale tiny --batch-size 2 --history 12 --max-length 3 --beam 2",
        "| s2sa | beam 2 |",
    ),
    "hier": (
        bench_hier_attention,
        "--histories 24 --batch-tokens 48 --d-model 8 --d-ff 8 --heads 2 --layers 1 "
        "--vocab 40 --target 4",
        "| 2 x 24 |",
    ),
    "profile": (
        profile_step,
        "--scale tiny --batch-size 2 --history 12 --target 5 --max-length 2 --models transformer",
        "| transformer | train step |",
    ),
}


@pytest.mark.parametrize("name", RUNS)
def test_script_runs_and_prints_its_table(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module, argv, expected = RUNS[name]
    monkeypatch.setattr(sys, "argv", [module.__file__, *TOY, *argv.split()])
    module.main()
    out = capsys.readouterr().out
    assert expected in out
    assert "load average at start" in out and "command: `" in out
    assert "| NO |" not in out  # decode: cached and re-decoded tokens agree
