"""``bench_study`` times the train stage's job through the training loop's own step, on
the run's own batches (issue 50: it timed a step of its own, plain Adam at the run's
learning rate, on batches planned by examples whatever the run said)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_study
from pipeline.train import loop


@pytest.mark.slow
def test_each_run_takes_the_loops_step_with_its_own_optimizer(
    tokenized_tiny: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    updates: list[tuple[str, str, float]] = []
    real_update = loop._Run.update

    def update(run: loop._Run, batch: object) -> object:
        group = run.optimizer.param_groups[0]
        updates.append((run.job.model_name, type(run.optimizer).__name__, group["betas"][1]))
        return real_update(run, batch)

    monkeypatch.setattr(loop._Run, "update", update)
    runs = ["transformer-chitchat", "gpt-chitchat"]
    argv = ["--params", str(tokenized_tiny / "params.yaml"), "--root", str(tokenized_tiny)]
    assert bench_study.main([*argv, "--runs", *runs, "--repeats", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {run} |" in out for run in runs) and "projected training:" in out
    # each run's own optimizer, from its params (Adam's betas: the params' default)
    assert sorted(updates) == sorted(
        [("transformer", "Adam", 0.98)] * 3 + [("gpt", "Adam", 0.98)] * 3
    )
