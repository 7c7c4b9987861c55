"""A training killed with SIGKILL and resumed keeps one MLflow history, each step once:
the train stage in a subprocess, killed right after it logged a step past its last
checkpoint, resumed by a second run of the stage, against an uninterrupted run's history
(``pipeline.tracking.tracker``: the loop's metrics are logged once per step)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import mlflow
import pytest

from pipeline.plan import RunRequest, checked, plan_training
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from tests.train.conftest import stage_params

REPO = Path(__file__).resolve().parents[2]
KEY = "transformer-chitchat"
# 12 steps, a checkpoint every 4, an evaluation every 3, every step's train metrics logged
TRAIN = {
    "epochs": 1,
    "max_batches_per_epoch": 12,
    "checkpoint_every": 4,
    "eval_every": 3,
    "log_every": 1,
}
KILL_AT = 11  # after step 8's checkpoint: steps 9-11 (and step 9's evaluation) logged twice

_STAGE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path

    from pipeline.plan import RunRequest, checked
    from pipeline.tracking import Tracker
    from pipeline.train.training import train_seeds
    from tests.train.test_tracked_resume import params

    kill_at = int(sys.argv[2])
    logged = Tracker.log_metrics

    def log_then_die(self, metrics, step):
        logged(self, metrics, step)  # in the store before the kill
        if step == kill_at and "train_loss" in metrics:
            os.kill(os.getpid(), signal.SIGKILL)

    Tracker.log_metrics = log_then_die
    train_seeds(RunRequest.of(checked(params()), "transformer-chitchat"), Path(sys.argv[1]), False)
    """
)


def params() -> dict:
    """The run's params.yaml content (also read by the subprocess)."""
    raw = stage_params(tracking={"log_model": False, "sample_generations": 0})
    raw["train"]["defaults"] |= TRAIN
    return raw


def _stage(root: Path, kill_at: int = 0) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
    }
    return subprocess.run(
        [sys.executable, "-c", _STAGE, str(root), str(kill_at)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _histories(root: Path, status: str = "FINISHED") -> dict[str, list[tuple[int, float]]]:
    """Every ``curves/*`` key of the project's one run (its status ``status``: a killed
    process leaves it RUNNING): its (step, value) points in order."""
    client = mlflow.tracking.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name("hiertx-generate-chitchat").experiment_id]
    )
    assert run.info.status == status
    keys = sorted(k for k in run.data.metrics if k.startswith("curves/"))
    return {
        key: [
            (m.step, m.value)
            for m in sorted(
                client.get_metric_history(run.info.run_id, key),
                key=lambda m: (m.step, m.timestamp),
            )
        ]
        for key in keys
    }


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once(project: Path, tmp_path: Path) -> None:
    """Issue 34: after kill -9 at step ~114 and a resume from step 100's checkpoint,
    curves/train_loss held steps 101-120 twice."""
    roots = {}
    for name in ("whole", "killed"):
        roots[name] = tmp_path / name
        shutil.copytree(project / "data" / "shards", roots[name] / "data" / "shards")
    whole = _stage(roots["whole"])
    assert whole.returncode == 0, whole.stderr[-3000:]

    killed = _stage(roots["killed"], KILL_AT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    plan = plan_training(RunRequest.of(checked(params()), KEY), roots["killed"])
    checkpoint = Path(plan.storage) / plan.name / CHECKPOINT_FILE
    assert TrainingState.read(checkpoint).position.step == 8
    before = _histories(roots["killed"], status="RUNNING")
    assert before["curves/train_loss"][-1][0] == KILL_AT  # logged past the checkpoint
    resumed = _stage(roots["killed"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {plan.name} from step 8" in resumed.stderr

    expected = _histories(roots["whole"])
    got = _histories(roots["killed"])
    assert {"curves/train_loss", "curves/valid_loss", "curves/lr"} <= set(expected)
    assert set(got) == set(expected)
    for key, points in expected.items():
        steps = [step for step, _ in got[key]]
        assert steps == sorted(set(steps)), f"{key}: a step logged twice"
        assert steps == [step for step, _ in points], key
        if not key.endswith("_per_s"):  # throughputs are the clock's
            assert got[key] == points, key  # the resume is exact: the same values
    assert [step for step, _ in expected["curves/train_loss"]] == list(range(1, 13))
