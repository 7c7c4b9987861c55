"""Arrow shards: examples on disk, memory-mapped back with random access by row.

Layout of a tokenized corpus folder::

    <root>/manifest.json              counts, shard files (bytes, sha256), vocab hash, params
    <root>/vocab.json                 the vocabulary (``Vocab.save``)
    <root>/acts.json                  MultiWOZ act inventory (when the corpus has acts)
    <root>/<task>/<split>-00000.arrow Arrow IPC files (Feather v2), ~shard_rows rows each
    <root>/select/<split>-pool.arrow  the distinct candidates the select rows refer to

Columns are the fields of the example records (``records.py``): ``dialogue_id``
string, ``turn`` int32, arrays as ``list<int32>`` (``list<int8>`` for labels and flags),
lists of arrays as ``list<list<...>>``; a field that is None for every example is left
out. Select rows store ``candidate_refs`` (``list<int32>``) into the split's candidate
pool instead of the candidates themselves: negatives are other examples' responses, so
100 candidates per row would otherwise store every response ~100 times.

Files are uncompressed so readers map them without copying, written to a temporary name
and renamed, and a function of the examples alone (same input, same bytes). The manifest
is written last: a folder without one is incomplete.

Readers check each shard's sha256 against the manifest before mapping it, once per process
and file (``open_shard``): Arrow's own validation misses changed values (a garbled token id
or length later asks torch for a 70 GB tensor, naming no file), a hash does not. It costs
~0.5 s per GB read from the page cache (bench/RESULTS.md), paid once per stage.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.artifacts import MANIFEST_FILE, ShardFile, TokenizeRecord
from pipeline.data.records import (
    EXAMPLE_TYPES,
    Column,
    Example,
    ExampleTable,
    Nested,
    Packed,
    SelectExample,
)
from pipeline.errors import DataError
from pipeline.names import Task

SCHEMA_VERSION = 1  # of the Arrow files (their metadata); the manifest's is its record's
_META_TASK = b"hiertx.task"
_META_VERSION = b"hiertx.schema_version"
_META_TABLE = b"hiertx.table"
_ROWS, _POOL = b"rows", b"pool"
# Select fields stored in the pool, and the row column that points into it.
_POOL_FIELDS = ("candidate_ids", "candidate_knowledge")
_REFS = "candidate_refs"


def task_of_kind(kind: type) -> Task:
    """The task whose records are of class ``kind``."""
    for task, cls in EXAMPLE_TYPES.items():
        if kind is cls:
            return task
    raise TypeError(f"not an example record class: {kind.__name__}")


def shard_path(root: str | Path, task: Task | str, split: str, index: int) -> Path:
    """``<root>/<task>/<split>-<index:05d>.arrow``."""
    return Path(root) / Task(task).value / f"{split}-{index:05d}.arrow"


def pool_path(root: str | Path, split: str) -> Path:
    """``<root>/select/<split>-pool.arrow``: the candidates of a select split."""
    return Path(root) / Task.SELECT.value / f"{split}-pool.arrow"


# --------------------------------------------------------------------------- manifest


def read_manifest(root: str | Path) -> TokenizeRecord:
    """The tokenize record of a tokenized corpus folder."""
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        raise DataError(
            path, "no manifest: the folder was never tokenized, or a run did not finish; "
            "run python -m stages.tokenize <corpus>",
        )  # fmt: skip
    return TokenizeRecord.read(path)


def write_manifest(root: str | Path, manifest: TokenizeRecord) -> Path:
    """Write ``manifest.json`` atomically (last, after every shard)."""
    return manifest.write(Path(root) / MANIFEST_FILE)


# --------------------------------------------------------------------------- writing


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _int32_offsets(offsets: np.ndarray) -> pa.Array:
    rebased = np.asarray(offsets, dtype=np.int64) - (int(offsets[0]) if len(offsets) else 0)
    if len(rebased) and rebased[-1] > np.iinfo(np.int32).max:
        raise ValueError("a shard column exceeds 2**31 values; lower tokenize.shard_rows")
    return pa.array(rebased.astype(np.int32))


def _packed_array(packed: Packed) -> pa.ListArray:
    lo, hi = (int(packed.offsets[0]), int(packed.offsets[-1])) if len(packed.offsets) else (0, 0)
    return pa.ListArray.from_arrays(
        _int32_offsets(packed.offsets), pa.array(np.ascontiguousarray(packed.values[lo:hi]))
    )


def _gather(pool: Packed, rows: np.ndarray) -> Packed:
    """Pool rows ``rows`` as a Packed of their own (no copy when they are consecutive)."""
    if len(rows) and np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
        return pool.slice(int(rows[0]), int(rows[0]) + len(rows))
    starts = pool.offsets[rows].astype(np.int64)
    lengths = pool.offsets[rows + 1].astype(np.int64) - starts
    before = np.cumsum(lengths) - lengths
    index = np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Packed(pool.values[index], offsets)


def _arrow(col: Column) -> pa.Array:
    if isinstance(col, list):
        return pa.array(col, type=pa.string())
    if isinstance(col, np.ndarray):
        return pa.array(col.astype(np.int32))
    if isinstance(col, Packed):
        return _packed_array(col)
    if isinstance(col, Nested):
        return pa.ListArray.from_arrays(
            _int32_offsets(col.offsets), _packed_array(_gather(col.pool, col.all_refs()))
        )
    raise TypeError(f"cannot store a {type(col).__name__} column")


def _record_batch(columns: dict[str, pa.Array], task: Task, table: bytes = _ROWS) -> pa.RecordBatch:
    metadata = {
        _META_TASK: task.value.encode(),
        _META_VERSION: str(SCHEMA_VERSION).encode(),
        _META_TABLE: table,
    }
    schema = pa.schema([pa.field(n, a.type) for n, a in columns.items()], metadata=metadata)
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=schema)


def _pooled(table: ExampleTable) -> Nested | None:
    """The candidates column of a select table, checked to agree with its knowledge flags."""
    col = table.columns.get("candidate_ids")
    if table.kind is not SelectExample or not isinstance(col, Nested):
        return None
    flags = table.columns.get("candidate_knowledge")
    if flags is not None and not (
        isinstance(flags, Nested)
        and np.array_equal(flags.offsets, col.offsets)
        and np.array_equal(flags.all_refs(), col.all_refs())
        and np.array_equal(flags.pool.offsets, col.pool.offsets)
    ):
        raise ValueError("candidate_knowledge must cover exactly the candidates")
    return col


def to_record_batch(table: ExampleTable) -> pa.RecordBatch:
    """The rows of ``table`` as one Arrow record batch (select: refs into the pool)."""
    pooled = _pooled(table)
    columns = {}
    for name, col in table.columns.items():
        if pooled is not None and name in _POOL_FIELDS:
            continue
        columns[name] = _arrow(col)
    if pooled is not None:
        rebased = pooled.offsets - pooled.offsets[0]  # all_refs() starts at the slice
        columns[_REFS] = _packed_array(Packed(pooled.all_refs(), rebased))
    return _record_batch(columns, task_of_kind(table.kind))


def pool_record_batch(table: ExampleTable) -> pa.RecordBatch | None:
    """The candidate pool a select table's rows refer to (None for other tasks)."""
    pooled = _pooled(table)
    if pooled is None:
        return None
    columns = {"candidate_ids": _packed_array(pooled.pool)}
    flags = table.columns.get("candidate_knowledge")
    if isinstance(flags, Nested):
        columns["candidate_knowledge"] = _packed_array(flags.pool)
    return _record_batch(columns, Task.SELECT, _POOL)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_batch(root: Path, path: Path, batch: pa.RecordBatch) -> ShardFile:
    tmp = path.with_name(f".{path.name}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    os.replace(tmp, path)
    rel = path.relative_to(root).as_posix()
    return ShardFile(file=rel, rows=batch.num_rows, bytes=path.stat().st_size, sha256=_sha256(path))


@dataclass(frozen=True)
class SplitFiles:
    """What :func:`write_shards` wrote for one task and split."""

    shards: list[ShardFile]
    pool: ShardFile | None = None


def write_shards(
    root: str | Path,
    task: Task | str,
    split: str,
    examples: ExampleTable | Sequence[Example],
    shard_rows: int,
) -> SplitFiles:
    """Write ``examples`` as ``<root>/<task>/<split>-NNNNN.arrow``, ``shard_rows`` rows each
    (the last shard may be shorter; no examples, no shard), plus the candidate pool of a
    select split. Older shards of the same task and split are removed first, so a rerun
    with fewer rows leaves no stale file behind."""
    root = Path(root)
    task = Task(task)
    table = ExampleTable.from_examples(examples, EXAMPLE_TYPES[task])
    if table.kind is not EXAMPLE_TYPES[task]:
        raise TypeError(f"{table.kind.__name__} rows are not {task.value} examples")
    folder = root / task.value
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob(f"{split}-*.arrow"), *folder.glob(f".{split}-*.tmp")]:
        old.unlink()
    pool = None
    if len(table) and (batch := pool_record_batch(table)) is not None:
        pool = _write_batch(root, pool_path(root, split), batch)
    infos = []
    for index, start in enumerate(range(0, len(table), shard_rows)):
        batch = to_record_batch(table.slice(start, start + shard_rows))
        infos.append(_write_batch(root, shard_path(root, task, split, index), batch))
    return SplitFiles(infos, pool)


