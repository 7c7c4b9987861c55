"""``infra/slurm/hiertx.sbatch`` on this machine: Slurm's commands replaced by stand-ins, a
real 2-node Ray cluster.

Stand-ins (first on PATH): ``scontrol show hostnames`` names two nodes, ``node-a`` and
``node-b``; ``srun -w NODE CMD`` notes the node and runs CMD here; ``hostname
--ip-address`` answers 127.0.0.1 (the script runs in a private network namespace whose
only interface is loopback, so its Ray nodes listen on nothing else). The script starts the
head (``srun -w node-a ray start --head --block``) and a worker (``-w node-b``), waits for
both, and runs the given command with ``RAY_ADDRESS`` and its job's token set: here a
driver that joins and counts the live nodes. On exit it stops both nodes by PID and
removes the token.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "infra" / "slurm" / "hiertx.sbatch"
STANDINS = {
    "scontrol": 'if [ "$1 $2" = "show hostnames" ]; then printf "node-a\\nnode-b\\n"; fi\n',
    "srun": (
        'while [ "${1#-}" != "$1" ]; do\n'
        '  if [ "$1" = -w ]; then echo "$2 $3" >>"$SRUN_LOG"; shift; fi; shift\n'
        'done\nexec "$@"\n'
    ),
    "hostname": 'if [ "$1" = --ip-address ]; then echo 127.0.0.1; else /bin/hostname "$@"; fi\n',
}
DRIVER = (
    "import os, ray; ray.init(); "
    "print('NODES', sum(n['Alive'] for n in ray.nodes()), os.environ['RAY_AUTH_MODE'])"
)


def test_the_script_is_valid_bash_and_requeues() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --open-mode=append" in text
    assert 'set -- make repro "JOBS=$jobs"' in text  # the default command
    assert "unshare" not in text.split("set -euo pipefail")[1]  # no namespaces on HPC nodes


@pytest.mark.slow
@pytest.mark.xdist_group("cluster")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_sbatch_starts_a_head_and_a_worker_and_runs_the_command_on_them(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STANDINS.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    project = tmp_path / "project"  # as the shared filesystem holds it: with its .venv
    project.mkdir()
    (project / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        "PYTHONPATH": str(REPO),
        "HOME": str(tmp_path),
        "HIERTX_DIR": str(project),
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_PER_TASK": "1",
        "SRUN_LOG": str(tmp_path / "srun.log"),
        "HIERTX_RAY_START_ARGS": f"--object-store-memory={200 * 2**20} --memory={2 * 2**30}",
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="hx", dir="/tmp"),  # short: Ray's socket paths
    }
    flags = ["-n"] if os.getuid() == 0 else ["-r", "-n"]
    run = f'ip link set lo up && exec {SCRIPT} python -c "{DRIVER}"'
    done = subprocess.run(
        ["unshare", *flags, "bash", "-c", run],
        cwd=project, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "NODES 2 token" in done.stdout, output[-4000:]
    started = (tmp_path / "srun.log").read_text().splitlines()
    assert started[0] == "node-a hostname"
    assert "node-a ray" in started and "node-b ray" in started
    assert not (project / ".ray-job-4242").exists()  # the job's token is gone
