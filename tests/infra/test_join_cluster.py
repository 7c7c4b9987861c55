"""A stage joins the cluster it is on: on a node where ``ray start --head`` runs (the head of
a ``ray up`` cluster, where ``ray exec ... 'dvc repro'`` has no ``RAY_ADDRESS``), a train
stage's training runs on that cluster, not on a private one it would start itself.

The head runs in a private network namespace whose only interface is loopback (as
``infra/local_cluster.sh`` does), so it listens on nothing but 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_pipeline import DVC, edit_params, fresh_copy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare"),
]

SCRIPT = r"""
set -euo pipefail
ip link set lo up
ray get-auth-token --generate >/dev/null  # in this test's $HOME: ray start then turns auth on
ray start --head --port=6390 --num-cpus=2 --dashboard-host=127.0.0.1 \
  --disable-usage-stats --block >"$LOGS/head.log" 2>&1 &
head=$!
trap 'kill -TERM $head; wait $head || true' EXIT
up() { RAY_AUTH_MODE=token ray status --address 127.0.0.1:6390 >/dev/null 2>&1; }
for _ in $(seq 120); do up && break; sleep 1; done
up || { echo "the head did not come up" >&2; exit 1; }
"$DVC" repro train@transformer-chitchat
python -c "
import json, ray
ray.init(address='auto')
from ray.util.state import list_actors
print('ACTORS ' + json.dumps([a.class_name for a in list_actors(limit=10000)]))
"
"""


def test_a_train_stage_joins_the_ray_instance_running_here(tmp_path: Path) -> None:
    root = tmp_path / "p"
    fresh_copy(root)
    edit_params(root, "train.scale.num_workers", 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "DVC": DVC,
        "LOGS": str(tmp_path),
        "HOME": str(tmp_path),  # the cluster's token (~/.ray/auth_token) is this test's own
    }
    flags = ["-n"] if os.getuid() == 0 else ["-r", "-n"]
    done = subprocess.run(
        ["unshare", *flags, "bash", "-c", SCRIPT],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "ray: joined the Ray instance running on this machine at 127.0.0.1:6390" in output
    assert "started a private cluster" not in output
    assert "Token authentication is enabled" in (tmp_path / "head.log").read_text()
    line = next(x for x in output.splitlines() if x.startswith("ACTORS "))
    actors = json.loads(line.removeprefix("ACTORS "))
    assert "RayTrainWorker" in actors and "TrainController" in actors
