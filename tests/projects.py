"""Copies of the project for the tests that run it as a user does (``dvc``, ``make``).

Two kinds: :func:`fresh_copy`, a git clone's worth of the working tree at
``profiles/tiny.yaml`` with nothing run yet (what the fresh-clone tests start from), and
:func:`copy_tokenized`, a copy of one such clone in which ``check``, ``download@chitchat``
and ``tokenize@chitchat`` already ran (:func:`tokenized_tiny`, built once per test run and
shared by the tests about what comes after tokenizing).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
DVC = str(VENV / "bin" / "dvc")
TIMEOUT_S = 1200
# What a user's shell has: system folders and a Python with no project packages (the one
# the venv was made from), and no venv.
USER_PATH = os.pathsep.join(
    ["/usr/local/bin", "/usr/bin", "/bin", str(Path(sys.base_prefix) / "bin")]
)
NOT_FROM_USER_SHELL = (
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "PYTHONHOME",
    "MAKEFLAGS",
    "MFLAGS",
    "MAKELEVEL",
)
# What tokenizing a fresh copy at the tiny profile runs, in this order.
TOKENIZE_STAGES = ["check", "download@chitchat", "tokenize@chitchat"]


def project_files() -> list[str]:
    """What a commit of the working tree holds: tracked and untracked-but-not-ignored."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


def user_env(mlflow_db: Path, path: str = USER_PATH) -> dict[str, str]:
    """The environment of a user's shell (no venv on PATH unless ``path`` adds it), with an
    MLflow store of the test's own and no telemetry."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_FROM_USER_SHELL}
    return env | {
        "PATH": path,
        "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_db}",
        "DVC_NO_ANALYTICS": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }


def venv_env(mlflow_db: Path) -> dict[str, str]:
    """This process's environment with the venv first on PATH (a stage's ``python`` is the
    venv's), an MLflow store of the test's own, one thread."""
    return {
        **os.environ,
        "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_db}",
        "DVC_NO_ANALYTICS": "1",
        "OMP_NUM_THREADS": "1",
    }


def run(root: Path, env: dict[str, str], *args: str, ok: bool = True) -> str:
    """``args`` run in ``root``; their output, asserted to succeed (or, ``ok=False``, fail)."""
    result = subprocess.run(
        args, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = result.stdout + result.stderr
    if ok:
        assert result.returncode == 0, f"{' '.join(args)} failed:\n{output[-6000:]}"
    else:
        assert result.returncode != 0, f"{' '.join(args)} succeeded:\n{output[-6000:]}"
    return output


def dvc_json(root: Path, env: dict[str, str], *args: str) -> Any:
    result = subprocess.run(
        [DVC, *args, "--json"], cwd=root, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"dvc {' '.join(args)} failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout)


def ran(output: str) -> set[str]:
    """The stages ``dvc repro`` ran, as its output names them."""
    return set(ran_in_order(output))


def ran_in_order(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def git(root: Path, *args: str) -> str:
    who = ["-c", "user.name=ci", "-c", "user.email=ci@example.com"]
    return subprocess.run(
        ["git", *who, *args], cwd=root, capture_output=True, text=True, check=True
    ).stdout


def fresh_copy(root: Path) -> None:
    """A git clone's worth of the project with the tiny profile as params.yaml."""
    for name in project_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    shutil.copy2(REPO / "profiles" / "tiny.yaml", root / "params.yaml")
    (root / "dvc.lock").unlink(missing_ok=True)  # a fresh pipeline for the tiny params
    shutil.rmtree(root / "metrics", ignore_errors=True)  # results of the default params
    shutil.rmtree(root / "plots", ignore_errors=True)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "fresh clone")


def edit_params(root: Path, dotted: str, value: Any) -> None:
    raw = yaml.safe_load((root / "params.yaml").read_text())
    node = raw
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def tokenized_tiny(folder: Path) -> Path:
    """``folder/tiny``: a fresh copy after ``dvc repro tokenize@chitchat``, which runs
    exactly :data:`TOKENIZE_STAGES` (asserted). Built by the first caller; the others (the
    xdist workers of one test run share ``folder``) wait on a file lock and reuse it.
    Never written into: tests take a :func:`copy_tokenized`."""
    from filelock import FileLock

    root = folder / "tiny"
    done = folder / "tiny.done"
    with FileLock(str(folder / "tiny.lock")):
        if not done.is_file():
            shutil.rmtree(root, ignore_errors=True)  # a build that failed half-way
            fresh_copy(root)
            env = venv_env(folder / "tiny-mlflow.db")
            output = run(root, env, DVC, "repro", "tokenize@chitchat")
            assert ran_in_order(output) == TOKENIZE_STAGES, output[-3000:]
            done.write_text(output)
    return root


def copy_tokenized(template: Path, root: Path) -> None:
    """``root``: a copy of ``template`` (:func:`tokenized_tiny`), its git history, DVC cache
    and tokenized shards included, so ``dvc repro`` there starts after tokenize."""
    shutil.copytree(template, root, symlinks=True)
