"""Where an in-process run keeps its checkpoints: a folder on this machine's disk, or one
under a storage URI (``s3://``, ``gs://``, any filesystem ``pyarrow.fs`` opens), which
Ray Train's runs write to through the same pyarrow filesystems.

A :class:`RunFolder` holds files by name: whether one is there, reading it, writing it
atomically (a reader, a resumed run included, sees the file before or the new one, never
part of one) and renaming one over another. ``context.LocalContext`` keeps its two
checkpoints in one; :func:`run_folder` picks it for a path or URI (:func:`run_path`: a
run's under a storage).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from pipeline.artifacts import tensor_bytes
from pipeline.cluster import open_storage
from pipeline.train.checkpoint import TrainingState

# Object stores whose objects appear only once their upload completes (S3: a PUT, or a
# multipart upload's completion; GCS: an upload's finalization): a write killed midway
# leaves the object before it, so a checkpoint is written in place, with no temporary
# object to copy (S3 and GCS copy an object, they have no rename).
WHOLE_OBJECT_STORES = ("s3", "gcs")


class RunFolder(Protocol):
    """The files of one run (module docstring)."""

    @property
    def where(self) -> str:
        """The folder as a path or URI (messages, the command that removes it)."""
        ...

    def location(self, name: str) -> str:
        """File ``name`` as a path or URI."""
        ...

    def has(self, name: str) -> bool:
        """Whether file ``name`` is there."""
        ...

    def read(self, name: str) -> TrainingState:
        """The checkpoint in file ``name`` (a ``DataError`` naming it when it does not read)."""
        ...

    def write(self, name: str, state: TrainingState) -> None:
        """Write ``state`` to file ``name`` atomically."""
        ...

    def replace(self, source: str, target: str) -> None:
        """Rename file ``source`` to ``target``, replacing it."""
        ...


class DiskFolder:
    """A run folder on this machine's disk (an NFS mount included)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def where(self) -> str:
        return str(self.path)

    def location(self, name: str) -> str:
        return str(self.path / name)

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def read(self, name: str) -> TrainingState:
        return TrainingState.read(self.path / name)

    def write(self, name: str, state: TrainingState) -> None:
        state.write(self.path / name)  # a temporary file, fsync'd, renamed over the file

    def replace(self, source: str, target: str) -> None:
        os.replace(self.path / source, self.path / target)


class StorageFolder:
    """A run folder under a storage URI, through its pyarrow filesystem."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        self.fs: Any
        self.fs, self.root = open_storage(self.uri)

    @property
    def where(self) -> str:
        return self.uri

    def location(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def has(self, name: str) -> bool:
        import pyarrow.fs

        return self.fs.get_file_info(self._path(name)).type == pyarrow.fs.FileType.File

    def read(self, name: str) -> TrainingState:
        with self.fs.open_input_stream(self._path(name)) as stream:
            content = io.BytesIO(stream.read())
        return TrainingState.read(self.location(name), opened=content)

    def write(self, name: str, state: TrainingState) -> None:
        content = tensor_bytes(state.to_dict())
        target = self._path(name)
        if self.fs.type_name in WHOLE_OBJECT_STORES:
            with self.fs.open_output_stream(target) as out:
                out.write(content)
            return
        # elsewhere (HDFS, a local file:// URI) a file shows while written: a temporary
        # name, renamed over the file once whole
        self.fs.create_dir(self.root, recursive=True)
        temporary = self._path(f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            with self.fs.open_output_stream(temporary) as out:
                out.write(content)
            self.fs.move(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):  # a temporary never created
                self.fs.delete_file(temporary)
            raise

    def replace(self, source: str, target: str) -> None:
        # S3 and GCS copy, then delete: a run killed between the two leaves the same
        # checkpoint under both names, which resumes as the newest would have
        self.fs.move(self._path(source), self._path(target))


def run_path(storage: str | Path, name: str) -> str | Path:
    """The folder of run ``name`` under ``storage``: a URI under a URI, else a path."""
    if isinstance(storage, str) and "://" in storage:
        return f"{storage.rstrip('/')}/{name}"
    return Path(storage) / name


def run_folder(path: str | Path) -> RunFolder:
    """The run folder at ``path``: a local folder, or one under a storage URI (which
    pyarrow opens: a ``ConfigError`` naming the setting where it cannot)."""
    if isinstance(path, str) and "://" in path:
        return StorageFolder(path)
    return DiskFolder(path)
