"""``make repro JOBS=2`` on a real multi-node Ray cluster (``infra/local_cluster.sh``: a
head with no CPUs for trainings and two worker nodes with one CPU each, so two training
slots), as the README tells a user to run it:

- trainings overlap, as MLflow's metric timestamps show, never more than the slots;
- every seed's weights are ``torch.equal`` to a serial run's (``dvc repro`` one stage at a
  time, seeds on a private cluster) and no MLflow run, metric or registered version is
  lost to the concurrent writers of the one ``sqlite:`` store;
- ``dvc status`` is clean afterwards and a second ``make repro`` runs nothing;
- a worker node killed (its raylet, by PID) in the middle of a training: the run resumes
  from its last checkpoint on another node and ends with the serial run's weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline.artifacts import SavedModel
from tests.test_pipeline import (
    DVC,
    USER_PATH,
    VENV,
    dvc_json,
    edit_params,
    fresh_copy,
    ran,
    run,
    user_env,
)

pytestmark = pytest.mark.slow

SLOTS = 2  # two worker nodes with one CPU each; each training takes one CPU
CLUSTER = ["infra/local_cluster.sh", "--workers", "2", "--cpus", "1", "--head-cpus", "0", "--"]
PARAMS: dict[str, object] = {
    "train.runs": {
        "transformer-chitchat": {"model": "transformer", "corpus": "chitchat"},
        "gpt-chitchat": {"model": "gpt", "corpus": "chitchat"},
    },
    "train.defaults.seeds": 2,
    "train.scale.num_workers": 1,
    # long enough to be killed after a checkpoint, short enough for CI
    "train.models.transformer.epochs": 200,
    "train.models.transformer.max_steps": 40,
    "train.models.transformer.checkpoint_every": 5,
    "train.placement.max_failures": 1,  # placement: changes nothing DVC tracks
    "tracking.log_model": True,
    "tracking.register_model": True,
}
TRAIN_STAGES = ["train@transformer-chitchat", "train@gpt-chitchat", "train_tuned@hier-chitchat"]
RUNS = ["transformer-chitchat", "gpt-chitchat", "hier-chitchat"]


def project(root: Path) -> dict[str, str]:
    """A fresh copy with :data:`PARAMS`; the environment of a user who activated the venv
    (``infra/local_cluster.sh`` runs ``ray``), with an MLflow store of its own."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs the project's venv (run through `make test`)")
    fresh_copy(root)
    for key, value in PARAMS.items():
        edit_params(root, key, value)
    mlflow_db = root.parent / f"{root.name}-mlflow.db"
    path = f"{VENV / 'bin'}{os.pathsep}{USER_PATH}"
    return user_env(mlflow_db, path) | {"OMP_NUM_THREADS": "1"}


def seed_weights(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``{"<run>/seed-<i>": weights}`` of every exported model."""
    models = sorted((root / "data" / "train").glob("*/seed-*/model.pt"))
    return {f"{p.parent.parent.name}/{p.parent.name}": SavedModel.read(p).weights for p in models}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """The weights of the serial run: each train stage in turn, no cluster running."""
    root = tmp_path_factory.mktemp("serial") / "p"
    env = project(root)
    run(root, env, DVC, "repro", *TRAIN_STAGES)
    weights = seed_weights(root)
    assert len(weights) == 2 * len(RUNS), sorted(weights)
    return weights


def training_intervals(tracking_uri: str) -> list[tuple[float, float]]:
    """``(first, last)`` timestamp (s) of each MLflow run's ``train_loss`` history: when a
    training's worker was stepping."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    intervals = []
    for found in client.search_runs(experiments, max_results=1000):
        history = client.get_metric_history(found.info.run_id, "curves/train_loss")
        if history:
            stamps = [m.timestamp / 1000 for m in history]
            intervals.append((min(stamps), max(stamps)))
    return intervals


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, change in events:  # an end before a start at the same instant
        running += change
        peak = max(peak, running)
    return peak


def test_make_repro_jobs_2_fills_the_cluster_and_equals_the_serial_run(
    tmp_path: Path, serial: dict[str, dict[str, torch.Tensor]]
) -> None:
    root = tmp_path / "p"
    env = project(root)
    make = ["make", "-o", str(VENV / ".installed"), f"VENV={VENV}", "repro"]
    output = run(root, env, *CLUSTER, *make, "JOBS=2")
    assert "ray: joined the cluster at 127.0.0.1:6380 ($RAY_ADDRESS)" in output
    assert "started a private cluster" not in output

    intervals = training_intervals(env["MLFLOW_TRACKING_URI"])
    assert len(intervals) >= 2 * len(RUNS)  # every seed's run, and the search's trial
    assert 2 <= most_at_once(intervals) <= SLOTS, intervals

    got = seed_weights(root)
    assert got.keys() == serial.keys()
    assert all(same(serial[k], got[k]) for k in serial), "weights differ from the serial run"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    for key in RUNS:
        versions = client.search_model_versions(f"name = 'hiertx-{key}'")
        assert len(versions) == 2, (key, [v.version for v in versions])  # one per seed

    assert dvc_json(root, env, "status") == {}
    again = run(root, env, *make, "JOBS=2")
    assert not ran(again), again[-2000:]


def _kill_a_worker_node_after_a_checkpoint(process: subprocess.Popen, storage: Path) -> int:
    """Wait until Ray Train has registered a checkpoint of both transformer seeds (one per
    worker node), then SIGKILL the raylet of the node of one of them; the raylet's PID.

    A checkpoint folder exists before the controller records it (in its snapshot); a
    node killed in between restarts that seed from step 0, which tests nothing."""
    deadline = time.monotonic() + 600
    while sum(map(_registered, storage.glob("train-transformer-chitchat-*"))) < 2:
        assert process.poll() is None, "the training ended before a node could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for worker in pids("ray::RayTrainWorker"):
        raylet = parent(worker)
        if raylet and "raylet" in Path(f"/proc/{raylet}/cmdline").read_text(errors="replace"):
            os.kill(raylet, signal.SIGKILL)
            return raylet
    raise AssertionError("no Ray Train worker under a raylet")


def _registered(run: Path) -> bool:
    try:
        snapshot = json.loads((run / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return False
    return snapshot.get("latest_checkpoint_result") is not None


def pids(pattern: str) -> Iterator[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    yield from (int(p) for p in found.stdout.split())


def alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_a_killed_worker_node_resumes_to_the_serial_weights(
    tmp_path: Path, serial: dict[str, dict[str, torch.Tensor]]
) -> None:
    root = tmp_path / "p"
    env = project(root)
    process = subprocess.Popen(
        [*CLUSTER, DVC, "repro", "train@transformer-chitchat"], cwd=root, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    killed = _kill_a_worker_node_after_a_checkpoint(process, root / "runs" / "ray")
    output, _ = process.communicate(timeout=900)
    (tmp_path / "output.log").write_text(output)
    assert process.returncode == 0, output[-5000:]
    assert not alive(killed)
    assert "resumed from the checkpoint of step" in output, output[-3000:]

    got = seed_weights(root)
    for seed in ("transformer-chitchat/seed-0", "transformer-chitchat/seed-1"):
        assert same(serial[seed], got[seed]), f"{seed} differs from the uninterrupted run"