class ShardWriter:
    """The shards of one task and split written as their rows arrive, a table at a time:
    the files :func:`write_shards` writes for all the rows at once, while only the rows of
    the shard being filled are held (a shard is written as soon as it is full).

    Select tables are added with their pool (:meth:`add`, ``own_pool``: corpora with their
    own candidates, whose pools are concatenated and the refs shifted to match) or refer to
    a pool written once for the split (:meth:`write_pool`). Creating one removes the
    split's older shards, as :func:`write_shards` does; :meth:`close` writes the last.
    """

    def __init__(self, root: str | Path, task: Task | str, split: str, shard_rows: int) -> None:
        self.root = Path(root)
        self.task = Task(task)
        self.split = split
        self.shard_rows = shard_rows
        self.rows = 0
        self.target_tokens = 0
        folder = self.root / self.task.value
        folder.mkdir(parents=True, exist_ok=True)
        for old in [*folder.glob(f"{split}-*.arrow"), *folder.glob(f".{split}-*.tmp")]:
            old.unlink()
        self._pending: list[pa.RecordBatch] = []
        self._held = 0
        self._shards: list[ShardFile] = []
        self._pool_parts: list[pa.RecordBatch] = []
        self._pool_rows = 0
        self._pool: ShardFile | None = None

    def add(self, table: ExampleTable, own_pool: bool = False) -> None:
        """Append ``table``'s rows (``own_pool``: a select table whose pool holds its own
        candidates, appended to the split's pool)."""
        if table.kind is not EXAMPLE_TYPES[self.task]:
            raise TypeError(f"{table.kind.__name__} rows are not {self.task.value} examples")
        self.target_tokens += table.scored_tokens()
        if not len(table):
            return
        batch = to_record_batch(table)
        if own_pool and (pool := pool_record_batch(table)) is not None:
            if self._pool_rows:
                refs = batch.column(_REFS)
                shifted = pa.ListArray.from_arrays(
                    refs.offsets, pa.array(refs.values.to_numpy() + self._pool_rows)
                )
                batch = batch.set_column(batch.schema.get_field_index(_REFS), _REFS, shifted)
            self._pool_parts.append(pool)
            self._pool_rows += pool.num_rows
        self._pending.append(batch)
        self._held += batch.num_rows
        self.rows += batch.num_rows
        while self._held >= self.shard_rows:
            self._write_shard(self.shard_rows)

    def write_pool(self, pool: Packed) -> Packed:
        """Write the split's candidate pool (the rows of later select tables refer to it);
        the pool read back memory-mapped."""
        if not len(pool):
            return pool
        path = pool_path(self.root, self.split)
        batch = _record_batch({"candidate_ids": _packed_array(pool)}, Task.SELECT, _POOL)
        self._pool = _write_batch(self.root, path, batch)
        column = pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0).column(0)
        return Packed(column.values.to_numpy(zero_copy_only=True), column.offsets.to_numpy())

    def _write_shard(self, rows: int) -> None:
        table = pa.Table.from_batches(self._pending)
        batch = _one_batch(table.slice(0, rows))
        index = len(self._shards)
        self._shards.append(
            _write_batch(self.root, shard_path(self.root, self.task, self.split, index), batch)
        )
        self._pending = table.slice(rows).to_batches()
        self._held -= rows

    def close(self) -> SplitFiles:
        """Write the last shard (and a pool of its own candidates); what was written."""
        if self._held:
            self._write_shard(self._held)
        if self._pool_parts:
            batch = _one_batch(pa.Table.from_batches(self._pool_parts))
            self._pool = _write_batch(self.root, pool_path(self.root, self.split), batch)
        return SplitFiles(list(self._shards), self._pool)


