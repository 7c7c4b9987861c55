"""``bench_decode`` decodes under the evaluation policy's autocast of ``--precision``, as
the evaluate stage decodes (issue 50: it took ``--dtype`` and decoded in fp32 whatever it
said)."""

from __future__ import annotations

import sys

import pytest
import torch

from bench import bench_decode
from pipeline.execution import ExecutionPolicy


@pytest.mark.slow
def test_every_decode_runs_under_the_policys_autocast(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entered = []
    real = ExecutionPolicy.autocast

    def autocast(policy: ExecutionPolicy):  # type: ignore[no-untyped-def]
        entered.append(policy.autocast_dtype)
        return real(policy)

    monkeypatch.setattr(ExecutionPolicy, "autocast", autocast)
    argv = "--scale tiny --batch-size 2 --history 12 --max-length 2 --beam 2 --models s2sa"
    argv += " --repeats 1 --warmup 0 --precision bf16"
    monkeypatch.setattr(sys, "argv", ["bench_decode", *argv.split()])
    bench_decode.main()
    assert "| s2sa | beam 2 |" in capsys.readouterr().out
    # greedy and beam: a decode with and without the cache to compare, then one timed each
    assert entered == [torch.bfloat16] * (2 * (2 + 2))
