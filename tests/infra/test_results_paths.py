"""Every remote path the docs give ends with the results in the user's bucket
(``python -m pipeline results``, ``pipeline/results.py``): the ``ray job submit`` commands of
README.md, infra/README.md and the configs' headers, the KubeRay RayJob's entrypoint and the
Slurm script. Each is run here with a stand-in ``python`` that records its arguments and
exits as told: the bucket is checked before the run, the results are pushed after it
whatever its outcome, and the command's exit status is the run's (or the push's, when only
the push failed).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.infra.test_docs import DOCS, HEADERS, blocks
from tests.infra.test_slurm import SCRIPT, recording_job

REPO = Path(__file__).resolve().parents[2]
RAYJOB = REPO / "infra" / "kuberay" / "rayjob.yaml"
URL = "s3://hiertx-bucket/results"
PYTHON = """#!/bin/sh
echo "python $*" >>"$LOG"
case "$*" in
  "-m pipeline.repro"*) exit "${REPRO_EXIT:-0}" ;;
  "-m pipeline results check"*) exit "${CHECK_EXIT:-0}" ;;
  "-m pipeline results push"*) exit "${PUSH_EXIT:-0}" ;;
esac
"""


def job_scripts() -> list[tuple[str, str]]:
    """(where, the bash script) of every ``ray job submit`` that runs the pipeline in the
    docs and the configs' headers, and of the RayJob's entrypoint."""
    found = []
    for path in DOCS + HEADERS:
        for block in blocks(path):
            text = re.sub(r"(?m)^#", "", block) if path.suffix == ".yaml" else block
            for script in re.findall(r"ray job submit [^']*bash -lc '([^']*)'", text):
                if "pipeline.repro" in script:
                    found.append((str(path.relative_to(REPO)), script))
    entrypoint = yaml.safe_load(RAYJOB.read_text())["spec"]["entrypoint"]
    found.append(("infra/kuberay/rayjob.yaml", re.fullmatch(r"bash -lc '(.*)'", entrypoint)[1]))
    return found


SCRIPTS = job_scripts()


def run_job(script: str, tmp_path: Path, **env: str) -> tuple[int, list[str]]:
    """``script`` in a stand-in project (profiles, a writable data/) with the recording
    ``python``; its exit status and the python command lines it ran."""
    project = tmp_path / "project"
    (project / "profiles").mkdir(parents=True, exist_ok=True)
    (project / "data").mkdir(exist_ok=True)
    for profile in ("paper", "tiny"):
        (project / "profiles" / f"{profile}.yaml").write_text("{}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(PYTHON)
    (bin_dir / "python").chmod(0o755)
    log = tmp_path / "python.log"
    log.write_text("")
    script = re.sub(r"cd (~|/home/ray)/hiertx", f"cd {project}", script)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HIERTX_")}
    full_env |= {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log)}
    full_env |= {"HIERTX_PROFILE": "paper", **env}
    done = subprocess.run(["bash", "-c", script], env=full_env, capture_output=True, timeout=60)
    return done.returncode, log.read_text().splitlines()


def test_the_docs_and_the_rayjob_are_all_found() -> None:
    where = {w for w, _ in SCRIPTS}
    assert where >= {
        "README.md",
        "infra/README.md",
        "infra/ray/aws.yaml",
        "infra/ray/gcp.yaml",
        "infra/kuberay/raycluster.yaml",
        "infra/kuberay/rayjob.yaml",
    }, where


@pytest.mark.parametrize(("where", "script"), SCRIPTS, ids=[w for w, _ in SCRIPTS])
def test_a_job_checks_the_bucket_first_and_pushes_its_results_whatever_the_outcome(
    where: str, script: str, tmp_path: Path
) -> None:
    code, calls = run_job(script, tmp_path, HIERTX_RESULTS_URL=URL)
    assert code == 0, calls
    kinds = [c.split()[4] if " results " in c else "repro" for c in calls]
    assert kinds == ["check", "repro", "push"], calls
    targets = {c.split()[5] if len(c.split()) > 5 else "$HIERTX_RESULTS_URL" for c in calls[::2]}
    assert len(targets) == 1, calls  # checked where it is pushed
    # a failed run: its results are pushed all the same, the job fails with the run's status
    code, calls = run_job(script, tmp_path, HIERTX_RESULTS_URL=URL, REPRO_EXIT="3")
    assert code == 3 and "results push" in calls[-1], calls
    # a failed push fails the job, even after a run that went well
    code, calls = run_job(script, tmp_path, HIERTX_RESULTS_URL=URL, PUSH_EXIT="1")
    assert code != 0 and "results push" in calls[-1], calls
    # a bucket that cannot work stops the job before the run
    code, calls = run_job(script, tmp_path, HIERTX_RESULTS_URL=URL, CHECK_EXIT="2")
    assert code != 0 and not any("pipeline.repro" in c for c in calls), calls


def test_the_rayjob_pushes_each_run_to_a_folder_of_its_own_and_needs_the_bucket(
    tmp_path: Path,
) -> None:
    script = dict(SCRIPTS)["infra/kuberay/rayjob.yaml"]
    _, calls = run_job(script, tmp_path, HIERTX_RESULTS_URL=URL)
    check, push = calls[0].split()[-1], calls[-1].split()[-1]
    assert check == push and re.fullmatch(rf"{URL}/\d{{8}}T\d{{6}}Z", push), calls
    code, calls = run_job(script, tmp_path)  # HIERTX_RESULTS_URL unset
    assert code != 0 and calls == [], calls
    doc = yaml.safe_load(RAYJOB.read_text())
    for pod in [doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]]:
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
        assert env["HIERTX_RESULTS_URL"].startswith("s3://"), env


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_ray_up_nodes_know_the_results_bucket(name: str) -> None:
    cfg = yaml.safe_load((REPO / "infra" / "ray" / name).read_text())
    setup = " ".join(cfg["setup_commands"])
    scheme = "s3" if name == "aws.yaml" else "gs"
    assert f"'export HIERTX_RESULTS_URL={scheme}://" in setup
    if scheme == "gs":  # DVC's remote on a gs:// bucket needs its plugin
        assert "dvc-gs" in cfg["setup_commands"][0]


def slurm_python(project: Path) -> None:
    """The stand-in .venv's python records ``-m pipeline results`` and exits as told; any
    other use (the script's corpus check) runs the real one."""
    python = project / ".venv" / "bin" / "python"
    real = python.read_text().splitlines()[-1]
    python.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  "-m pipeline results check"*) echo "python $*" >>"$SRUN_LOG"; '
        'exit "${CHECK_EXIT:-0}" ;;\n'
        '  "-m pipeline results push"*) echo "python $*" >>"$SRUN_LOG"; '
        'exit "${PUSH_EXIT:-0}" ;;\n'
        f"esac\n{real}\n"
    )


