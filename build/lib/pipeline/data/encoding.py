"""Encoding: every text of a split turned into token ids once (``encode_dialogues``), with
the corpus-specific options (the system side of task-oriented corpora, acts, belief,
delexicalisation), and the DSTC7 knowledge flags of the Advising candidates."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.data.acts import ActInventory, delexicalize, serialize_acts, serialize_belief
from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.records import INT, KNOWLEDGE_PRIOR, KNOWLEDGE_SUGGESTED
from pipeline.data.special import BOS_ID, EOS_ID
from pipeline.data.vocab import Vocab, word_tokenize

# --------------------------------------------------------------------------- encoding


@dataclass(frozen=True, slots=True, eq=False)
class EncodedDialogue:
    """A dialogue with every text encoded once (word ids, no ``<bos>``/``<eos>``).

    ``responder`` limits which turns are responses (MultiWOZ: the system). Corpus extras:
    ``acts``/``belief_ids``/``act_ids`` per turn (MultiWOZ); ``candidates``/``labels``/
    knowledge flags (DSTC7), whose example answers the turn after the last.
    """

    id: str
    speakers: tuple[str, ...]
    utterances: tuple[np.ndarray, ...]
    responder: str | None = None
    acts: tuple[np.ndarray, ...] | None = None
    belief_ids: tuple[np.ndarray, ...] | None = None
    act_ids: tuple[np.ndarray, ...] | None = None
    candidates: tuple[np.ndarray, ...] | None = None
    labels: np.ndarray | None = None
    response_speaker: str | None = None
    knowledge: tuple[np.ndarray, ...] | None = None
    candidate_knowledge: tuple[np.ndarray, ...] | None = None


@dataclass(frozen=True)
class EncodeOptions:
    """Corpus-specific encoding: which speaker answers, MultiWOZ annotations."""

    responder: str | None = None
    inventory: ActInventory | None = None
    delexicalize: bool = False


def _turn_text(turn: Turn, options: EncodeOptions) -> str:
    """The text a turn is encoded from: MultiWOZ responses get placeholders for act values."""
    responds = options.responder is None or turn.speaker == options.responder
    if options.delexicalize and turn.acts and responds:
        return delexicalize(turn.text, turn.acts)
    return turn.text


def vocab_texts(
    dialogues: Iterable[Dialogue], options: EncodeOptions = EncodeOptions()
) -> Iterator[str]:
    """The texts a vocabulary is built from: turns (as encoded), serialised belief states
    and acts (MultiWOZ), and a corpus's own candidates (DSTC7)."""
    for d in dialogues:
        for t in d.turns:
            yield _turn_text(t, options)
            if options.inventory is not None:
                yield serialize_belief(t.belief)
                yield serialize_acts(t.acts)
        for c in d.meta.get("candidates", ()):
            yield c["text"]


def encode_dialogues(
    dialogues: Sequence[Dialogue], vocab: Vocab, options: EncodeOptions = EncodeOptions()
) -> list[EncodedDialogue]:
    """Encode every text of ``dialogues`` once (in one batch, which BPE parallelises)."""
    texts: list[str] = []
    for d in dialogues:
        texts.extend(_turn_text(t, options) for t in d.turns)
        texts.extend(c["text"] for c in d.meta.get("candidates", ()))
    ids = iter(vocab.encode_batch(texts))
    encoded = []
    for d in dialogues:
        utterances = tuple(np.asarray(next(ids), dtype=INT) for _ in d.turns)
        candidates = labels = None
        if "candidates" in d.meta:
            candidates = tuple(np.asarray(next(ids), dtype=INT) for _ in d.meta["candidates"])
            correct = set(d.meta.get("correct_ids") or ())
            labels = np.array([c["id"] in correct for c in d.meta["candidates"]], dtype=np.int8)
        extras: dict[str, Any] = {}
        if options.inventory is not None:
            extras["acts"] = tuple(options.inventory.indices(t.acts) for t in d.turns)
            extras["belief_ids"] = tuple(
                wrap_ids(vocab.encode(serialize_belief(t.belief))) for t in d.turns
            )
            extras["act_ids"] = tuple(
                wrap_ids(vocab.encode(serialize_acts(t.acts))) for t in d.turns
            )
        if "profile" in d.meta:
            prior, suggested = profile_courses(d.meta["profile"])
            extras["knowledge"] = tuple(
                knowledge_flags(_token_strings(_turn_text(t, options), u, vocab), prior, suggested)
                for t, u in zip(d.turns, utterances, strict=True)
            )
            if candidates is not None:
                extras["candidate_knowledge"] = tuple(
                    knowledge_flags(_token_strings(c["text"], u, vocab), prior, suggested)
                    for c, u in zip(d.meta["candidates"], candidates, strict=True)
                )
        encoded.append(
            EncodedDialogue(
                id=d.id,
                speakers=tuple(t.speaker for t in d.turns),
                utterances=utterances,
                responder=options.responder,
                candidates=candidates,
                labels=labels,
                response_speaker=d.meta.get("response_speaker"),
                **extras,
            )
        )
    return encoded


def wrap_ids(ids: Sequence[int] | np.ndarray, limit: int | None = None) -> np.ndarray:
    """``<bos> ids[:limit-2] <eos>`` as int32."""
    body = np.asarray(ids, dtype=INT)
    if limit is not None:
        body = body[: max(limit - 2, 0)]
    out = np.empty(len(body) + 2, dtype=INT)
    out[0], out[-1] = BOS_ID, EOS_ID
    out[1:-1] = body
    return out


# --------------------------------------------------------------------------- DSTC7 knowledge

_COURSE_RE = re.compile(r"([a-z]+)\s*-?\s*(\d+)")


def profile_courses(profile: Mapping[str, Any]) -> tuple[set[str], set[str]]:
    """Course codes (``eecs281``) a DSTC7 Advising student took and was suggested.

    Reads ``profile["Courses"]["Prior"|"Suggested"]``: lists of course entries (a code
    string or a dict with an ``offering`` such as ``"EECS281-000"``).
    """
    courses = profile.get("Courses", {}) if isinstance(profile, Mapping) else {}

    def codes(entries: Any) -> set[str]:
        found = set()
        for entry in entries or ():
            text = entry.get("offering", "") if isinstance(entry, Mapping) else str(entry)
            m = _COURSE_RE.match(text.lower().strip())
            if m:
                found.add(m.group(1) + m.group(2))
        return found

    return codes(courses.get("Prior")), codes(courses.get("Suggested"))


def _token_strings(text: str, ids: np.ndarray, vocab: Vocab) -> list[str]:
    """The surface form of each token (unknown words keep their text for matching)."""
    if vocab.kind == "word":
        words = word_tokenize(text, vocab.lowercase)
        if len(words) == len(ids):
            return [w.lower() for w in words]
    return [vocab.tokens[i].lstrip("\u2581").lower() for i in ids]


def knowledge_flags(tokens: Sequence[str], prior: set[str], suggested: set[str]) -> np.ndarray:
    """Per-token bit flags: a course mention (``eecs281`` or ``eecs 281``) of the profile."""
    flags = np.zeros(len(tokens), dtype=np.int8)
    for i, tok in enumerate(tokens):
        spans = [((i,), tok)]
        if i > 0 and tok.isdigit():
            spans.append(((i - 1, i), tokens[i - 1] + tok))
        for positions, code in spans:
            bits = KNOWLEDGE_PRIOR * (code in prior) | KNOWLEDGE_SUGGESTED * (code in suggested)
            for p in positions:
                flags[p] |= bits
    return flags
