"""A language-model split read as one text: the windows a streamed evaluation scores and
the segments stream training cuts, both as the examples the loader batches.

LM papers train and test on PTB as one contiguous token stream (Transformer-XL, AWD-LSTM,
fairseq's ``sample_break_mode none``), not as documents. The split's documents, in file
order, are that text (:class:`TextStream`). A window (:data:`Bounds` row) holds units
``[context_begin, target_end)``: the units from ``target_begin`` on are scored, the ones
before are context, seen but not scored. Its unit is the model's ``stream_unit``: tokens
for a flat model, whole sentences for a hierarchical one. As an :class:`LMExample` a
window is read as one document from ``<bos>``, its first ``context`` tokens unscored.

- **Evaluation windows** (:func:`window_bounds`): window ``k`` scores units
  ``[k * stride, (k + 1) * stride)`` after up to ``context`` before them, every unit
  scored once (``evaluate.lm``; Transformer-XL's test, ``train.py`` l. 299-329).
- **Training segments** (:func:`segment_bounds`, ``tokenize.corpora.<c>.lm.layout:
  stream``), as the Transformer-XL PTB code feeds its model (github
  ischlag/Fast-Weight-Memory-public, ``language-modelling/transformer_xl_ptb/train.py`` l.
  338-341, 359, 416, ``utils.py`` ``get_batch``): consecutive segments of a jittered
  length (the target, 95% of them ``target`` units, 5% half that, plus a normal draw of sd
  ``jitter``, at least ``minimum``), each after up to ``context`` units of the text before it (their
  ``ext_len``). Their boundaries start at offset 0 every epoch; ours also start at a drawn
  offset (the first segment is the units before it), so no boundary is fixed. Both are
  drawn from (seed, epoch) alone: every rank and a resumed run cut the same segments.
  Every unit is a target exactly once an epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pipeline.config import LMParams, LMProtocol
from pipeline.data.records import LMExample, Nested
from pipeline.data.shards import ShardTable
from pipeline.data.splits import Split
from pipeline.names import Task

Unit = Literal["tokens", "sentences"]
UNITS: tuple[Unit, ...] = ("tokens", "sentences")
# Numpy's seed sequence for segment draws: (run seed, epoch, this), apart from the batch
# order's (seed, epoch) stream of ``plans``.
_SEGMENT_STREAM = 0x5E6


@dataclass(frozen=True)
class TextStream:
    """Every token of a split in order (``tokens``) and where each sentence starts
    (``starts``, ``[n_sentences + 1]``, the last the token count)."""

    tokens: np.ndarray
    starts: np.ndarray

    @classmethod
    def of_documents(cls, documents: Iterable[Sequence[np.ndarray]]) -> TextStream:
        """The documents' sentences, in order, as one text."""
        sentences = [np.asarray(s, dtype=np.int64) for document in documents for s in document]
        lengths = np.array([len(s) for s in sentences], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate(sentences) if sentences else np.zeros(0, dtype=np.int64)
        return cls(tokens.astype(np.int64), starts)

    @classmethod
    def of_columns(cls, columns: Iterable[Nested]) -> TextStream:
        """Tables' ``sentences`` columns, in order (a shard table's blocks)."""
        tokens, lengths = [], []
        for column in columns:
            refs = column.all_refs()
            pool = column.pool
            size = pool.lengths[refs].astype(np.int64)
            begin = pool.offsets[refs].astype(np.int64)
            index = np.repeat(begin - (np.cumsum(size) - size), size) + np.arange(size.sum())
            tokens.append(np.asarray(pool.values)[index].astype(np.int64))
            lengths.append(size)
        if not tokens:
            return cls(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
        size = np.concatenate(lengths)
        return cls(np.concatenate(tokens), np.concatenate([[0], np.cumsum(size)]).astype(np.int64))

    @classmethod
    def of_table(cls, table: ShardTable) -> TextStream:
        """An LM shard table's documents, in order, as one text."""
        columns = [block.columns["sentences"] for block in table.blocks() if len(block)]
        return cls.of_columns(columns)  # type: ignore[arg-type]

    def size(self, unit: Unit) -> int:
        """Units of the text: tokens or sentences."""
        return len(self.tokens) if unit == "tokens" else len(self.starts) - 1

    def token_span(self, begin: int, end: int, unit: Unit) -> tuple[int, int]:
        """Units ``[begin, end)`` as token offsets."""
        if unit == "tokens":
            return begin, end
        return int(self.starts[begin]), int(self.starts[end])

    def example(self, bounds: np.ndarray, unit: Unit) -> LMExample:
        """Window ``bounds`` (context begin, target begin, target end; in ``unit``) as one
        document: one row of tokens, or its whole sentences; its context unscored."""
        first, scored, end = (int(b) for b in bounds)
        lo, mid = self.token_span(first, scored, unit)
        hi = self.token_span(scored, end, unit)[1]
        if unit == "tokens":
            rows: list[np.ndarray] = [self.tokens[lo:hi]]
        else:
            edges = self.starts[first : end + 1]
            rows = [self.tokens[a:b] for a, b in itertools.pairwise(edges)]
        return LMExample("stream", scored, rows, context=mid - lo)

    def tokens_of(self, bounds: np.ndarray, unit: Unit) -> np.ndarray:
        """Per window, its tokens (context and target): ``[K]``."""
        if unit == "tokens":
            return (bounds[:, 2] - bounds[:, 0]).astype(np.int64)
        return (self.starts[bounds[:, 2]] - self.starts[bounds[:, 0]]).astype(np.int64)


def window_bounds(size: int, context: int, stride: int) -> np.ndarray:
    """``[K, 3]`` (context begin, target begin, target end): window ``k`` scores units
    ``[k * stride, (k + 1) * stride)`` of ``size`` after up to ``context`` units."""
    if stride < 1 or context < 0:
        raise ValueError(f"a stream window needs stride >= 1 and context >= 0: {stride}, {context}")
    begin = np.arange(0, size, stride, dtype=np.int64)
    end = np.minimum(begin + stride, size)
    return np.stack([np.maximum(begin - context, 0), begin, end], axis=1)


@dataclass(frozen=True)
class SegmentRule:
    """How stream training cuts a split (module docstring), in one unit: ``target`` units a
    segment (5%, ``short_fraction``, of them half that), plus a normal draw of sd
    ``jitter``, at least ``minimum``; after up to ``context`` units of context."""

    target: int
    context: int
    jitter: float = 0.0
    short_fraction: float = 0.0
    minimum: int = 1

    def __post_init__(self) -> None:
        if self.target < 1 or self.minimum < 1 or self.context < 0:
            raise ValueError(f"a segment needs target, minimum >= 1 and context >= 0: {self}")


def segment_bounds(size: int, rule: SegmentRule, seed: int, epoch: int) -> np.ndarray:
    """``[K, 3]`` (context begin, target begin, target end): one epoch's segments of a text
    of ``size`` units, a function of (``seed``, ``epoch``) alone; their targets cover every
    unit once, in order. The first segment ends at a drawn offset in ``[1, target]``."""
    if size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    rng = np.random.default_rng([seed, epoch, _SEGMENT_STREAM])
    first = int(rng.integers(1, rule.target + 1))
    count = size // rule.minimum + 1  # enough draws for any text; a fixed number of them
    base = np.where(rng.random(count) < rule.short_fraction, rule.target / 2, rule.target)
    lengths = np.maximum(rule.minimum, np.rint(rng.normal(base, rule.jitter)).astype(np.int64))
    ends = np.concatenate([[first], first + np.cumsum(lengths)])
    ends = np.concatenate([ends[ends < size], [size]])
    begins = np.concatenate([[0], ends[:-1]])
    return np.stack([np.maximum(begins - rule.context, 0), begins, ends], axis=1)


class StreamExamples:
    """A split as windows of one text (:class:`TextStream`), the examples a loader batches:
    fixed evaluation windows (``rule`` None: ``window_bounds(context, stride)``), or
    training segments redrawn by :meth:`set_epoch` (a :class:`SegmentRule`)."""

    def __init__(
        self,
        stream: TextStream,
        unit: Unit,
        rule: SegmentRule | None = None,
        context: int = 0,
        stride: int = 1,
    ) -> None:
        if unit not in UNITS:
            raise ValueError(f"stream unit {unit!r}: tokens or sentences")
        self.stream, self.unit, self.rule = stream, unit, rule
        self.by_epoch = rule is not None
        size = stream.size(unit)
        self.bounds = window_bounds(size, context, stride) if rule is None else np.zeros((0, 3))
        self.set_epoch(0, 0)

    def set_epoch(self, epoch: int, seed: int) -> None:
        """Cut the segments of ``epoch`` of the run seeded ``seed`` (windows: no-op)."""
        if self.rule is not None:
            self.bounds = segment_bounds(self.stream.size(self.unit), self.rule, seed, epoch)

    def __len__(self) -> int:
        return len(self.bounds)

    def __getitem__(self, index: int) -> LMExample:
        return self.stream.example(self.bounds[index], self.unit)

    def token_counts(self) -> np.ndarray:
        """Per window, its tokens (context included): what it brings to a batch."""
        return self.stream.tokens_of(self.bounds, self.unit)


def segment_rule(lm: LMParams, unit: Unit) -> SegmentRule:
    """The training segments ``lm.stream`` asks for, in ``unit``."""
    stream = lm.stream
    if unit == "tokens":
        return SegmentRule(
            stream.target_tokens,
            stream.context_tokens,
            stream.jitter_tokens,
            stream.short_fraction,
            stream.min_tokens,
        )
    # Whole sentences: half-length segments as in tokens, no finer jitter.
    return SegmentRule(
        stream.target_sentences, stream.context_sentences, 0.0, stream.short_fraction, 1
    )


@dataclass(frozen=True)
class LMFeed:
    """How a language model reads the splits of an LM table: in ``unit`` (the model's
    ``stream_unit``), as ``lm`` says (the run's ``tokenize.corpora.<c>.lm``: the training
    layout, the validation protocol).

    ``lm`` comes from the params the stage reads, not from the ones the shards were built
    with (their manifest): it chooses how the same documents are read, so a stage called
    with ``--params FILE`` reads them as ``dvc repro`` with that file does."""

    unit: Unit
    lm: LMParams


def split_stream(table: ShardTable, split: str, feed: LMFeed) -> StreamExamples | None:
    """How a language model reads ``split`` of an LM table, as ``feed`` says: the training
    split cut into segments (``layout: stream``), the validation split in evaluation
    windows (``validation.protocol: stream``); None: as stored documents."""
    if table.task is not Task.LM:
        return None
    lm = feed.lm
    if split == Split.TRAIN and lm.layout == "stream":
        return StreamExamples(TextStream.of_table(table), feed.unit, segment_rule(lm, feed.unit))
    if split == Split.VALID and lm.validation.protocol is LMProtocol.STREAM:
        unit, context, stride = lm.validation.window(feed.unit)
        return StreamExamples(TextStream.of_table(table), unit, None, context, stride)
    return None


def stream_key(lm: LMParams) -> str:
    """A suffix for the data's fingerprint: empty where a corpus's language models read
    documents (run names stay as they were), else the settings that cut the splits (the
    run's ``lm``, as :class:`LMFeed` reads them), so that another feeding starts a fresh run
    rather than resuming one trained on other batches (the shards do not change)."""
    parts = []
    if lm.layout == "stream":
        parts.append(f"+stream:{lm.stream.model_dump_json()}")
    if lm.validation.protocol is LMProtocol.STREAM:
        parts.append(f"+valid:{lm.validation.model_dump_json()}")
    return "".join(parts)
