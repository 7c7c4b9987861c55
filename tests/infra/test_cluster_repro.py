"""A real multi-node Ray cluster (``infra/local_cluster.sh``: a head with no CPUs for
trainings and two worker nodes with one CPU each, so two training slots), started once for
this module as a user starts it, and the commands a user runs on it
(:class:`tests.infra.local_cluster.LocalCluster` runs them inside the script's network
namespace), in the order ``tests/timing.py`` ranks them:

- ``make repro JOBS=2`` as the README tells a user to run it (tokenized already), as on a
  cloud: Ray Train's storage in a bucket of an S3 server (moto) that the nodes reach as a
  cloud's nodes reach S3. The search, the trainings and the evaluations on the cluster;
  trainings overlap, as MLflow's metric timestamps show, never more than the slots; every
  seed's weights are ``torch.equal`` to a serial run's (``dvc repro`` one stage at a time,
  in-process, MLflow off: ``num_workers: 0``, which ``tests/train/test_distributed.py``
  shows a 1-worker Ray run equals, and this test shows again for these models and seeds);
  no MLflow run, metric or registered version is lost to the concurrent writers of the
  project's one ``sqlite:`` store; ``dvc status`` is clean afterwards (so a second ``make
  repro`` would run nothing: ``tests/test_repro.py`` shows ``--jobs`` runs none then).
  Then issue 48's "done when": ``make push-results`` to the bucket (the DVC remote, the
  bundle with ``dvc.lock``, the metrics, the report and the MLflow store), the project
  deleted, and in a fresh clone ``make pull-results`` brings back every file byte for
  byte, the models with them, and the MLflow runs, with ``dvc status`` clean;
- a DDP job across two nodes (``infra/smoke_ddp.py``: one rank per node, all-reduced
  gradients agree), and the probe that guards a multi-node run (every node sees a folder of
  the shared disk, none a folder private to the driver);
- last, as it costs the cluster a node: a worker node killed (its raylet, found under the
  script's own processes) in the middle of a training: the run resumes from its last
  checkpoint on the other node and ends with the serial run's weights.

When the module ends, the script stops the cluster: none of its processes is left.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline.artifacts import SavedModel
from tests.infra.local_cluster import REPO, Command, LocalCluster, alive, cmdline, parent
from tests.projects import (
    DVC,
    USER_PATH,
    VENV,
    copy_tokenized,
    dvc_json,
    edit_params,
    run,
    user_env,
)
from tests.s3_server import S3Server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("cluster"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare"),
]

SLOTS = 2  # two worker nodes with one CPU each; each training takes one CPU
NODES = ["--workers", "2", "--cpus", "1", "--head-cpus", "0"]
# Two runs, each of two seeds: a trained one and a tuned one (the search's trial trains on
# the cluster too). The transformer's seeds train long enough (24 steps, about 40 s on 2
# cores) to overlap though their workers start seconds apart, and for a node to be killed
# after a checkpoint; the other trainings take the tiny profile's few steps.
PARAMS: dict[str, object] = {
    "train.runs": {"transformer-chitchat": {"model": "transformer", "corpus": "chitchat"}},
    "train.defaults.seeds": 2,
    "train.scale.num_workers": 1,
    "train.models.transformer.epochs": 200,
    "train.models.transformer.max_steps": 24,
    "train.models.transformer.checkpoint_every": 5,
    "train.placement.max_failures": 1,  # placement: changes nothing DVC tracks
    "tracking.log_model": True,
    "tracking.register_model": True,
}
TRAIN_STAGES = ["train@transformer-chitchat", "train_tuned@hier-chitchat"]
RUNS = ["transformer-chitchat", "hier-chitchat"]
# An S3 server inside the cluster's network namespace (the tests' own, outside it, is out of
# its reach): the nodes start with its endpoint and credentials in their environment.
CLUSTER_S3 = S3Server("http://127.0.0.1:9000")
BUCKET = "hiertx-cluster"
MAKE = ["make", "-o", str(VENV / ".installed"), f"VENV={VENV}"]


def project(root: Path, tokenized: Path, **params: object) -> dict[str, str]:
    """A copy of ``tokenized`` (the tokenized tiny project) with :data:`PARAMS` (and
    ``params``, dotted keys); the environment of a user who activated the venv
    (``infra/local_cluster.sh`` runs ``ray``), with an MLflow store of its own."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs the project's venv (run through `make test`)")
    copy_tokenized(tokenized, root)
    for key, value in (PARAMS | params).items():
        edit_params(root, key, value)
    mlflow_db = root.parent / f"{root.name}-mlflow.db"
    return user_env(mlflow_db, venv_path()) | {"OMP_NUM_THREADS": "1"}


