"""The images hold the project, not a working copy's state, at the versions the tests ran.

* The build context: ``.dockerignore`` applied with the Docker SDK's own implementation of
  its rules (``docker.utils.build.exclude_paths``, what ``docker-py`` sends as the context)
  to a working copy with the heavy folders it has: ``.venv`` (~2 GB), ``data/``, ``runs/``,
  ``mlflow.db`` stay out; ``pipeline/data/``, ``tests/data/`` and ``.git`` go in.
* One lock: ``constraints.txt`` pins every installed distribution at the version in this
  environment (what ``make setup`` installs), and ``make setup``, ``infra/Dockerfile`` and
  the ``ray up`` configs all install with ``-c constraints.txt``; the MLflow server image
  pins its drivers at the same versions.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from docker.utils.build import exclude_paths
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
HEAVY = [".venv/lib/site.py", "data/shards/x.arrow", "runs/ray/x", "mlflow.db", "mlruns/0/x"]
KEPT = [
    "pipeline/data/__init__.py",
    "tests/data/__init__.py",
    ".git/HEAD",
    "dvc.yaml",
    "constraints.txt",
]


def constraints() -> dict[str, str]:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    pins = [Requirement(line) for line in lines if line and not line.startswith("#")]
    return {canonicalize_name(p.name): str(p.specifier).removeprefix("==") for p in pins}


def test_the_build_context_leaves_the_working_copy_state_out(tmp_path: Path) -> None:
    for name in HEAVY + KEPT:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    context = set(exclude_paths(str(tmp_path), patterns, dockerfile="infra/Dockerfile"))
    assert set(KEPT) <= context, sorted(set(KEPT) - context)
    assert not context & set(HEAVY), sorted(context & set(HEAVY))
    assert not {".venv", "data", "runs"} & context


def test_one_lock_for_make_setup_the_images_and_the_cloud_configs() -> None:
    pins = constraints()
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()
    }
    for name in ("ray", "mlflow", "dvc", "pyarrow", "numpy", "psycopg2-binary"):
        assert pins[name] == installed[name], name
    assert "torch" not in pins  # pinned in pyproject.toml: the CPU wheel here is 2.13.0+cpu
    makefile = (REPO / "Makefile").read_text()
    assert "pip install -q -c constraints.txt -e" in makefile
    assert "constraints.txt" in makefile.split("$(VENV)/.installed:")[1].splitlines()[0]
    dockerfile = (REPO / "infra" / "Dockerfile").read_text()
    assert "COPY --chown=ray:users constraints.txt" in dockerfile
    assert dockerfile.count("-c constraints.txt") == 2
    server = (REPO / "infra" / "mlflow" / "Dockerfile").read_text()
    drivers = dict(re.findall(r"([a-z0-9-]+)==([0-9.]+)", server.split("pip install")[1]))
    assert drivers["psycopg2-binary"] == pins["psycopg2-binary"]
    assert server.startswith("#") and f"mlflow:v{installed['mlflow']}" in server
