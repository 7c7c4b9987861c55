"""The code a training runs, as part of what identifies it.

A training resumes from the checkpoint of a run of the same identity (``RunPlan.name``),
so the identity must change whenever the result would: params, data, and code. The code
is the sources :data:`TRAINING_CODE` names, the same paths ``dvc.yaml`` lists as the
train and tune stages' code dependencies (``tests/plan/test_code.py`` checks dvc.yaml
against this list, and this list against what ``stages.train`` and ``stages.tune``
import): when DVC re-runs a training because its code changed, the training starts fresh
instead of exporting an older code's weights; a run of unchanged code that was interrupted
resumes exactly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# Paths relative to the project root: packages (every .py file below them) and files. The
# stage script itself is added per stage (stages/train.py, stages/tune.py).
TRAINING_CODE = (
    "pipeline/artifacts",
    "pipeline/config",
    "pipeline/data",
    "pipeline/decode",
    "pipeline/eval",
    "pipeline/execution",
    "pipeline/models",
    "pipeline/plan",
    "pipeline/tracking",
    "pipeline/train",
    "pipeline/cluster.py",
    "pipeline/errors.py",
    "pipeline/machine.py",
    "pipeline/names.py",
    "pipeline/progress.py",
    "pipeline/serving.py",
)


def stage_code(stage: str) -> tuple[str, ...]:
    """The code paths of the train or tune stage: its script and :data:`TRAINING_CODE`."""
    return (f"stages/{stage}.py", *TRAINING_CODE)


def code_fingerprint(root: str | Path, paths: tuple[str, ...]) -> str:
    """A hash of every Python source under ``paths`` (relative to ``root``): their
    relative paths and bytes, in sorted order. Bytecode and other files do not count."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted({f for p in paths for f in _sources(root / p)}):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _sources(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
