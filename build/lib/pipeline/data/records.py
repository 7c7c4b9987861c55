"""Example records and the columnar table that holds many of them.

A record per task kind (``GenerateExample``, ``SelectExample``, ``LMExample``); arrays are
int32 (labels and knowledge flags int8). :class:`ExampleTable` keeps a split's examples
columnar (packed arrays with offsets) until the shards are written, and serves single
records by index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.names import Task

INT = np.int32
_EMPTY = np.zeros(0, dtype=INT)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True, eq=False)
class HistoryExample:
    """What every dialogue example has: where it is from and its (flattened) history."""

    dialogue_id: str
    turn: int
    input_ids: np.ndarray
    utt_index: np.ndarray
    utt_pos: np.ndarray
    speaker: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class GenerateExample(HistoryExample):
    """History -> response. ``acts`` holds indices into the :class:`ActInventory`."""

    target_ids: np.ndarray
    acts: np.ndarray | None = None
    belief_ids: np.ndarray | None = None
    act_ids: np.ndarray | None = None


@dataclass(frozen=True, slots=True, eq=False)
class SelectExample(HistoryExample):
    """History + candidates; ``labels[i]`` = 1 if candidate i is a correct response.

    ``candidate_ids`` is any sequence of int arrays. Knowledge flags (DSTC7 Advising) are
    per token bit sets: bit 0 = a course the student took (profile prior), bit 1 = a
    course suggested to the student.
    """

    candidate_ids: Sequence[np.ndarray]
    labels: np.ndarray
    context_knowledge: np.ndarray | None = None
    candidate_knowledge: Sequence[np.ndarray] | None = None


@dataclass(frozen=True, slots=True, eq=False)
class LMExample:
    """A document: ``sentences[i]`` = ``w.. <eos>``; ``turn`` = its first sentence's index.
    ``context``: a window of a stream (``data.streams``) whose first ``context`` tokens are
    seen but not scored; None (stored documents): every token is scored."""

    dialogue_id: str
    turn: int
    sentences: Sequence[np.ndarray]
    context: int | None = None


Example = GenerateExample | SelectExample | LMExample
EXAMPLE_TYPES: dict[Task, type] = {
    Task.GENERATE: GenerateExample,
    Task.SELECT: SelectExample,
    Task.LM: LMExample,
}
KNOWLEDGE_PRIOR = 1
KNOWLEDGE_SUGGESTED = 2
N_KNOWLEDGE = 2


# --------------------------------------------------------------------------- tables


def lengths_to_offsets(lengths: np.ndarray) -> np.ndarray:
    """``[0, l0, l0 + l1, ...]``: where each of ``lengths`` starts in a packed array."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


class Packed:
    """Many int arrays stored as one: array ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    The in-memory twin of an Arrow ``list<int>`` column: builders fill one with a few numpy
    calls, readers wrap memory-mapped buffers in one without copying.
    """

    __slots__ = ("offsets", "values")

    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        self.values = values
        self.offsets = offsets

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray], dtype: type = INT) -> Packed:
        offsets = lengths_to_offsets(np.array([len(a) for a in arrays], dtype=np.int64))
        values = np.concatenate(arrays) if len(arrays) else np.zeros(0, dtype)
        return cls(values.astype(dtype, copy=False), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def slice(self, start: int, stop: int) -> Packed:
        """Rows ``[start, stop)`` (shares ``values``)."""
        return Packed(self.values, self.offsets[start : stop + 1])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int64)


class Rows(Sequence[np.ndarray]):
    """Rows ``index`` of a :class:`Packed`, as a read-only sequence of int arrays."""

    __slots__ = ("index", "pool")

    def __init__(self, pool: Packed, index: np.ndarray) -> None:
        self.pool = pool
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self.pool[int(r)] for r in self.index[i])
        return self.pool[int(self.index[i])]

    def __repr__(self) -> str:
        return f"Rows({[a.tolist() for a in self]})"


