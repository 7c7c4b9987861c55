"""Tensor files: written atomically, read without running pickled code, versioned.

``write_tensors``/``read_tensors`` are the one way a hiertx ``.pt`` file is written and
read (``tensor_bytes`` and ``read_tensors(opened=...)`` for one under a storage URI): a
plain dict of tensors, numbers, strings, lists and dicts under ``torch.save``, loaded
with ``torch.load(weights_only=True)``, so a file from elsewhere can never execute code.
A crash while writing leaves the previous file or the new one, never a torn one. A
file that does not load is a ``DataError`` saying so in our words: torch's own message
for a corrupt file advises ``weights_only=False``, which is wrong for a corrupt file and
unsafe for a foreign one, so it is never passed on.

:class:`SavedModel` is the exported model (``data/train/<key>/[seed-<i>/]model.pt``), a
record with a format number: a file of another format or with a field missing or renamed
fails when it is read, naming the file and the stage that writes it.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Self

import torch

from pipeline.errors import DataError
from pipeline.names import Task

FORMAT_KEY = "format"


def write_tensors(path: str | Path, content: Mapping[str, Any]) -> Path:
    """Write ``content`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(content), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def tensor_bytes(content: Mapping[str, Any]) -> bytes:
    """``content`` as a tensor file's bytes, exactly as :func:`write_tensors` writes them
    (for a file written elsewhere than this machine's disk: a storage URI)."""
    buffer = io.BytesIO()
    torch.save(dict(content), buffer)
    return buffer.getvalue()


def read_tensors(
    path: str | Path,
    what: str,
    map_location: str | torch.device = "cpu",
    opened: IO[bytes] | None = None,
) -> dict:
    """The dict in ``path`` (``weights_only``: no code runs); ``what`` names the file's
    kind and how to make it again, for the error of a missing or unreadable file.
    ``opened``: the file's content, already read from elsewhere than this machine's disk
    (``path`` is then its URI, which errors name as given)."""
    source: IO[bytes] | Path = opened if opened is not None else Path(path)
    if opened is None:
        path = Path(path)
    try:
        content = torch.load(source, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise DataError(path, f"missing: {what}") from None
    except Exception as err:  # torch raises several types for torn or foreign files
        kind = type(err).__name__
        raise DataError(
            path, f"unreadable ({kind}: truncated, corrupt or not a hiertx file): {what}"
        ) from None
    if not isinstance(content, dict):
        raise DataError(path, f"not a hiertx file: {what}")
    return content


@dataclass(frozen=True)
class TensorRecord:
    """A versioned record stored as a tensor file: its dataclass fields are the file's keys,
    beside ``format``. Subclasses set ``FORMAT`` (bump it when a field changes) and
    ``WHAT`` (what the file is and how to write it again)."""

    FORMAT = 0
    WHAT = ""

    def to_dict(self) -> dict[str, Any]:
        return {FORMAT_KEY: self.FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_dict(cls, content: Mapping[str, Any], path: str | Path) -> Self:
        """The record in ``content`` read from ``path``; a ``DataError`` for another format
        or other fields."""
        found = content.get(FORMAT_KEY)
        if found != cls.FORMAT:
            raise DataError(path, f"format {found!r}, expected {cls.FORMAT}: {cls.WHAT}")
        names = {f.name for f in fields(cls)}
        keys = set(content) - {FORMAT_KEY}
        if keys != names:
            missing, extra = sorted(names - keys), sorted(keys - names)
            raise DataError(path, f"fields missing {missing}, unknown {extra}: {cls.WHAT}")
        return cls(**{name: content[name] for name in names})

    def write(self, path: str | Path) -> Path:
        return write_tensors(path, self.to_dict())

    @classmethod
    def read(
        cls,
        path: str | Path,
        map_location: str | torch.device = "cpu",
        opened: IO[bytes] | None = None,
    ) -> Self:
        """The record in ``path`` (or in ``opened``, the content of the file ``path``
        names: ``read_tensors``)."""
        return cls.from_dict(read_tensors(path, cls.WHAT, map_location, opened), path)


@dataclass(frozen=True)
class SavedModel(TensorRecord):
    """A trained model as the train stage exports it: the weights kept (the best
    evaluation's), and what rebuilds the model (its registered name and validated config,
    as JSON values), its task, its train metrics and the run that trained it."""

    FORMAT = 2  # 1: the keys of a training checkpoint, unchecked
    WHAT = "an exported model; export it again with `dvc repro -f train@<run>`"

    model_name: str
    model_config: dict[str, Any]
    task: str
    weights: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)
    run_name: str = ""

    def __post_init__(self) -> None:
        # stored as a plain string: an enum member would not load with weights_only
        object.__setattr__(self, "task", str(Task(self.task)))
