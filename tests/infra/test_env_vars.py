"""Every environment variable ``infra/`` sets or documents is one something reads: ours
(``HIERTX_*``) by the project's code or scripts, Ray's and MLflow's by the installed Ray and
MLflow. A launcher exporting ``HIERTX_STORAGE`` while the code reads ``HIERTX_STORAGE_PATH``
(checkpoints silently on the head's local disk) fails here. A variable a launcher substitutes
itself (``$HIERTX_PROFILE`` in the RayJob's entrypoint, ``${MLFLOW_ALLOWED_HOSTS}`` in
Docker Compose) is read by that launcher."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import mlflow
import pytest
import ray

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
OURS = ("pipeline", "stages", "infra")  # infra's own scripts read some (local_cluster.sh)
VARIABLE = re.compile(r"\b((?:HIERTX|RAY|MLFLOW)_[A-Z0-9_]+)\b")
TEXT = (".py", ".sh", ".sbatch", ".yaml", ".yml", ".md", ".env", ".example", "Dockerfile")


def _files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name.endswith(suffixes)]


def infra_variables() -> dict[str, list[str]]:
    """Each variable named in ``infra/``, with the files that name it."""
    found: dict[str, list[str]] = {}
    for path in _files(INFRA, TEXT):
        for name in set(VARIABLE.findall(path.read_text())):
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


@cache
def _sources(package_dir: Path) -> str:
    return "\n".join(p.read_text(errors="ignore") for p in _files(package_dir, (".py",)))


def _ours() -> str:
    # code and scripts only: a variable named only where it is documented is not read
    return "\n".join(p.read_text() for f in OURS for p in _files(REPO / f, (".py", ".sh")))


@cache
def _substituted() -> str:
    """What ``infra/`` substitutes itself: ``$NAME`` or ``${NAME...}`` in a launcher's
    shell line (a RayJob's entrypoint) or in Docker Compose's interpolation."""
    return "\n".join(p.read_text() for p in _files(INFRA, TEXT))


def reader(name: str) -> str | None:
    """Who reads ``name``: our code, a launcher's own substitution, Ray or MLflow (None:
    nobody)."""
    if re.search(rf"\b{name}\b", _ours()) and name.startswith("HIERTX_"):
        return "hiertx"
    if re.search(rf"\$\{{?{name}\b", _substituted()):
        return "infra"
    if name.startswith("RAY_") and name in _sources(Path(ray.__file__).parent):
        return "ray"
    if name.startswith("MLFLOW_") and name in _sources(Path(mlflow.__file__).parent):
        return "mlflow"
    return None


VARIABLES = infra_variables()


def test_infra_names_variables() -> None:
    assert "HIERTX_STORAGE_PATH" in VARIABLES and "MLFLOW_TRACKING_URI" in VARIABLES


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_every_infra_variable_is_read(name: str) -> None:
    assert reader(name) is not None, (
        f"{name} (in {', '.join(VARIABLES[name])}) is read by neither hiertx nor Ray nor "
        "MLflow: a typo, or a variable the code renamed"
    )


def test_the_code_reads_the_storage_variable_the_launchers_set() -> None:
    from pipeline.cluster import STORAGE_ENV

    assert STORAGE_ENV == "HIERTX_STORAGE_PATH"
    for config in (
        "ray/aws.yaml",
        "ray/gcp.yaml",
        "kuberay/raycluster.yaml",
        "kuberay/rayjob.yaml",
    ):
        assert STORAGE_ENV in (INFRA / config).read_text(), config
