"""Per-epoch draws for training select examples: fresh negatives every epoch and the
Highway Recurrent Transformer authors' context augmentation. Opt-in, by the corpus's
``tokenize.corpora.<name>.select`` params ``resample_negatives`` and
``augment_min_utterances`` (recorded in the tokenize manifest, which the loader reads).

Tokenize draws each select example's negatives once; the paper trains "by sampling
negative candidates so the total number of candidates is 10 for each sample", and the
authors' code does so in the dataset's ``__getitem__``, i.e. afresh every epoch. What it
does, as read in MiuLab/DSTC7 (GitHub, branch track1, commit 4b2b8cd), file
``track1/src/dataset.py``, ``DSTC7Dataset.__getitem__``, with ``track1/src/train.py`` and
``track1/models/task1/*/config.json``:

- negatives: every call shuffles the example's own incorrect options (DSTC7 gives 100
  candidates per example) and keeps the first ``n_negative`` (9, ``train_n_negative``);
- augmentation: ``context_len = randint(min(min_context_len, n), n)`` utterances; when it is
  below ``n`` the context becomes its FIRST ``context_len`` utterances and the correct
  option is replaced by the utterance right after them (a prefix, not a suffix: an earlier
  turn of the same dialogue becomes the example). ``min_context_len`` defaults to 4, but
  ``train.py`` sets it to 10000 on the training and the validation data, so the released
  training runs without augmentation.

Ours follows those rules with three differences, each for a reason:

- draws are seeded by (the run's seed, the epoch, the example's row), where the authors'
  use Python's unseeded ``random``: a killed run resumes with exactly the same batches;
- corpora without their own candidates draw from the split's response pool by the rule
  tokenize uses (``examples.draw_negatives``: responses of OTHER dialogues, distinct texts,
  none equal to the positive, the positive at a drawn position); DSTC7 draws from its own
  candidates by tokenize's rule (``examples.training_subset``: every correct candidate
  plus drawn incorrect ones), the training shards then keeping all of them;
- augmentation cuts the context as stored (already limited to ``max_history`` tokens and
  ``max_utterances`` utterances); the new positive is cut like candidates
  (``max_candidate``), the original positives are dropped (they answer the full context),
  negatives equal to the new positive's text are not drawn, and the speaker codes are
  re-anchored on the new positive's speaker (``SPEAKER_SELF`` is relative to the
  responder; exact for two-party dialogues such as DSTC7's).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.artifacts import TokenizeRecord
from pipeline.config import SelectParams
from pipeline.data.examples import counter_draws, draw_negatives, draws_below, training_subset
from pipeline.data.records import INT, Nested, Packed, Rows, SelectExample, lengths_to_offsets
from pipeline.data.shards import ShardTable
from pipeline.data.special import EOS_ID, SPEAKER_OTHER, SPEAKER_SELF
from pipeline.data.splits import Split
from pipeline.errors import DataError
from pipeline.names import Task

__all__ = ["TrainingDraws", "draws_key", "epoch_seed", "select_params"]

_PERSON = b"hiertx-epochs"  # keeps these seeds apart from tokenize's (examples._example_seed)


def epoch_seed(seed: int, epoch: int, index: int, stream: str) -> int:
    """The 64-bit state of one example's draws of one kind (``stream``) in one epoch."""
    key = f"{seed}\x1f{epoch}\x1f{index}\x1f{stream}".encode()
    digest = hashlib.blake2b(key, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little")


def select_params(manifest: TokenizeRecord) -> SelectParams:
    """The select params a tokenized folder was built with (defaults for a manifest written
    before a field existed)."""
    if manifest.params is None:
        return SelectParams()
    return manifest.params.corpus.select


def draws_key(manifest: TokenizeRecord) -> str:
    """A suffix for the data's fingerprint: empty with the draws off (run names stay as they
    were), else their params, so that turning them on or off starts a fresh run rather than
    resuming one trained with the other batches (the shards may not change)."""
    params = select_params(manifest)
    if not params.resample_negatives:
        return ""
    return f"+draws:{params.augment_min_utterances}"


@dataclass(frozen=True)
class _Layout:
    """Where each training row's candidates live in the split's pool.

    ``own``: each row owns pool rows ``[offsets[i], offsets[i + 1])`` (DSTC7), ``labels``
    theirs. Otherwise row i's positive is pool row i and its dialogue's rows are
    ``[first[i], first[i] + count[i])`` (tokenize's sampled layout).
    """

    own: bool
    offsets: np.ndarray
    labels: np.ndarray
    first: np.ndarray
    count: np.ndarray


@dataclass(frozen=True)
class _Positive:
    """A positive cut from the context by the augmentation (not a pool row)."""

    tokens: np.ndarray
    flags: np.ndarray | None


class TrainingDraws:
    """Redraws one training select example per (seed, epoch, row): its candidates and,
    with augmentation, its context. Set ``seed``/``epoch`` with :meth:`set_epoch` (the
    ``BatchLoader`` does), then call it on the stored example of row ``index``."""

    def __init__(self, table: ShardTable, params: SelectParams) -> None:
        self.table = table
        self.params = params
        self.seed = 0
        self.epoch = 0
        self._layout: _Layout | None = None
        self._text_of: np.ndarray | None = None
        self._texts: dict[bytes, int] = {}

    @classmethod
    def of(cls, table: ShardTable, split: str) -> TrainingDraws | None:
        """The draws of a split's table, or None where they are off (every split but the
        training one, every task but select, and the default params)."""
        if table.task is not Task.SELECT or split != Split.TRAIN:
            return None
        params = select_params(table.manifest)
        return cls(table, params) if params.resample_negatives else None

    def set_epoch(self, epoch: int, seed: int) -> None:
        """Draw for ``epoch`` of the run seeded ``seed``."""
        self.epoch, self.seed = int(epoch), int(seed)

    # ------------------------------------------------------------------ layout

    def layout(self) -> _Layout:
        if self._layout is None:
            self._layout = self._read_layout()
        return self._layout

    def _read_layout(self) -> _Layout:
        blocks = self.table.blocks()
        refs, counts, labels, ids = [], [], [], []
        for block in blocks:
            cands, marks = block.columns["candidate_ids"], block.columns["labels"]
            assert isinstance(cands, Nested) and isinstance(marks, Packed)
            refs.append(cands.all_refs().astype(np.int64))
            counts.append(np.diff(cands.offsets).astype(np.int64))
            labels.append(np.asarray(marks.values[marks.offsets[0] : marks.offsets[-1]]))
            ids.extend(block.columns["dialogue_id"])  # type: ignore[arg-type]
        if not blocks:
            empty = np.zeros(0, dtype=np.int64)
            return _Layout(True, np.zeros(1, np.int64), empty, empty, empty)
        ref = np.concatenate(refs)
        count = np.concatenate(counts)
        mark = np.concatenate(labels).astype(np.int8)
        offsets = lengths_to_offsets(count)
        pool = self._pool(blocks[0].columns["candidate_ids"])
        n_rows = len(ids)
        if np.array_equal(ref, np.arange(len(pool))):  # every row owns its candidates
            return _Layout(True, offsets, mark, np.zeros(0, np.int64), np.zeros(0, np.int64))
        rows_of = np.repeat(np.arange(n_rows), count)
        if not (
            len(pool) == n_rows
            and np.array_equal(rows_of[mark == 1], np.arange(n_rows))
            and np.array_equal(ref[mark == 1], np.arange(n_rows))
        ):
            raise DataError(
                self.table.root,
                "select.resample_negatives: the training pool is neither one positive per "
                "row (pool row i) nor each row's own candidates; rerun tokenize",
            )
        change = np.ones(n_rows, dtype=bool)
        change[1:] = np.array(ids[1:]) != np.array(ids[:-1])
        bounds = np.append(np.flatnonzero(change), n_rows)
        sizes = np.diff(bounds)
        return _Layout(False, offsets, mark, np.repeat(bounds[:-1], sizes), np.repeat(sizes, sizes))

    @staticmethod
    def _pool(column: Any) -> Packed:
        assert isinstance(column, Nested)
        return column.pool

    def _text_ids(self, pool: Packed) -> np.ndarray:
        """Per pool row, an id of its text (equal ids, equal tokens), as tokenize has it."""
        if self._text_of is None:
            texts = self._texts
            self._text_of = np.array(
                [texts.setdefault(pool[k].tobytes(), len(texts)) for k in range(len(pool))],
                dtype=np.int64,
            )
        return self._text_of

    # ------------------------------------------------------------------ draws

    def __call__(self, example: SelectExample, index: int) -> SelectExample:
        """Row ``index``'s example as this epoch draws it."""
        candidates = example.candidate_ids
        if not isinstance(candidates, Rows):
            raise TypeError("per-epoch draws read candidates from the split's pool (Rows)")
        state = epoch_seed(self.seed, self.epoch, index, "candidates")
        context, positive = self._augment(example, index)
        if self.layout().own:
            entries, labels = self._own(candidates, index, state, positive)
        else:
            entries, labels = self._sampled(candidates.pool, index, state, positive)
        fields = {
            **context,
            "candidate_ids": _gather(candidates, entries, positive.tokens if positive else None),
            "labels": labels,
        }
        flags = example.candidate_knowledge
        if flags is not None:
            if not isinstance(flags, Rows):
                raise TypeError("per-epoch draws read candidate knowledge from the pool (Rows)")
            fields["candidate_knowledge"] = _gather(
                flags, entries, positive.flags if positive else None
            )
        return dataclasses.replace(example, **fields)

    def _own(
        self, candidates: Rows, index: int, state: int, positive: _Positive | None
    ) -> tuple[list[int | None], np.ndarray]:
        """DSTC7: tokenize's training subset of the row's own candidates, drawn anew; with a
        cut-out positive, that and drawn incorrect candidates of other text."""
        lay, n = self.layout(), self.params.n_candidates_train
        lo, hi = int(lay.offsets[index]), int(lay.offsets[index + 1])
        marks = lay.labels[lo:hi]
        if positive is None:
            keep = list(range(len(marks)))
            if len(keep) > n:
                keep = training_subset(marks, n, state)
            return [lo + k for k in keep], marks[keep].astype(np.int8)
        text = positive.tokens.tobytes()
        pool = candidates.pool
        wrong = [
            lo + int(j) for j in np.flatnonzero(marks == 0) if pool[lo + int(j)].tobytes() != text
        ]
        need = min(n - 1, len(wrong))
        chosen = training_subset(np.zeros(len(wrong), np.int8), need, state) if need else []
        return _with_positive([wrong[c] for c in chosen], state)

    def _sampled(
        self, pool: Packed, index: int, state: int, positive: _Positive | None
    ) -> tuple[list[int | None], np.ndarray]:
        """Tokenize's rule (``draw_negatives``) with this epoch's draws; the positive (pool row
        ``index``, or the cut-out one) at a drawn position."""
        lay, n = self.layout(), self.params.n_candidates_train
        text_of = self._text_ids(pool)
        truth = (
            text_of[index] if positive is None else self._texts.get(positive.tokens.tobytes(), -1)
        )
        states = np.array([state], dtype=np.uint64)
        negatives = draw_negatives(
            states,
            text_of,
            lay.first[index : index + 1],
            lay.count[index : index + 1],
            n - 1,
            truth=np.array([truth], dtype=np.int64),
        )
        if negatives is None:
            raise DataError(
                self.table.root,
                f"select.resample_negatives: could not draw {n - 1} distinct negatives from "
                f"other dialogues for training row {index}; lower n_candidates_train",
            )
        rows: list[int | None] = [int(j) for j in negatives[0]]
        if positive is None:
            # draw 0 places the positive, as tokenize does
            at = int(draws_below(counter_draws(states, np.zeros(1))[:, 0], n)[0])
            rows.insert(at, index)
            labels = np.zeros(n, dtype=np.int8)
            labels[at] = 1
            return rows, labels
        return _with_positive(rows, state)

    def _augment(
        self, example: SelectExample, index: int
    ) -> tuple[dict[str, Any], _Positive | None]:
        """The authors' rule: keep the first L of the context's n utterances, L uniform in
        ``[min(m, n), n]``; for L < n utterance L (its first token after the cut) is the new
        positive. No change for L = n, or when utterance L has no words."""
        m = self.params.augment_min_utterances
        utt = example.utt_index
        if m is None or not len(utt):
            return {}, None
        n_utt = int(utt[-1]) + 1
        low = min(m, n_utt)
        state = np.array([epoch_seed(self.seed, self.epoch, index, "context")], dtype=np.uint64)
        keep = low + int(draws_below(counter_draws(state, np.zeros(1))[:, 0], n_utt - low + 1)[0])
        if keep >= n_utt:
            return {}, None
        cut, end = (int(x) for x in np.searchsorted(utt, [keep, keep + 1]))
        tokens = example.input_ids[cut:end]
        if len(tokens) <= 2:  # <bos> <eos>: not a response
            return {}, None
        limit = max(min(len(tokens), self.params.max_candidate), 2)  # as FlatSplit.wrapped
        answer = np.array(tokens[:limit], dtype=INT)
        answer[-1] = EOS_ID
        flags = None
        context: dict[str, Any] = {
            "turn": example.turn - (n_utt - keep),
            "input_ids": example.input_ids[:cut],
            "utt_index": utt[:cut],
            "utt_pos": example.utt_pos[:cut],
            # Codes are relative to the responder: re-anchor on the new positive's speaker.
            "speaker": np.where(
                example.speaker[:cut] == example.speaker[cut], SPEAKER_SELF, SPEAKER_OTHER
            ).astype(INT),
        }
        if example.context_knowledge is not None:
            context["context_knowledge"] = example.context_knowledge[:cut]
            flags = np.array(example.context_knowledge[cut:end][:limit], dtype=np.int8)
            flags[-1] = 0  # <eos> carries no knowledge (examples._wrap_flags)
        return context, _Positive(answer, flags)


def _with_positive(negatives: list[int | None], state: int) -> tuple[list[int | None], np.ndarray]:
    """``negatives`` with the cut-out positive (None) inserted at a drawn position."""
    n = len(negatives) + 1
    first = counter_draws(np.array([state], dtype=np.uint64), np.zeros(1))[:, 0]
    at = int(draws_below(first, n)[0])
    rows = [*negatives[:at], None, *negatives[at:]]
    labels = np.zeros(n, dtype=np.int8)
    labels[at] = 1
    return rows, labels


def _gather(
    stored: Rows, entries: list[int | None], positive: np.ndarray | None
) -> Rows | tuple[np.ndarray, ...]:
    """Pool rows ``entries`` (None: ``positive``): a ``Rows`` view when all are pool rows."""
    if all(e is not None for e in entries):
        return Rows(stored.pool, np.array(entries, dtype=np.int64))
    assert positive is not None
    return tuple(positive if e is None else stored.pool[e] for e in entries)
