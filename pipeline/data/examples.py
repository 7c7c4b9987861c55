"""Training examples for the three task kinds, built from encoded dialogues.

- generate: (history, response) pairs, one per response turn;
- select: (history, candidates, labels), the true response among sampled negatives (or a
  corpus's own candidates, DSTC7);
- lm: documents of sentences.

A request to a served model goes through the same builders (:func:`request_dialogue`;
generate: :func:`build_prompts`), so a model is served what it was trained on. Histories
are ``history.py``'s; the records and their table are ``records.py``'s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.config import GenerateParams, LMParams, SelectParams
from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.encoding import EncodedDialogue, wrap_ids
from pipeline.data.history import FlatSplit, histories_after_last, response_pairs
from pipeline.data.records import (
    INT,
    Column,
    ExampleTable,
    GenerateExample,
    LMExample,
    Nested,
    Packed,
    SelectExample,
    lengths_to_offsets,
)
from pipeline.data.special import BOS_ID, EOS_ID
from pipeline.data.splits import Split
from pipeline.errors import ConfigError

# --------------------------------------------------------------------------- generate


def build_generate(dialogues: Sequence[EncodedDialogue], params: GenerateParams) -> ExampleTable:
    """One example per response turn: the turns before it -> ``<bos> response <eos>``
    (at most ``max_response`` tokens, ``<bos>``/``<eos>`` included)."""
    dialogue, turn = response_pairs(dialogues)
    if not len(dialogue):
        return ExampleTable(GenerateExample, {}, 0)
    flat = FlatSplit(dialogues)
    utterance = flat.first[dialogue] + turn
    h = flat.histories(utterance, flat.first[dialogue], flat.speaker_codes[utterance], params)
    columns: dict[str, Column] = {
        "dialogue_id": [dialogues[i].id for i in dialogue.tolist()],
        "turn": turn,
        **h.columns(),
        "target_ids": flat.wrapped(utterance, params.max_response),
    }
    pairs = list(zip(dialogue.tolist(), turn.tolist(), strict=True))
    for name in ("acts", "belief_ids", "act_ids"):
        per_turn = [getattr(dialogues[i], name) for i, _ in pairs]
        if all(p is not None for p in per_turn):
            columns[name] = Packed.from_arrays(
                [p[t] for p, (_, t) in zip(per_turn, pairs, strict=True)]
            )
    return ExampleTable(GenerateExample, columns, len(dialogue))


# --------------------------------------------------------------------------- select

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _example_seed(seed: int, dialogue_id: str, turn: int) -> int:
    key = f"{seed}\x1f{dialogue_id}\x1f{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def counter_draws(state: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """splitmix64 of ``state + counter * golden``: ``[E] x [M] -> [E, M]`` uint64.

    Draw number k of an example depends only on its seed and k, so the same draws come out
    whether they are taken one by one or a thousand examples at a time.
    """
    z = state.astype(np.uint64)[:, None] + counters.astype(np.uint64)[None, :] * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draws_below(values: np.ndarray, n: np.ndarray | int) -> np.ndarray:
    """Draws -> integers in ``[0, n)`` (int64; the modulo bias is below 2**-40)."""
    return (values % np.asarray(n, dtype=np.uint64)).astype(np.int64)


def build_select(
    dialogues: Sequence[EncodedDialogue],
    params: SelectParams,
    history: GenerateParams,
    split: str,
    seed: int,
    generated: ExampleTable | None = None,
) -> ExampleTable:
    """Context (as for generate) + candidates.

    Dialogues with their own candidates (DSTC7) give one example answering the turn after
    their last, labels from the corpus; on the training split they keep every correct
    candidate and drawn incorrect ones, ``n_candidates_train`` in all (all of them with
    ``resample_negatives``: the loader draws the subset every epoch). Otherwise every
    response turn gives one: the true response and ``n - 1`` negatives drawn from responses
    of OTHER dialogues of the split (distinct texts, none equal to the truth), the truth
    at a drawn position; ``n`` is ``n_candidates_train`` on the training split and
    ``n_candidates_eval`` elsewhere. Draws are seeded by (seed, dialogue id, turn).

    ``generated``: the ``build_generate`` table of the same dialogues and ``history``
    params; its histories (the same rows) are reused instead of rebuilt.
    """
    rule = SelectRule(params, history, split, seed)
    own = [d for d in dialogues if d.candidates is not None and d.utterances]
    sampled = [d for d in dialogues if d.candidates is None]
    if own and sampled:  # not met in the corpora: a slow but simple merge
        both = [*own_candidates(own, rule), *_sampled_candidates(sampled, rule)]
        return ExampleTable.from_examples(both, SelectExample)
    if own:
        return own_candidates(own, rule)
    return _sampled_candidates(sampled, rule, generated)


@dataclass(frozen=True)
class SelectRule:
    """How the select examples of one split are built (``build_select``'s arguments)."""

    params: SelectParams
    history: GenerateParams
    split: str
    seed: int


@dataclass(frozen=True)
class CandidatePool:
    """What the negatives of a split's select examples are drawn from, one entry per pool
    row (every example's true response, in example order; a dialogue's rows contiguous).

    ``text_of``: an id per row, equal for rows of equal tokens (only equality is read);
    ``first``/``count``: the rows of the row's own dialogue; ``distinct``: how many texts;
    ``rows``: the wrapped responses themselves (the pool the select rows refer to).
    """

    text_of: np.ndarray
    first: np.ndarray
    count: np.ndarray
    distinct: int
    rows: Packed

    @classmethod
    def of(cls, rows: Packed, text_of: np.ndarray, dialogue: np.ndarray) -> CandidatePool:
        """The pool of ``rows`` (``dialogue``: the dialogue of each row, rows of a dialogue
        contiguous)."""
        bounds = np.flatnonzero(np.diff(dialogue, prepend=-1, append=-2))
        first = np.repeat(bounds[:-1], np.diff(bounds))
        count = np.repeat(np.diff(bounds), np.diff(bounds))
        distinct = int(text_of.max()) + 1 if len(text_of) else 0
        return cls(text_of, first, count, distinct, rows)


def response_rows(dialogues: Sequence[EncodedDialogue], limit: int) -> tuple[Packed, np.ndarray]:
    """The candidate pool rows of ``dialogues`` (each response turn's ``<bos> .. <eos>``,
    at most ``limit`` tokens, in example order) and the dialogue of each row."""
    dialogue, turn = response_pairs(dialogues)
    if not len(dialogue):
        return Packed(np.zeros(0, INT), np.zeros(1, np.int64)), dialogue
    flat = FlatSplit(dialogues)
    return flat.wrapped(flat.first[dialogue] + turn, limit), dialogue


def _sampled_candidates(
    dialogues: Sequence[EncodedDialogue], rule: SelectRule, generated: ExampleTable | None = None
) -> ExampleTable:
    pool, dialogue = response_rows(dialogues, rule.params.max_candidate)
    texts: dict[bytes, int] = {}
    text_of = np.array(
        [texts.setdefault(pool[k].tobytes(), len(texts)) for k in range(len(pool))], np.int64
    )
    return select_rows(dialogues, rule, CandidatePool.of(pool, text_of, dialogue), 0, generated)


def select_rows(
    dialogues: Sequence[EncodedDialogue],
    rule: SelectRule,
    pool: CandidatePool,
    start: int,
    generated: ExampleTable | None = None,
) -> ExampleTable:
    """The select examples of ``dialogues`` (dialogues without candidates of their own),
    whose true responses are the pool rows from ``start`` on: negatives are drawn from
    the whole ``pool``, so a split built a slice of dialogues at a time gets the rows it
    gets built whole."""
    params, history, split, seed = rule.params, rule.history, rule.split, rule.seed
    train = split == Split.TRAIN
    n = params.n_candidates_train if train else params.n_candidates_eval
    key = "select.n_candidates_train" if train else "select.n_candidates_eval"
    dialogue, turn = response_pairs(dialogues)
    if not len(dialogue):
        return ExampleTable(SelectExample, {}, 0)
    if pool.distinct < n:
        raise ConfigError(
            key, f"the {split} split has only {pool.distinct} distinct responses, fewer than "
            f"{n} candidates; lower it or use more dialogues",
        )  # fmt: skip
    flat = FlatSplit(dialogues)
    utterance = flat.first[dialogue] + turn
    rows = np.arange(start, start + len(dialogue))
    ids = [dialogues[i].id for i in dialogue.tolist()]
    state = np.array(
        [_example_seed(seed, d, t) for d, t in zip(ids, turn.tolist(), strict=True)],
        dtype=np.uint64,
    )
    negatives = draw_negatives(
        state, pool.text_of, pool.first[rows], pool.count[rows], n - 1, pool.text_of[rows]
    )
    if negatives is None:
        raise ConfigError(
            key, f"could not draw {n - 1} distinct negatives from other dialogues for every "
            f"example of the {split} split; lower it",
        )  # fmt: skip
    at = draws_below(counter_draws(state, np.zeros(1))[:, 0], n)  # draw 0 places the truth
    column = np.arange(n)[None, :]
    shifted = np.clip(column - (column > at[:, None]), 0, n - 2)
    refs = np.where(
        column == at[:, None],
        rows[:, None],
        np.take_along_axis(negatives, shifted, axis=1),
    ).astype(INT)
    labels = (column == at[:, None]).astype(np.int8)
    if (
        generated is not None
        and np.array_equal(generated.columns.get("turn"), turn)
        and generated.columns.get("dialogue_id") == ids
    ):
        contexts = {
            k: generated.columns[k] for k in ("input_ids", "utt_index", "utt_pos", "speaker")
        }
    else:
        first = flat.first[dialogue]
        contexts = flat.histories(
            utterance, first, flat.speaker_codes[utterance], history
        ).columns()
    per_row = np.arange(0, len(rows) * n + 1, n, dtype=np.int64)
    columns: dict[str, Column] = {
        "dialogue_id": ids,
        "turn": turn,
        **contexts,
        "candidate_ids": Nested(pool.rows, per_row, refs.ravel()),
        "labels": Packed(labels.ravel(), per_row),
    }
    return ExampleTable(SelectExample, columns, len(rows))


def draw_negatives(
    state: np.ndarray,
    text_of: np.ndarray,
    first: np.ndarray,
    count: np.ndarray,
    k: int,
    truth: np.ndarray | None = None,
) -> np.ndarray | None:
    """``[E, k]`` pool indices: for example e, the first ``k`` of its draws 1, 2, ... that
    fall outside its own dialogue's block ``[first, first + count)`` and whose text is new
    (not the truth's, not drawn before). None if some example cannot get ``k``.

    ``truth``: each example's truth as a text id of ``text_of`` (-1: a text not in the
    pool); None: example e's truth is pool row e (tokenize). The per-epoch draws of
    ``resample.py`` pass it."""
    truths = text_of[: len(state)] if truth is None else truth
    others = len(text_of) - count
    if (others <= 0).any():
        return None
    out = np.full((len(state), k), -1, dtype=np.int64)
    todo = np.arange(len(state))
    # Rows short of k valid draws retry over a wider window; as the window restarts at
    # draw 1, "the first k valid draws" does not depend on the window.
    for width in (2 * k + 8, 8 * k + 64, 64 * k + 512):
        rows = todo
        counters = np.arange(1, width + 1)
        j = draws_below(counter_draws(state[rows], counters), others[rows][:, None])
        j += np.where(j >= first[rows][:, None], count[rows][:, None], 0)
        text = text_of[j]
        order = np.argsort(text, axis=1, kind="stable")
        ranked = np.take_along_axis(text, order, axis=1)
        new_in_rank = np.ones_like(ranked, dtype=bool)
        new_in_rank[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
        new = np.empty_like(new_in_rank)
        np.put_along_axis(new, order, new_in_rank, axis=1)
        valid = new & (text != truths[rows][:, None])
        rank = np.cumsum(valid, axis=1)
        done = rank[:, -1] >= k
        take = valid & (rank <= k) & done[:, None]
        out[rows[done]] = j[take].reshape(-1, k)
        todo = rows[~done]
        if not len(todo):
            return out
    return None


def own_candidates(dialogues: Sequence[EncodedDialogue], rule: SelectRule) -> ExampleTable:
    """The select examples of dialogues with candidates of their own (DSTC7): one per
    dialogue, built from it alone (its pool holds its candidates)."""
    params, history, split, seed = rule.params, rule.history, rule.split, rule.seed
    kept: list[list[int]] = []
    for d in dialogues:
        marks = d.labels if d.labels is not None else np.zeros(len(d.candidates or ()), np.int8)
        keep = list(range(len(marks)))
        # With per-epoch draws the training shards keep every candidate: each epoch then
        # draws its subset (resample.py), as the authors' DSTC7Dataset does.
        subset = split == Split.TRAIN and not params.resample_negatives
        if subset and len(keep) > params.n_candidates_train:
            state = _example_seed(seed, d.id, len(d.utterances))
            keep = training_subset(marks, params.n_candidates_train, state)
        kept.append(keep)
    limit = params.max_candidate
    pool = Packed.from_arrays(
        [wrap_ids(d.candidates[j], limit) for d, keep in zip(dialogues, kept, strict=True)
         for j in keep if d.candidates is not None]
    )  # fmt: skip
    flags = None
    if all(d.candidate_knowledge is not None for d in dialogues):
        flags = Packed(
            np.concatenate(
                [_wrap_flags(d.candidate_knowledge[j], limit)
                 for d, keep in zip(dialogues, kept, strict=True)
                 for j in keep if d.candidate_knowledge is not None]
                or [np.zeros(0, np.int8)]
            ),
            pool.offsets,
        )  # fmt: skip
    h = histories_after_last(dialogues, history)
    per_row = lengths_to_offsets(np.array([len(k) for k in kept], dtype=np.int64))
    labels = [
        (d.labels if d.labels is not None else np.zeros(len(keep), np.int8))[keep]
        for d, keep in zip(dialogues, kept, strict=True)
    ]
    columns: dict[str, Column] = {
        "dialogue_id": [d.id for d in dialogues],
        "turn": np.array([len(d.utterances) for d in dialogues], dtype=np.int64),
        **h.columns(),
        "candidate_ids": Nested(pool, per_row),
        "labels": Packed.from_arrays(labels, np.int8),
        "context_knowledge": h.knowledge,
        "candidate_knowledge": None if flags is None else Nested(flags, per_row),
    }
    return ExampleTable(SelectExample, columns, len(dialogues))


def training_subset(labels: np.ndarray, n: int, state: int) -> list[int]:
    """Indices of every correct candidate plus drawn incorrect ones, ``n`` in all, in their
    original order (the paper trains on 1 positive + 9 negatives of the 100)."""
    correct = [int(i) for i in np.flatnonzero(labels)][:n]
    wrong = [int(i) for i in np.flatnonzero(labels == 0)]
    need = n - len(correct)
    raw = counter_draws(np.array([state], dtype=np.uint64), np.arange(1, need + 1))[0]
    for k in range(need):  # a partial Fisher-Yates shuffle
        j = k + int(raw[k] % np.uint64(len(wrong) - k))
        wrong[k], wrong[j] = wrong[j], wrong[k]
    return sorted(correct + wrong[:need])


def _wrap_flags(flags: np.ndarray, limit: int | None = None) -> np.ndarray:
    """Flags aligned with ``_wrap``: 0 for ``<bos>``/``<eos>``."""
    body = flags if limit is None else flags[: max(limit - 2, 0)]
    return np.concatenate([[0], body, [0]]).astype(np.int8)


# --------------------------------------------------------------------------- lm


def build_lm(dialogues: Sequence[EncodedDialogue], params: LMParams) -> ExampleTable:
    """Documents of at most ``sentences_per_document`` non-empty sentences, each
    ``w.. <eos>`` cut to ``max_sentence`` tokens (``<eos>`` included)."""
    ids: list[str] = []
    first_turn: list[int] = []
    documents: list[list[np.ndarray]] = []
    step = params.sentences_per_document
    for d in dialogues:
        turns = [t for t, u in enumerate(d.utterances) if len(u)]
        for i in range(0, len(turns), step):
            chunk = turns[i : i + step]
            ids.append(d.id)
            first_turn.append(chunk[0])
            documents.append([_sentence(d.utterances[t], params.max_sentence) for t in chunk])
    columns: dict[str, Column] = {
        "dialogue_id": ids,
        "turn": np.array(first_turn, dtype=np.int64),
        "sentences": Nested.from_rows(documents),
    }
    return ExampleTable(LMExample, columns, len(ids))


def _sentence(words: np.ndarray, limit: int | None) -> np.ndarray:
    """``w.. <eos>``, at most ``limit`` tokens (all of them if None)."""
    kept = len(words) if limit is None else min(len(words), limit - 1)
    out = np.empty(kept + 1, dtype=INT)
    out[:-1], out[-1] = words[: len(out) - 1], EOS_ID
    return out


# --------------------------------------------------------------------------- requests

# Speakers of a free-standing history: the response is "self"'s, the last utterance the
# other party's, and turns alternate back from there.
_SELF, _OTHER = "self", "other"


def request_dialogue(
    dialogue_id: str, texts: Sequence[str], candidates: Sequence[str] | None = None
) -> Dialogue:
    """A request to a served model as a dialogue the builders above take: ``texts`` (a
    history, oldest first, or an LM document's sentences) answered by "self" after the
    last, turns alternating back from the other party's last one; no texts is one empty
    turn (every training history has a turn). ``candidates``: the responses to score, as
    a corpus's own candidates (labels unknown: 0)."""
    texts = list(texts) or [""]
    n = len(texts)
    turns = tuple(Turn(_SELF if (n - t) % 2 == 0 else _OTHER, text) for t, text in enumerate(texts))
    meta: dict[str, object] = {"response_speaker": _SELF}
    if candidates is not None:
        meta["candidates"] = [{"id": str(k), "text": c} for k, c in enumerate(candidates)]
    return Dialogue(dialogue_id, turns, meta)


def build_prompts(dialogues: Sequence[EncodedDialogue], params: GenerateParams) -> ExampleTable:
    """Generate examples of the response after each dialogue's last turn, still to be
    written (serving): the history cut as :func:`build_generate` cuts it, the target
    ``<bos>`` alone (where decoding starts), ``turn`` the response's turn number."""
    h = histories_after_last(dialogues, params)
    n = len(dialogues)
    columns: dict[str, Column] = {
        "dialogue_id": [d.id for d in dialogues],
        "turn": np.array([len(d.utterances) for d in dialogues], dtype=np.int64),
        **h.columns(),
        "target_ids": Packed(np.full(n, BOS_ID, dtype=INT), np.arange(n + 1, dtype=np.int64)),
    }
    return ExampleTable(GenerateExample, columns, n)