def venv_path() -> str:
    return f"{VENV / 'bin'}{os.pathsep}{USER_PATH}"


def seed_weights(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``{"<run>/seed-<i>": weights}`` of every exported model."""
    models = sorted((root / "data" / "train").glob("*/seed-*/model.pt"))
    return {f"{p.parent.parent.name}/{p.parent.name}": SavedModel.read(p).weights for p in models}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def serial(
    tmp_path_factory: pytest.TempPathFactory, tokenized_tiny: Path
) -> dict[str, dict[str, torch.Tensor]]:
    """The weights of the serial run: each train stage in turn, in-process
    (``num_workers: 0``), no cluster involved, MLflow off (``tracking.enabled: false``).

    The tests compare weights alone, and no train or tune stage depends on a ``tracking``
    param (``dvc.yaml``): MLflow records what a training computes. Off, it spares the
    reference what costs most besides its steps: its SQLite store, a metric written there
    every step, a pyfunc model logged and registered per seed. A tracker that changed the
    weights would make these tests fail, not pass."""
    root = tmp_path_factory.mktemp("serial") / "p"
    settings = {"train.scale.num_workers": 0, "tracking.enabled": False}
    env = project(root, tokenized_tiny, **settings)
    output = run(root, env, DVC, "repro", *TRAIN_STAGES)
    assert "in this process" in output  # the train stages' line: no Ray Train workers
    weights = seed_weights(root)
    assert len(weights) == 2 * len(RUNS), sorted(weights)
    return weights


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The module's cluster, up until its last test has run; then stopped, and every
    process the script started checked gone."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs the project's venv (run through `make test`)")
    folder = tmp_path_factory.mktemp("cluster")
    # the script runs the `ray` CLI of the environment the user activated
    env = os.environ | CLUSTER_S3.env | {"PATH": venv_path()}
    started = LocalCluster(folder, NODES, env).start()
    assert "local_cluster.sh: 3 nodes up at 127.0.0.1:6380" in started.log
    yield started
    left = started.stop()
    assert not left, f"processes of the cluster outlived the script: {left}"
    assert not started.workdir.exists(), "the script left its folder behind"


# Run in the namespace: create the bucket once the server answers; list a bucket's keys.
CREATE_BUCKET = """
import sys, time
from tests.s3_server import S3Server
deadline = time.monotonic() + 120
while True:
    try:
        S3Server(sys.argv[1]).client().create_bucket(Bucket=sys.argv[2])
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
"""
LIST_KEYS = """
import sys
from tests.s3_server import S3Server
print("KEYS", *S3Server(sys.argv[1]).keys(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def bucket(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """:data:`BUCKET` on :data:`CLUSTER_S3`, started in the cluster's namespace for the
    tests that need it; stopped before the cluster."""
    stop = tmp_path_factory.mktemp("s3") / "stop"
    port = CLUSTER_S3.endpoint.rsplit(":", 1)[1]
    server = cluster.popen(
        REPO, cluster.env, sys.executable, "-m", "tests.s3_server", port, str(stop)
    )
    try:
        cluster.run(
            REPO, cluster.env, sys.executable, "-c", CREATE_BUCKET, CLUSTER_S3.endpoint, BUCKET
        )
        yield BUCKET
    finally:
        stop.touch()
        assert server.wait(60) == 0, server.output[-3000:]


def bucket_keys(cluster: LocalCluster, name: str) -> list[str]:
    output = cluster.run(
        REPO, cluster.env, sys.executable, "-c", LIST_KEYS, CLUSTER_S3.endpoint, name
    )
    return next(x for x in output.splitlines() if x.startswith("KEYS")).split()[1:]


def files_under(root: Path, *tops: str) -> dict[str, bytes]:
    """``{path: content}`` of the files at or under each of ``tops``."""
    found = {}
    for top in tops:
        path = root / top
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found.update({p.relative_to(root).as_posix(): p.read_bytes() for p in paths})
    return found


def mlflow_runs(tracking_uri: str) -> list[tuple[str, str]]:
    """``(run name, its final metrics as JSON)`` of every run of the store, sorted."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(experiments, max_results=1000)
    return sorted((r.info.run_name, json.dumps(r.data.metrics, sort_keys=True)) for r in found)


def whole(cluster: LocalCluster) -> LocalCluster:
    """The cluster with its three nodes: the killed-node test, which costs one, runs last."""
    assert not cluster.lost_a_node, "a node was killed by an earlier test"
    return cluster


# pipeline.cluster.unshared with every node counted as remote (they all are 127.0.0.1 here),
# on a folder of the shared disk, then on one over which the probing process alone (its own
# mount namespace) mounts a tmpfs: the nodes see the empty folder beneath, not the probe.
PROBE = """
import json, os, sys
from pathlib import Path
import ray
from pipeline import cluster
ray.init(address=os.environ["RAY_ADDRESS"])
cluster._remote = lambda: [(n["NodeID"], "127.0.0.1") for n in ray.nodes() if n["Alive"]]
shared, private = cluster.unshared(Path(sys.argv[1])), cluster.unshared(Path(sys.argv[2]))
print("PROBE " + json.dumps({"shared": shared, "private": sorted(set(private))}))
"""


def test_ddp_places_one_worker_per_node_and_the_probe_sees_what_nodes_share(
    tmp_path: Path, cluster: LocalCluster
) -> None:
    smoke = [sys.executable, str(REPO / "infra" / "smoke_ddp.py"), "--storage", str(tmp_path)]
    private = tmp_path / "private"
    private.mkdir()
    probe = [sys.executable, "-c", PROBE, str(tmp_path), str(private)]
    mounted = f"mount --make-rprivate / && mount -t tmpfs tmpfs {private} && {shlex.join(probe)}"
    script = f"{shlex.join(smoke)} && unshare -m bash -c {shlex.quote(mounted)}"
    output = whole(cluster).run(REPO, cluster.env, "bash", "-c", script, timeout_s=900)
    line = next(x for x in output.splitlines() if x.startswith("SMOKE "))
    result = json.loads(line.removeprefix("SMOKE "))
    assert result["world_size"] == 2
    assert len(result["nodes"]) == 2, "STRICT_SPREAD must put the two ranks on two nodes"
    assert result["grads_agree"]
    # every node sees a folder of the shared disk, none sees one of this process's private /tmp
    line = next(x for x in output.splitlines() if x.startswith("PROBE "))
    assert json.loads(line.removeprefix("PROBE ")) == {"shared": [], "private": ["127.0.0.1"]}


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


def test_make_repro_jobs_2_on_the_cluster_equals_the_serial_run_and_outlives_it(
    tmp_path: Path,
    cluster: LocalCluster,
    bucket: str,
    serial: dict[str, dict[str, torch.Tensor]],
    tokenized_tiny: Path,
) -> None:
    """From the tokenized tiny project: what a fresh clone's ``make repro`` does first is
    ``tests/test_pipeline.py``'s; the cluster runs what follows, then the results go to the
    bucket and come back into a fresh clone."""
    root = tmp_path / "p"
    storage = {"HIERTX_STORAGE_PATH": f"s3://{bucket}/ray"}
    env = project(root, tokenized_tiny) | CLUSTER_S3.env | storage  # the head's shell
    del env["MLFLOW_TRACKING_URI"]  # the project's own store (mlflow.db), which results carry
    output = whole(cluster).run(root, env, *MAKE, "repro", "JOBS=2")
    assert "ray: joined the cluster at 127.0.0.1:6380 ($RAY_ADDRESS)" in output
    assert "started a private cluster" not in output

    store = f"sqlite:///{root / 'mlflow.db'}"
    intervals = training_intervals(store)
    assert len(intervals) >= 2 * len(RUNS)  # every seed's run, and the search's trial
    assert 2 <= most_at_once(intervals) <= SLOTS, intervals

    got = seed_weights(root)
    assert got.keys() == serial.keys()
    assert all(same(serial[k], got[k]) for k in serial), "weights differ from the serial run"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    for key in RUNS:
        versions = client.search_model_versions(f"name = 'hiertx-{key}'")
        assert len(versions) == 2, (key, [v.version for v in versions])  # one per seed

    assert dvc_json(root, env, "status") == {}  # a second make would run nothing
    assert any(k.startswith("ray/train-transformer-chitchat") for k in bucket_keys(cluster, bucket))

    # the cluster's last step: its results to the bucket; then the cluster's disk is gone
    url = f"s3://{bucket}/results"
    pushed = cluster.run(root, env, *MAKE, "push-results", f"REMOTE={url}")
    assert f"make pull-results REMOTE={url}" in pushed, pushed[-3000:]
    results = ["dvc.lock", "params.yaml", "metrics", "reports", "data/train"]
    kept = files_under(root, *results)
    runs = mlflow_runs(store)
    assert len(runs) > 2 * len(RUNS)  # the seeds' runs, the search and its trial, evaluations
    shutil.rmtree(root)

    # on the laptop: a fresh clone of the commit the run was at, the documented command
    laptop = tmp_path / "laptop"
    run(tmp_path, env, "git", "clone", "-q", str(tokenized_tiny), str(laptop))
    team = f"sqlite:///{tmp_path / 'team.db'}"
    laptop_env = env | {"MLFLOW_TRACKING_URI": team}
    pulled = cluster.run(laptop, laptop_env, *MAKE, "pull-results", f"REMOTE={url}")
    assert "runs copied" in pulled, pulled[-3000:]
    got_back = files_under(laptop, *results)
    assert got_back.keys() == kept.keys()
    assert [name for name in kept if got_back[name] != kept[name]] == []
    assert all(same(serial[k], w) for k, w in seed_weights(laptop).items())
    assert dvc_json(laptop, laptop_env, "status") == {}
    assert mlflow_runs(team) == runs  # every run, with its metrics


def _kill_its_node_after_a_checkpoint(
    cluster: LocalCluster, command: Command, storage: Path
) -> int:
    """Wait until Ray Train has registered a checkpoint of the transformer's training, then
    SIGKILL the raylet of the node its worker runs on; the raylet's PID. Only the cluster's
    own processes are searched: other Ray instances on the machine (other tests', other
    users') are not touched.

    A checkpoint folder exists before the controller records it (in its snapshot); a
    node killed in between restarts the training from step 0, which tests nothing."""
    deadline = time.monotonic() + 600
    while not any(map(_registered, storage.glob("train-transformer-chitchat-*"))):
        assert command.poll() is None, "the training ended before a node could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for worker in sorted(cluster.processes()):
        if not cmdline(worker).startswith("ray::RayTrainWorker"):
            continue
        raylet = parent(worker)
        if raylet and "raylet" in cmdline(raylet):
            os.kill(raylet, signal.SIGKILL)
            cluster.lost_a_node = True
            return raylet
    raise AssertionError("no Ray Train worker under a raylet of the cluster")


def _registered(run: Path) -> bool:
    try:
        snapshot = json.loads((run / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return False
    return snapshot.get("latest_checkpoint_result") is not None


def test_a_killed_worker_node_resumes_to_the_serial_weights(
    tmp_path: Path,
    cluster: LocalCluster,
    serial: dict[str, dict[str, torch.Tensor]],
    tokenized_tiny: Path,
) -> None:
    """One seed (the serial run's first): the other node is free to take it over at once."""
    root = tmp_path / "p"
    env = project(root, tokenized_tiny, **{"train.defaults.seeds": 1})
    command = whole(cluster).popen(root, env, DVC, "repro", "train@transformer-chitchat")
    killed = _kill_its_node_after_a_checkpoint(cluster, command, root / "runs" / "ray")
    status = command.wait(900)
    output = command.output
    assert status == 0, output[-5000:]
    assert not alive(killed)
    assert "resumed from the checkpoint of step" in output, output[-3000:]

    got = SavedModel.read(root / "data" / "train" / "transformer-chitchat" / "model.pt")
    assert same(serial["transformer-chitchat/seed-0"], got.weights), "differs from the serial run"
