"""Dialogue histories, the one definition training, evaluation and serving share.

A history is the flat concatenation of the turns before the response, each
``<bos> w.. <eos>``, cut to the MOST RECENT ``max_history`` tokens and ``max_utterances``
utterances (the U-Net authors kept the oldest, so the turn being answered could be lost).
The builders work on a whole split at once: a history is a range of the split's flat
token array, so all of them are gathered with a few numpy calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.config import GenerateParams
from pipeline.data.encoding import EncodedDialogue
from pipeline.data.records import INT, Column, Packed, lengths_to_offsets
from pipeline.data.special import BOS_ID, EOS_ID, SPEAKER_OTHER, SPEAKER_SELF

# --------------------------------------------------------------------------- histories


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


@dataclass(frozen=True)
class Histories:
    """Histories of many examples, packed (the four columns share offsets)."""

    input_ids: Packed
    utt_index: Packed
    utt_pos: Packed
    speaker: Packed
    knowledge: Packed | None

    def columns(self) -> dict[str, Column]:
        return {
            "input_ids": self.input_ids,
            "utt_index": self.utt_index,
            "utt_pos": self.utt_pos,
            "speaker": self.speaker,
        }


class FlatSplit:
    """Every turn of a split as one ``<bos> w.. <eos>`` token array, with per token its
    utterance number, position in the utterance and speaker code: the history of any
    (dialogue, turn) is then a range, and all of a split's are gathered in a few numpy calls.
    """

    def __init__(self, dialogues: Sequence[EncodedDialogue]) -> None:
        utterances = [u for d in dialogues for u in d.utterances]
        self.first = lengths_to_offsets(
            np.array([len(d.utterances) for d in dialogues], dtype=np.int64)
        )
        body = np.array([len(u) for u in utterances], dtype=np.int64)
        lengths = body + 2
        self.starts = lengths_to_offsets(lengths)
        total = int(self.starts[-1])
        self.tokens = np.empty(total, dtype=INT)
        self.tokens[self.starts[:-1]] = BOS_ID
        self.tokens[self.starts[1:] - 1] = EOS_ID
        if body.sum():
            self.tokens[_ranges(self.starts[:-1] + 1, body)] = np.concatenate(utterances)
        self.utt_of = np.repeat(np.arange(len(utterances), dtype=np.int64), lengths)
        self.pos = np.arange(total, dtype=np.int64) - np.repeat(self.starts[:-1], lengths)
        self._codes: dict[tuple[int, str], int] = {}
        codes = [self._codes.setdefault((i, s), len(self._codes))
                 for i, d in enumerate(dialogues) for s in d.speakers]  # fmt: skip
        self.speaker_codes = np.array(codes, dtype=np.int64)
        self.speaker_of = np.repeat(self.speaker_codes, lengths)
        self.knowledge = None
        if dialogues and all(d.knowledge is not None for d in dialogues):
            flags = [k for d in dialogues for k in d.knowledge or ()]
            self.knowledge = np.zeros(total, dtype=np.int8)
            if body.sum():
                self.knowledge[_ranges(self.starts[:-1] + 1, body)] = np.concatenate(flags)

    def code(self, dialogue: int, speaker: str | None) -> int:
        """The speaker code of ``speaker`` in a dialogue (-1: not one of its speakers)."""
        return -1 if speaker is None else self._codes.get((dialogue, speaker), -1)

    def histories(
        self, utterance: np.ndarray, lo: np.ndarray, responder: np.ndarray, params: GenerateParams
    ) -> Histories:
        """The histories before global utterances ``utterance`` (one per example): turns
        from ``max(lo, utterance - max_utterances)``, cut to the most recent
        ``max_history`` tokens (a limit of None: no cut); speaker SELF where the code
        equals ``responder``."""
        end = self.starts[utterance]
        first_utterance = lo
        if params.max_utterances is not None:
            first_utterance = np.maximum(utterance - params.max_utterances, lo)
        start = self.starts[first_utterance]
        if params.max_history is not None:
            start = np.maximum(start, end - params.max_history)
        length = end - start
        idx = _ranges(start, length)
        head = np.minimum(start, max(len(self.tokens) - 1, 0))  # each history's first token
        utt_index = self.utt_of[idx] - np.repeat(self.utt_of[head], length)
        # A cut first utterance restarts its positions at 0.
        shift = np.where(utt_index == 0, np.repeat(self.pos[head], length), 0)
        same = self.speaker_of[idx] == np.repeat(responder, length)
        offsets = lengths_to_offsets(length)
        return Histories(
            Packed(self.tokens[idx], offsets),
            Packed(utt_index.astype(INT), offsets),
            Packed((self.pos[idx] - shift).astype(INT), offsets),
            Packed(np.where(same, SPEAKER_SELF, SPEAKER_OTHER).astype(INT), offsets),
            None if self.knowledge is None else Packed(self.knowledge[idx], offsets),
        )

    def wrapped(self, utterance: np.ndarray, limit: int) -> Packed:
        """Utterances as ``<bos> w.. <eos>`` of at most ``limit`` tokens (at least 2)."""
        start = self.starts[utterance]
        length = np.maximum(np.minimum(self.starts[utterance + 1] - start, limit), 2)
        offsets = lengths_to_offsets(length)
        values = self.tokens[_ranges(start, length)]
        values[offsets[1:] - 1] = EOS_ID
        return Packed(values, offsets)


def response_turns(d: EncodedDialogue) -> Iterator[int]:
    """Turns that get an example: t >= 1, non-empty, by the responder if one is set."""
    for t in range(1, len(d.utterances)):
        if len(d.utterances[t]) and (d.responder is None or d.speakers[t] == d.responder):
            yield t


def response_pairs(dialogues: Sequence[EncodedDialogue]) -> tuple[np.ndarray, np.ndarray]:
    """(dialogue index, turn) of every response turn, in order."""
    pairs = [(i, t) for i, d in enumerate(dialogues) for t in response_turns(d)]
    array = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return array[:, 0], array[:, 1]


def histories_after_last(dialogues: Sequence[EncodedDialogue], params: GenerateParams) -> Histories:
    """The histories of the responses after each dialogue's last turn (a corpus's own
    candidates, DSTC7; requests to a served model), cut as any response's: every turn of
    the dialogue, to ``params``' limits. The responder is the dialogue's
    ``response_speaker`` or, failing that, the participant who did not speak last (DSTC7
    dialogues alternate between two participants)."""
    flat = FlatSplit(dialogues)
    responders = []
    for i, d in enumerate(dialogues):
        last = d.speakers[-1]
        named = d.response_speaker or next((s for s in reversed(d.speakers) if s != last), None)
        responders.append(flat.code(i, named))
    n_turns = np.array([len(d.utterances) for d in dialogues], dtype=np.int64)
    end = flat.first[:-1] + n_turns  # the turn after the last
    return flat.histories(end, flat.first[:-1], np.array(responders, dtype=np.int64), params)