class Nested:
    """A column whose cells are lists of arrays: cell ``i`` is the pool rows
    ``refs[offsets[i]:offsets[i + 1]]`` (``refs`` None: the rows themselves, in order).

    Select candidates point into a pool shared by the split (negatives are other
    examples' responses: 100 candidates per example would otherwise store each response
    ~100 times); LM documents own their sentences.
    """

    __slots__ = ("offsets", "pool", "refs")

    def __init__(self, pool: Packed, offsets: np.ndarray, refs: np.ndarray | None = None) -> None:
        self.pool = pool
        self.offsets = offsets
        self.refs = refs

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[np.ndarray]], dtype: type = INT) -> Nested:
        pool = Packed.from_arrays([a for row in rows for a in row], dtype)
        return cls(pool, lengths_to_offsets(np.array([len(r) for r in rows], dtype=np.int64)))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def index(self, i: int) -> np.ndarray:
        """The pool rows of cell ``i``."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.refs[lo:hi] if self.refs is not None else np.arange(lo, hi)

    def __getitem__(self, i: int) -> Rows:
        return Rows(self.pool, self.index(i))

    def slice(self, start: int, stop: int) -> Nested:
        return Nested(self.pool, self.offsets[start : stop + 1], self.refs)

    def all_refs(self) -> np.ndarray:
        """Pool row of every entry of every cell, in order."""
        lo, hi = int(self.offsets[0]), int(self.offsets[-1])
        return self.refs[lo:hi] if self.refs is not None else np.arange(lo, hi)

    def longest(self) -> np.ndarray:
        """Per cell, the length of its longest array (0 if it has none)."""
        lengths = self.pool.lengths[self.all_refs()]
        return _row_max(lengths, self.offsets - self.offsets[0])


Column = list | np.ndarray | Packed | Nested | None


def _row_max(lengths: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per row, the largest of ``lengths[offsets[i]:offsets[i + 1]]`` (0 for empty rows)."""
    out = np.zeros(len(offsets) - 1, dtype=np.int64)
    has = np.diff(offsets) > 0
    if lengths.size and has.any():
        out[has] = np.maximum.reduceat(lengths, offsets[:-1][has])
    return out


class ExampleTable(Sequence):
    """Examples of one task kind stored by column; ``table[i]`` builds the record.

    Columns are the record's fields: ``dialogue_id`` a list of str, ``turn`` an int array,
    arrays a :class:`Packed`, lists of arrays a :class:`Nested`; a field that is None for
    every example has no column. Builders make tables directly (fast); any sequence of
    records converts with :meth:`from_examples`.
    """

    def __init__(self, kind: type, columns: dict[str, Column], length: int) -> None:
        self.kind = kind
        self.columns = {k: v for k, v in columns.items() if v is not None}
        self.length = length

    @classmethod
    def from_examples(cls, examples: Sequence[Example], kind: type | None = None) -> ExampleTable:
        if isinstance(examples, ExampleTable):
            return examples
        if kind is None:
            if not examples:
                raise ValueError("cannot tell the task of no examples: pass kind")
            kind = type(examples[0])
        if any(type(e) is not kind for e in examples):
            raise TypeError("a table holds examples of one task kind")
        columns: dict[str, Column] = {}
        for name in (f.name for f in dataclasses.fields(kind)):
            values = [getattr(e, name) for e in examples]
            columns[name] = _pack(name, values)
        return cls(kind, columns, len(examples))

    def __len__(self) -> int:
        return self.length

    def scored_tokens(self) -> int:
        """The target tokens a model of this task is scored on, over the whole table:
        generate, each response after its ``<bos>`` (``<eos>`` included); lm, every
        sentence token (each sentence's ``<eos>`` included); select, none (it scores
        candidates)."""
        if self.length == 0:
            return 0
        if self.kind is GenerateExample:
            target = self.columns["target_ids"]
            assert isinstance(target, Packed)
            return int(target.lengths.sum()) - self.length
        if self.kind is LMExample:
            sentences = self.columns["sentences"]
            assert isinstance(sentences, Nested)
            return int(sentences.pool.lengths[sentences.all_refs()].sum())
        return 0

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self.length)
            if step != 1:
                raise ValueError("tables slice with step 1 only")
            return self.slice(start, stop)
        if not -self.length <= i < self.length:
            raise IndexError(f"row {i} out of range for {self.length} rows")
        i %= self.length
        return self.kind(**{name: _cell(col, i) for name, col in self.columns.items()})

    def slice(self, start: int, stop: int) -> ExampleTable:
        """Rows ``[start, stop)``, sharing storage."""
        stop = max(start, min(stop, self.length))
        columns = {
            name: col[start:stop] if isinstance(col, list | np.ndarray) else col.slice(start, stop)
            for name, col in self.columns.items()
        }
        return ExampleTable(self.kind, columns, stop - start)

    def lengths(self, name: str) -> np.ndarray:
        """Per row: the length of an array column, or of the longest array of a list column."""
        col = self.columns[name]
        if isinstance(col, Packed):
            return col.lengths
        if isinstance(col, Nested):
            return col.longest()
        raise TypeError(f"column {name!r} holds no arrays")


def _cell(col: Column, i: int) -> Any:
    if isinstance(col, list):
        return col[i]
    if isinstance(col, np.ndarray):
        return int(col[i])
    return col[i]  # type: ignore[index]


def _pack(name: str, values: list[Any]) -> Column:
    present = [v for v in values if v is not None]
    if not present:
        return None
    if len(present) != len(values):
        raise ValueError(f"field {name!r} is set on some examples and None on others")
    first = present[0]
    if isinstance(first, str):
        return list(values)
    if isinstance(first, int | np.integer):
        return np.asarray(values, dtype=np.int64)
    if isinstance(first, np.ndarray):
        return Packed.from_arrays(values, first.dtype.type)
    dtype = next((np.asarray(row[0]).dtype.type for row in values if len(row)), INT)
    return Nested.from_rows(values, dtype)