def _one_batch(table: pa.Table) -> pa.RecordBatch:
    """The rows of ``table`` as one record batch of fresh arrays (no slice offsets), as the
    builders make them."""
    arrays = [pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], column.type)
              for column in table.columns]  # fmt: skip
    return pa.RecordBatch.from_arrays(arrays, schema=table.schema)


# --------------------------------------------------------------------------- reading


def _table(batch: pa.RecordBatch, task: Task, pool: dict[str, Packed] | None) -> ExampleTable:
    """An ExampleTable over one record batch's buffers (no copies)."""
    columns: dict[str, Column] = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        if pa.types.is_string(column.type):
            columns[name] = column.to_pylist()
        elif pa.types.is_integer(column.type):
            columns[name] = column.to_numpy(zero_copy_only=True)
        elif pa.types.is_list(column.type.value_type):
            inner = column.values
            cells = Packed(inner.values.to_numpy(zero_copy_only=True), inner.offsets.to_numpy())
            columns[name] = Nested(cells, column.offsets.to_numpy())
        else:
            columns[name] = Packed(
                column.values.to_numpy(zero_copy_only=True), column.offsets.to_numpy()
            )
    refs = columns.pop(_REFS, None)
    if isinstance(refs, Packed) and pool is not None:
        for name, packed in pool.items():
            columns[name] = Nested(packed, refs.offsets, refs.values)
    return ExampleTable(EXAMPLE_TYPES[task], columns, batch.num_rows)


