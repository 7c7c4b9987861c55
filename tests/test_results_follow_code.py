"""A result is what ``dvc.lock`` says it is, run the way a user runs the project (``dvc``
in a copy at the tiny profile, tokenized already: the ``tokenized_tiny`` fixture; one
training, ``dvc repro -s`` where one stage is meant):

- a code change retrains: editing the loop in the copy makes ``dvc repro`` start a fresh
  run (new run name, new weights, a new MLflow run), not export the old code's weights;
- ``kill -9`` in the middle of a training and ``dvc repro`` of unchanged code resume it,
  to weights equal to an uninterrupted run's;
- a torn newest checkpoint falls back to the one before, again to equal weights; with no
  intact checkpoint the stage says how to start over;
- a diverging configuration fails the stage: no model, no metrics, the MLflow run FAILED.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from pipeline.artifacts import SavedModel
from tests.projects import DVC, copy_tokenized, edit_params, run, venv_env

STAGE = "train@transformer-chitchat"
MODEL = Path("data/train/transformer-chitchat/model.pt")
# Long enough to be killed after its first checkpoint, short enough for CI.
LONGER = {
    "train.models.transformer.epochs": 200,
    "train.models.transformer.max_steps": 120,
    "train.models.transformer.checkpoint_every": 5,
}

pytestmark = pytest.mark.slow


def project(tokenized_tiny: Path, root: Path, **params: object) -> dict[str, str]:
    """A copy of the tokenized tiny project with ``params`` changed; its environment (an
    MLflow store of its own beside it)."""
    copy_tokenized(tokenized_tiny, root)
    for key, value in params.items():
        edit_params(root, key, value)
    return venv_env(root.parent / f"{root.name}-mlflow.db")


def weights(root: Path) -> dict[str, torch.Tensor]:
    return SavedModel.read(root / MODEL).weights


def run_name(output: str) -> str:
    match = re.search(r"(train-transformer-chitchat-[0-9a-f]{10})", output)
    assert match, output[-3000:]
    return match.group(1)


def checkpoints(root: Path, name: str) -> Path:
    return root / "runs" / "ray" / name


def test_a_code_change_retrains(tokenized_tiny: Path, tmp_path: Path) -> None:
    root = tmp_path / "p"
    env = project(tokenized_tiny, root)
    first = run(root, env, DVC, "repro", STAGE)
    before, name = weights(root), run_name(first)
    assert "starting fresh" in first

    loop = root / "pipeline" / "train" / "loop.py"
    code = loop.read_text()
    assert "(out.loss * scale).backward()" in code
    loop.write_text(
        code.replace("(out.loss * scale).backward()", "(out.loss * scale * 0.5).backward()")
    )
    second = run(root, env, DVC, "repro", STAGE)
    assert f"Running stage '{STAGE}'" in second  # DVC sees the code dependency change
    assert run_name(second) != name
    assert f"the code changed since {name}" in second
    after = weights(root)
    assert any(not torch.equal(before[k], after[k]) for k in before)

    unchanged = run(root, env, DVC, "repro", "-f", "-s", STAGE)  # same code: resumes, same weights
    assert "resuming" in unchanged and run_name(unchanged) == run_name(second)
    assert all(torch.equal(after[k], weights(root)[k]) for k in after)


def _kill_after_first_checkpoint(root: Path, env: dict[str, str]) -> str:
    process = subprocess.Popen(
        [DVC, "repro", STAGE], cwd=root, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not list((root / "runs" / "ray").glob("train-transformer-chitchat-*/checkpoint.pt")):
        assert process.poll() is None, "the training ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return process.stdout.read() if process.stdout else ""


def test_kill_9_then_repro_resumes_to_the_uninterrupted_weights(
    tokenized_tiny: Path, tmp_path: Path
) -> None:
    whole = tmp_path / "whole"
    env = project(tokenized_tiny, whole, **LONGER)
    run(whole, env, DVC, "repro", STAGE)
    expected = weights(whole)

    killed = tmp_path / "killed"
    env = project(tokenized_tiny, killed, **LONGER)
    _kill_after_first_checkpoint(killed, env)
    assert not (killed / MODEL).exists()
    resumed = run(killed, env, DVC, "repro", STAGE)
    assert re.search(r"resuming train-transformer-chitchat-\w+ from step [1-9]\d*", resumed)
    got = weights(killed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)

    # a torn newest checkpoint: the one before is resumed from, to the same weights
    name = run_name(resumed)
    newest = checkpoints(killed, name) / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    fallback = run(killed, env, DVC, "repro", "-f", "-s", STAGE)
    assert "passing over a checkpoint that does not read" in fallback
    assert all(torch.equal(expected[k], weights(killed)[k]) for k in expected)

    # no intact checkpoint: the stage says how to start over, and that works
    for path in checkpoints(killed, name).glob("checkpoint*.pt"):
        path.write_bytes(b"not a checkpoint")
    refused = run(killed, env, DVC, "repro", "-f", "-s", STAGE, ok=False)
    assert "start the run over: rm -r" in refused and "Traceback" not in refused
    assert "weights_only" not in refused
    command = refused.split("start the run over: ", 1)[1].splitlines()[0]
    run(killed, env, "bash", "-c", command)
    run(killed, env, DVC, "repro", STAGE)
    assert all(torch.equal(expected[k], weights(killed)[k]) for k in expected)


def test_a_diverging_run_fails_its_stage(tokenized_tiny: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    root = tmp_path / "p"
    env = project(tokenized_tiny, root, **{"train.models.transformer.optimizer": {"lr": 1.0e6}})
    failed = run(root, env, DVC, "repro", STAGE, ok=False)
    assert re.search(r"diverged at step \d+", failed), failed[-3000:]
    assert "optimizer.lr (1e+06)" in failed and "Traceback" not in failed
    assert not (root / MODEL).exists()
    assert not (root / "metrics" / "transformer-chitchat.json").exists()
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    (experiment,) = [
        e for e in client.search_experiments() if e.name.endswith("-generate-chitchat")
    ]
    runs = client.search_runs([experiment.experiment_id])
    assert runs and all(r.info.status == "FAILED" for r in runs)
    assert not client.search_registered_models()
