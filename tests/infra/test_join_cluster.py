"""A stage joins only the cluster it is given: ``$RAY_ADDRESS``, where ``auto`` names the
Ray instance ``ray start`` left on this machine (the head of a ``ray up`` cluster, whose
configs export it). A Ray head that merely runs on the machine, as anyone's plain
``ray start --head`` may, is not joined: the stage starts a private cluster and says
which instance it left alone.

The head is such a plain ``ray start --head`` (no ``--temp-dir``): it records its address
in Ray's default temp dir, here ``$TMPDIR/ray`` of this test (``/tmp/ray`` for a user), so
nothing outside the test sees it. It runs in a private network namespace whose only
interface is loopback (as ``infra/local_cluster.sh`` does), so it listens on nothing but
127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.cluster import ray_cluster
from pipeline.errors import ConfigError
from tests.projects import DVC, copy_tokenized, edit_params

needs_unshare = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
HEAD = "127.0.0.1:6390"

SCRIPT = r"""
set -euo pipefail
ip link set lo up
ray get-auth-token --generate >/dev/null  # in this test's $HOME: ray start then turns auth on
ray start --head --port=6390 --num-cpus=2 --dashboard-host=127.0.0.1 \
  --disable-usage-stats --block >"$LOGS/head.log" 2>&1 &
head=$!
trap 'kill -TERM $head; wait $head || true' EXIT
for _ in $(seq 1500); do
  grep -qF "Ray runtime started." "$LOGS/head.log" && break
  kill -0 $head || break
  sleep 0.2
done
grep -qF "Ray runtime started." "$LOGS/head.log" || { echo "the head did not come up" >&2; exit 1; }
# no RAY_ADDRESS: what a stage's `ray_cluster()` joins (the address of its GCS)
python - >"$LOGS/unasked.log" 2>&1 <<'EOF' || true
import ray
from pipeline.cluster import ray_cluster
with ray_cluster():
    print("GCS " + ray.get_runtime_context().gcs_address)
EOF
# RAY_ADDRESS=auto: a train stage, then the actors the head's cluster ran
RAY_ADDRESS=auto "$DVC" repro train@transformer-chitchat >"$LOGS/asked.log" 2>&1
python -c "
import json, ray
ray.init(address='auto')
from ray.util.state import list_actors
print('ACTORS ' + json.dumps([a.class_name for a in list_actors(limit=10000)]))
"
"""


@pytest.fixture(scope="module")
def on_a_head(
    tmp_path_factory: pytest.TempPathFactory, tokenized_tiny: Path
) -> Iterator[tuple[Path, str]]:
    """:data:`SCRIPT` run once, beside a plain ``ray start --head``, in a copy of the
    tokenized tiny project (the train stage is what it is about): its folder of logs and
    its output."""
    logs = tmp_path_factory.mktemp("join")
    root = logs / "p"
    copy_tokenized(tokenized_tiny, root)
    edit_params(root, "train.scale.num_workers", 1)
    # short: Ray's socket paths under it must fit in 107 bytes
    tmp = tempfile.mkdtemp(prefix="hiertx-join-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        "MLFLOW_TRACKING_URI": f"sqlite:///{logs / 'mlflow.db'}",
        "DVC": DVC,
        "LOGS": str(logs),
        "HOME": str(logs),  # the cluster's token (~/.ray/auth_token) is this test's own
        "TMPDIR": tmp,  # Ray's default temp dir, where `ray start` records its address
    }
    flags = ["-n"] if os.getuid() == 0 else ["-r", "-n"]
    try:
        done = subprocess.run(
            ["unshare", *flags, "bash", "-c", SCRIPT],
            cwd=root, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:] + (logs / "asked.log").read_text()[-5000:]
    yield logs, output


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@needs_unshare
def test_a_stage_does_not_join_a_ray_head_it_was_not_given(on_a_head: tuple[Path, str]) -> None:
    """Fails on the code that joined "the Ray instance running on this machine"."""
    unasked = (on_a_head[0] / "unasked.log").read_text()
    assert "ray: started a private cluster at 127.0.0.1:" in unasked, unasked[-3000:]
    assert f"not the Ray instance `ray start` left on this machine at {HEAD}" in unasked
    assert "RAY_ADDRESS=auto joins it" in unasked
    (gcs,) = [x.removeprefix("GCS ") for x in unasked.splitlines() if x.startswith("GCS ")]
    assert gcs != HEAD and gcs.startswith("127.0.0.1:")


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@needs_unshare
def test_ray_address_auto_runs_a_train_stage_on_the_ray_start_head(
    on_a_head: tuple[Path, str],
) -> None:
    logs, output = on_a_head
    asked = (logs / "asked.log").read_text()
    assert f"ray: joined the cluster at {HEAD} ($RAY_ADDRESS=auto: the Ray instance" in asked
    assert "started a private cluster" not in asked
    assert "Token authentication is enabled" in (logs / "head.log").read_text()
    line = next(x for x in output.splitlines() if x.startswith("ACTORS "))
    actors = json.loads(line.removeprefix("ACTORS "))
    assert "RayTrainWorker" in actors and "TrainController" in actors


def test_ray_address_auto_without_a_ray_instance_here_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's own ``auto`` would join any Ray instance it finds running, anyone's."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where `ray start` records its address
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with pytest.raises(ConfigError) as caught, ray_cluster():
        pytest.fail("joined a cluster")
    assert caught.value.key == "RAY_ADDRESS"
    assert "none runs here: start one (`ray start --head`)" in caught.value.reason


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_a_stage_joins_a_head_bound_to_loopback_by_its_address(
    on_ray_head: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """``RAY_ADDRESS=127.0.0.1:<port>`` of a head that listens on loopback only (the
    session's, ``tests/ray_head.py``), on a machine with a network address: Ray's own
    ``ray.init`` swaps 127.0.0.1 for that address and retries there for many minutes."""
    import ray

    address = os.environ["RAY_ADDRESS"]
    with ray_cluster():
        assert ray.get_runtime_context().gcs_address == address
    joined = f"ray: joined the cluster at {address} ($RAY_ADDRESS): 1 nodes, 2 CPUs"
    assert joined in capsys.readouterr().err