class ShardTable(Sequence):
    """The rows of one task and split, memory-mapped from its shards: ``table[i]`` is an
    example record whose arrays are read-only views into the files.

    Any unreadable, truncated or foreign file raises a ``DataError`` that names it.
    """

    def __init__(self, root: str | Path, task: Task | str, split: str) -> None:
        self.root = Path(root)
        self.task = Task(task)
        self.split = split
        self.manifest = read_manifest(self.root)
        infos = self.manifest.shards.get(self.task.value, {}).get(split)
        if infos is None:
            have = sorted(self.manifest.shards.get(self.task.value, {}))
            raise DataError(
                self.root / MANIFEST_FILE,
                f"no {self.task.value} examples for split {split!r} (splits: {have}); "
                "check the corpus's tokenize.corpora.<name>.tasks",
            )
        self.infos: list[ShardFile] = infos
        self.pool_info = self.manifest.pools.get(split) if self.task is Task.SELECT else None
        self._blocks: list[ExampleTable] | None = None
        self._starts: list[int] = []
        self._len = sum(i.rows for i in self.infos)

    def _open(self) -> list[ExampleTable]:
        if self._blocks is None:
            pool = None
            if self.pool_info is not None:
                path = self.root / self.pool_info.file
                batches = open_shard(path, self.task, self.pool_info, _POOL, self.manifest.corpus)
                if len(batches) != 1:
                    raise DataError(path, "a candidate pool holds exactly one record batch")
                pool = {
                    name: Packed(col.values.to_numpy(zero_copy_only=True), col.offsets.to_numpy())
                    for name, col in zip(batches[0].schema.names, batches[0].columns, strict=True)
                }
            blocks = [
                _table(batch, self.task, pool)
                for info in self.infos
                for batch in open_shard(
                    self.root / info.file, self.task, info, _ROWS, self.manifest.corpus
                )
            ]
            self._starts = [int(s) for s in np.cumsum([0] + [len(b) for b in blocks[:-1]])]
            self._blocks = blocks
        return self._blocks

    def blocks(self) -> list[ExampleTable]:
        """The rows as one table per record batch, in order (views into the files)."""
        return list(self._open())

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps do not cross process boundaries: a loader worker maps its own.
        return {**self.__dict__, "_blocks": None, "_starts": []}

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        blocks = self._open()
        if not -self._len <= index < self._len:
            raise IndexError(f"row {index} out of range for {self._len} rows")
        index %= self._len
        b = bisect.bisect_right(self._starts, index) - 1
        return blocks[b][index - self._starts[b]]

    def __iter__(self) -> Iterator[Example]:
        for block in self._open():
            yield from block

    @property
    def columns(self) -> tuple[str, ...]:
        """The record fields stored (fields that are None everywhere are absent)."""
        blocks = self._open()
        return tuple(blocks[0].columns) if blocks else ()

    def lengths(self, *columns: str) -> np.ndarray:
        """Per row, the sum over ``columns`` of ``ExampleTable.lengths`` (a bucketing key)."""
        parts = [
            sum((b.lengths(c).astype(np.int64) for c in columns), np.zeros(len(b), np.int64))
            for b in self._open()
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def open_shard(
    path: Path,
    task: Task,
    info: ShardFile | None = None,
    table: bytes = _ROWS,
    corpus: str | None = None,
) -> list[pa.RecordBatch]:
    """Memory-map one shard; ``DataError`` naming ``path`` if it is missing or damaged.

    With ``info`` (its manifest entry) its size and sha256 are checked first, the hash
    once per process while the file is unchanged (``verify_shard``); ``corpus`` names the
    tokenize stage to re-run in the error."""
    if not path.is_file():
        raise DataError(path, "shard missing; rerun the tokenize stage")
    size = path.stat().st_size
    if info is not None and size != info.bytes:
        raise DataError(
            path, f"shard has {size} bytes, the manifest says {info.bytes} "
            "(truncated or overwritten); rerun the tokenize stage",
        )  # fmt: skip
    if info is not None:
        verify_shard(path, info, corpus)
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        for batch in batches:
            batch.validate(full=True)
    except (OSError, pa.ArrowException) as err:
        reason = f"not a readable Arrow shard ({err}); rerun the tokenize stage"
        raise DataError(path, reason) from None
    meta = reader.schema.metadata or {}
    if meta.get(_META_TASK) != task.value.encode() or meta.get(_META_TABLE) != table:
        found = f"{meta.get(_META_TASK)!r}/{meta.get(_META_TABLE)!r}"
        raise DataError(path, f"not a {task.value} {table.decode()} shard (found {found})")
    if meta.get(_META_VERSION) != str(SCHEMA_VERSION).encode():
        raise DataError(path, "shard written by another schema version; rerun tokenize")
    rows = sum(b.num_rows for b in batches)
    if info is not None and rows != info.rows:
        raise DataError(path, f"shard has {rows} rows, the manifest says {info.rows}")
    return batches


# Shards whose hash matched in this process, by (path, inode, size, mtime, expected hash):
# a file replaced or rewritten since has another key and is hashed again.
_VERIFIED: set[tuple[str, int, int, int, str]] = set()


def _rebuild_hint(path: Path, info: ShardFile, corpus: str | None) -> str:
    root = path.parents[len(Path(info.file).parts) - 1]  # the tokenized corpus folder
    name = corpus or root.name
    return f"rebuild it: dvc repro -f tokenize@{name} (or delete {root} and run dvc repro)"


def verify_shard(path: Path, info: ShardFile, corpus: str | None = None) -> None:
    """Check one shard's sha256 against its manifest entry, once per process while the file
    is unchanged; a ``DataError`` names the file and the stage to re-run."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, info.sha256)
    if key in _VERIFIED:
        return
    if _sha256(path) != info.sha256:
        raise DataError(
            path,
            "sha256 differs from the manifest: the file changed after tokenize wrote it "
            f"(a disk fault, or something wrote into it); {_rebuild_hint(path, info, corpus)}",
        )
    _VERIFIED.add(key)
