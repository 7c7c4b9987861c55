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


# Stand-ins that only record: srun notes its whole command line, ray notes `start` and
# blocks (as --block does) until the script's cleanup stops it, `ray status` lists one node
# per `ray start`, make notes its arguments.
RECORDING = {
    "scontrol": STANDINS["scontrol"],
    "hostname": STANDINS["hostname"],
    "srun": (
        'echo "$*" >>"$SRUN_LOG"\n'
        'while [ "${1#-}" != "$1" ]; do\n'
        '  if [ "$1" = -w ]; then shift; fi; shift\n'
        'done\nexec "$@"\n'
    ),
    "make": 'echo "make $*" >>"$SRUN_LOG"\n',
}
VENV_RAY = (
    'case "$1" in\n'
    '  start) echo "$*" >>"$RAY_LOG"; exec sleep 120 ;;\n'
    '  status) for n in $(grep -c "^start" "$RAY_LOG"); do seq "$n" | sed "s/^/ node_/"; done ;;\n'
    "esac\n"
)


def recording_job(tmp_path: Path, **slurm: str) -> tuple[Path, dict[str, str]]:
    """A project with a stand-in .venv (its ray records, its python is this one) and the
    environment of a 2-node Slurm job, every Slurm command a recording stand-in."""
    bin_dir = tmp_path / "bin"
    venv_bin = tmp_path / "project" / ".venv" / "bin"
    for folder in (bin_dir, venv_bin):
        folder.mkdir(parents=True)
    tools = {**{bin_dir / n: body for n, body in RECORDING.items()}, venv_bin / "ray": VENV_RAY}
    tools[venv_bin / "python"] = f'exec {sys.executable} "$@"\n'
    for path, body in tools.items():
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
    env |= {
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        "HOME": str(tmp_path),
        "HIERTX_DIR": str(tmp_path / "project"),
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SRUN_LOG": str(tmp_path / "srun.log"),
        "RAY_LOG": str(tmp_path / "ray.log"),
        **slurm,
    }
    return tmp_path / "project", env


def test_ray_steps_get_the_jobs_cpus_its_gres_gpus_and_a_temp_dir_of_their_own(
    tmp_path: Path,
) -> None:
    """``sbatch --gres=gpu:8 --cpus-per-task=32``: Slurm sets SLURM_GPUS_ON_NODE=8 (not
    SLURM_GPUS_PER_NODE, which only --gpus-per-node sets) and SLURM_CPUS_PER_TASK=32, which
    srun no longer inherits from Slurm 22.05. Every Ray step gets all 32 cores
    (--cpus-per-task), declares 8 GPUs, and keeps its sockets in /tmp/ray-<job id>; make
    gets JOBS = nodes x GPUs. b8b1803's script declared 0 GPUs, ran make with JOBS=2, and
    left each Ray node bound to one core in the node's shared /tmp/ray."""
    project, env = recording_job(tmp_path, SLURM_CPUS_PER_TASK="32", SLURM_GPUS_ON_NODE="8")
    done = subprocess.run(
        [str(SCRIPT)], cwd=project, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = (tmp_path / "srun.log").read_text().splitlines()
    ray_steps = [s for s in steps if " ray start " in f" {s} "]
    assert len(ray_steps) == 2, steps
    assert all("--cpus-per-task=32" in s.split(" ray start")[0] for s in ray_steps), ray_steps
    starts = (tmp_path / "ray.log").read_text().splitlines()
    assert len(starts) == 2 and "--head" in starts[0].split(), starts
    for start in starts:
        args = start.split()
        assert {"--num-cpus=32", "--num-gpus=8", "--temp-dir=/tmp/ray-4242"} <= set(args), args
    assert steps[-1] == "make repro JOBS=16", steps
    assert not (project / ".ray-job-4242").exists()


def test_a_missing_corpus_stops_the_job_before_ray_starts(tmp_path: Path) -> None:
    """Compute nodes usually have no internet: a corpus not downloaded (on a login node,
    ``dvc repro download``) stops the job with that advice before any Ray node starts,
    instead of a download stage failing hours into the job."""
    project, env = recording_job(tmp_path, SLURM_CPUS_PER_TASK="4", SLURM_GPUS_PER_NODE="2")
    (project / "params.yaml").write_text("corpora: [chitchat, ptb]\n")
    (project / "data" / "raw" / "chitchat").mkdir(parents=True)
    (project / "data" / "raw" / "chitchat" / "SOURCES.json").write_text("{}")
    done = subprocess.run(
        [str(SCRIPT)], cwd=project, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "corpus not downloaded: ptb " in done.stderr, done.stderr
    assert "dvc repro download" in done.stderr
    assert not (tmp_path / "srun.log").exists() and not (tmp_path / "ray.log").exists()
    # downloaded: the job goes on (GPUs from --gpus-per-node when SLURM_GPUS_ON_NODE is unset)
    (project / "data" / "raw" / "ptb").mkdir()
    (project / "data" / "raw" / "ptb" / "SOURCES.json").write_text("{}")
    done = subprocess.run(
        [str(SCRIPT)], cwd=project, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert all("--num-gpus=2" in s for s in (tmp_path / "ray.log").read_text().splitlines())
    # a temp dir too long for Ray's socket paths is refused up front
    env["HIERTX_RAY_TMPDIR"] = "/tmp/" + "x" * 60
    done = subprocess.run(
        [str(SCRIPT)], cwd=project, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "too long" in done.stderr, done.stderr


def test_the_script_is_valid_bash_and_requeues() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --open-mode=append" in text
    assert 'set -- make repro "JOBS=$jobs"' in text  # the default command
    assert "unshare" not in text.split("set -euo pipefail")[1]  # no namespaces on HPC nodes


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
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
    env["HIERTX_RAY_TMPDIR"] = env["RAY_TMPDIR"]  # the job's --temp-dir (not /tmp/ray-4242)
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