def run_sbatch(tmp_path: Path, **extra: str) -> tuple[int, list[str], str]:
    project, env = recording_job(tmp_path, SLURM_CPUS_PER_TASK="4", SLURM_GPUS_ON_NODE="1")
    slurm_python(project)
    (project / ".venv" / "bin" / "python").chmod(0o755)
    done = subprocess.run(
        [str(SCRIPT)], cwd=project, env={**env, **extra}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    log = tmp_path / "srun.log"
    return done.returncode, log.read_text().splitlines() if log.exists() else [], done.stderr


@pytest.mark.slow
def test_the_slurm_job_checks_the_bucket_before_ray_and_pushes_at_the_end(
    tmp_path: Path,
) -> None:
    code, steps, err = run_sbatch(tmp_path / "a", HIERTX_RESULTS_URL=URL)
    assert code == 0, err[-2000:]
    assert steps[0] == f"python -m pipeline results check {URL}", steps
    assert steps[-2:] == ["make repro JOBS=2", f"python -m pipeline results push {URL}"], steps
    # the bucket cannot work: no Ray node starts
    code, steps, err = run_sbatch(tmp_path / "b", HIERTX_RESULTS_URL=URL, CHECK_EXIT="2")
    assert code == 2 and steps == [f"python -m pipeline results check {URL}"], steps
    # a failed push fails the job
    code, steps, err = run_sbatch(tmp_path / "c", HIERTX_RESULTS_URL=URL, PUSH_EXIT="1")
    assert code == 1 and steps[-1].startswith("python -m pipeline results push"), steps
    # no bucket named: the results stay in the project, and the job says so
    code, steps, err = run_sbatch(tmp_path / "d")
    assert code == 0 and not any("results" in s for s in steps), steps
    assert "HIERTX_RESULTS_URL unset: the results stay in" in err


@pytest.mark.slow
def test_the_slurm_job_pushes_after_a_failed_run_and_keeps_its_status(tmp_path: Path) -> None:
    project, env = recording_job(tmp_path, SLURM_CPUS_PER_TASK="4", SLURM_GPUS_ON_NODE="1")
    slurm_python(project)
    make = tmp_path / "bin" / "make"
    make.write_text('#!/bin/sh\necho "make $*" >>"$SRUN_LOG"\nexit 3\n')
    done = subprocess.run(
        [str(SCRIPT)], cwd=project, env={**env, "HIERTX_RESULTS_URL": URL},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    steps = (tmp_path / "srun.log").read_text().splitlines()
    assert done.returncode == 3, done.stderr[-2000:]
    assert steps[-1] == f"python -m pipeline results push {URL}", steps
