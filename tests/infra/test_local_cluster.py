"""A real two-node Ray cluster on this machine runs a DDP TorchTrainer across both nodes."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_two_node_cluster_places_one_worker_per_node(tmp_path: Path) -> None:
    # the script runs the `ray` CLI of this interpreter's environment (not activated by make)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    smoke = [sys.executable, str(REPO / "infra" / "smoke_ddp.py"), "--storage", str(tmp_path)]
    private = tmp_path / "private"
    private.mkdir()
    probe = [sys.executable, "-c", PROBE, str(tmp_path), str(private)]
    mounted = f"mount --make-rprivate / && mount -t tmpfs tmpfs {private} && {shlex.join(probe)}"
    done = subprocess.run(
        [str(REPO / "infra" / "local_cluster.sh"), "--workers", "1", "--",
         "bash", "-c", f"{shlex.join(smoke)} && unshare -m bash -c {shlex.quote(mounted)}"],
        capture_output=True, text=True, timeout=900, cwd=REPO, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("SMOKE "))
    result = json.loads(line.removeprefix("SMOKE "))
    assert result["world_size"] == 2
    assert len(result["nodes"]) == 2, "STRICT_SPREAD must put the two ranks on two nodes"
    assert result["grads_agree"]
    # the probe that guards a multi-node run: every node sees a folder of the shared disk,
    # none sees one of this process's private /tmp
    line = next(x for x in done.stdout.splitlines() if x.startswith("PROBE "))
    assert json.loads(line.removeprefix("PROBE ")) == {"shared": [], "private": ["127.0.0.1"]}
    # everything the script started is gone: no Ray process of that cluster survives
    leftover = subprocess.run(["pgrep", "-f", "hiertx-cluster"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
