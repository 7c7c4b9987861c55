"""Training checkpoints: everything a killed run needs to continue as if never stopped.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts (so it loads with
``torch.load(weights_only=True)``, which never runs pickled code): model and optimizer and
scheduler state, the training position (:class:`Progress`), every rank's RNG state, the best
weights so far and the model's name and config. Files are written atomically: a crash leaves
either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import DataError

CHECKPOINT_FILE = "checkpoint.pt"
FORMAT_VERSION = 1


@dataclass
class Progress:
    """Where training stands. ``batch_in_epoch`` counts the batches of ``epoch`` already
    trained on (a resumed run skips them); ``bad_evals`` the evaluations since the best."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best_loss: float = math.inf  # the validation loss of the kept weights
    best_score: float = -math.inf  # their validation score, when the run selects on one
    best_step: int = 0
    bad_evals: int = 0
    last_eval_step: int = -1
    finished: bool = False
    stop_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Progress:
        return cls(**raw)


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (``weights_only``: no code runs)."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise DataError(path, "checkpoint not found") from None
    except Exception as err:  # torch raises several types for torn or foreign files
        raise DataError(path, f"not a readable checkpoint ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise DataError(path, f"not a hiertx checkpoint (expected format {FORMAT_VERSION})")
    return state


def cpu_state(module_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached CPU copy of a ``state_dict`` (the best weights kept while training goes on)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module_state.items()}
