"""A real two-node Ray cluster on this machine runs a DDP TorchTrainer across both nodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_two_node_cluster_places_one_worker_per_node(tmp_path: Path) -> None:
    # the script runs the `ray` CLI of this interpreter's environment (not activated by make)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        [str(REPO / "infra" / "local_cluster.sh"), "--workers", "1", "--",
         sys.executable, str(REPO / "infra" / "smoke_ddp.py"), "--storage", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=REPO, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("SMOKE "))
    result = json.loads(line.removeprefix("SMOKE "))
    assert result["world_size"] == 2
    assert len(result["nodes"]) == 2, "STRICT_SPREAD must put the two ranks on two nodes"
    assert result["grads_agree"]
    # everything the script started is gone: no Ray process of that cluster survives
    leftover = subprocess.run(["pgrep", "-f", "hiertx-cluster"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
