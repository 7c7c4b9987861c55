"""Training examples for the three task kinds, built from canonical Dialogues and a Vocab.

- generate: (history, response) pairs, one per response turn;
- select: (history, candidates, labels), the true response among sampled negatives (or a
  corpus's own candidates, DSTC7);
- lm: documents of sentences.

A history is the flat concatenation of the turns before the response, each
``<bos> w.. <eos>``, cut to the MOST RECENT ``max_history`` tokens (the U-Net authors kept
the oldest, so the turn being answered could be lost). Arrays are int32 (labels and
knowledge flags int8).

Sections: the example records and the columnar :class:`ExampleTable` that holds many of
them; MultiWOZ acts (inventory, serialisation, delexicalisation); encoding (every text of a
split encoded once); DSTC7 knowledge flags; then the builders. Builders work on a whole
split at once: a history is a range of the split's flat token array, so all of them are
gathered with a few numpy calls, and tables stay columnar until written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import GenerateParams, LMParams, SelectParams
from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.special import BOS_ID, EOS_ID, SPEAKER_OTHER, SPEAKER_SELF
from pipeline.data.vocab import Vocab, word_tokenize
from pipeline.errors import ConfigError, DataError

INT = np.int32
_EMPTY = np.zeros(0, dtype=INT)
TRAIN_SPLIT = "train"


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True, eq=False)
class GenerateExample:
    """History -> response. ``acts`` holds indices into the :class:`ActInventory`."""

    dialogue_id: str
    turn: int
    input_ids: np.ndarray
    utt_index: np.ndarray
    utt_pos: np.ndarray
    speaker: np.ndarray
    target_ids: np.ndarray
    acts: np.ndarray | None = None
    belief_ids: np.ndarray | None = None
    act_ids: np.ndarray | None = None


@dataclass(frozen=True, slots=True, eq=False)
class SelectExample:
    """History + candidates; ``labels[i]`` = 1 if candidate i is a correct response.

    ``candidate_ids`` is any sequence of int arrays. Knowledge flags (DSTC7 Advising) are
    per token bit sets: bit 0 = a course the student took (profile prior), bit 1 = a
    course suggested to the student.
    """

    dialogue_id: str
    turn: int
    input_ids: np.ndarray
    utt_index: np.ndarray
    utt_pos: np.ndarray
    speaker: np.ndarray
    candidate_ids: Sequence[np.ndarray]
    labels: np.ndarray
    context_knowledge: np.ndarray | None = None
    candidate_knowledge: Sequence[np.ndarray] | None = None


@dataclass(frozen=True, slots=True, eq=False)
class LMExample:
    """A document: ``sentences[i]`` = ``w.. <eos>``; ``turn`` = its first sentence's index."""

    dialogue_id: str
    turn: int
    sentences: Sequence[np.ndarray]


Example = GenerateExample | SelectExample | LMExample
KNOWLEDGE_PRIOR = 1
KNOWLEDGE_SUGGESTED = 2
N_KNOWLEDGE = 2


def examples_equal(a: Example, b: Example) -> bool:
    """Field-by-field equality (dataclass ``==`` cannot compare numpy arrays)."""
    if type(a) is not type(b):
        return False
    return all(_value_equal(getattr(a, f), getattr(b, f)) for f in a.__slots__)


def _value_equal(x: Any, y: Any) -> bool:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return x is not None and y is not None and np.array_equal(x, y)
    if isinstance(x, Sequence) and not isinstance(x, str):
        return (
            isinstance(y, Sequence)
            and len(x) == len(y)
            and all(_value_equal(p, q) for p, q in zip(x, y, strict=True))
        )
    return x == y


# --------------------------------------------------------------------------- tables


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
        offsets = _offsets(np.array([len(a) for a in arrays], dtype=np.int64))
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
        return cls(pool, _offsets(np.array([len(r) for r in rows], dtype=np.int64)))

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
        for name in kind.__slots__:
            values = [getattr(e, name) for e in examples]
            columns[name] = _pack(name, values)
        return cls(kind, columns, len(examples))

    def __len__(self) -> int:
        return self.length

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


# --------------------------------------------------------------------------- MultiWOZ acts


def _split_act(act: str) -> tuple[str, str]:
    domain, _, kind = act.lower().partition("-")
    return (domain, kind) if kind else ("general", domain)


_NO_SLOT = "none"
# Values too generic to delexicalise: "yes"/"no" (parking, internet) would replace
# ordinary words, "?" marks a request, "none"/"dontcare" carry no entity.
_NOT_VALUES = frozenset(
    {"", "none", "?", "dontcare", "dont care", "don't care", "do n't care", "yes", "no"}
)


@dataclass(frozen=True)
class ActInventory:
    """The HDSA-style multi-hot act space: domains, then act types, then slots.

    Built from the training split only (sorted, so it is a function of the data), with
    the ``domain_slot`` pairs that delexicalisation turns into ``[domain_slot]`` tokens.
    """

    domains: tuple[str, ...]
    acts: tuple[str, ...]
    slots: tuple[str, ...]
    slot_pairs: tuple[str, ...]

    @classmethod
    def from_dialogues(cls, dialogues: Iterable[Dialogue]) -> ActInventory:
        domains, kinds, slots, pairs = set(), set(), set(), set()
        for dialogue in dialogues:
            for turn in dialogue.turns:
                for act, slot_values in (turn.acts or {}).items():
                    domain, kind = _split_act(act)
                    domains.add(domain)
                    kinds.add(kind)
                    for slot, *_ in slot_values:
                        if slot.lower() != _NO_SLOT:
                            slots.add(slot.lower())
                            pairs.add(f"{domain}_{slot.lower()}")
        return cls(*(tuple(sorted(s)) for s in (domains, kinds, slots, pairs)))

    def __len__(self) -> int:
        return len(self.domains) + len(self.acts) + len(self.slots)

    @property
    def names(self) -> tuple[str, ...]:
        """One name per multi-hot position (``domain:hotel``, ``act:inform``, ``slot:area``)."""
        return (
            *(f"domain:{d}" for d in self.domains),
            *(f"act:{a}" for a in self.acts),
            *(f"slot:{s}" for s in self.slots),
        )

    @property
    def placeholders(self) -> tuple[str, ...]:
        """Delexicalisation tokens, ``[hotel_area]`` ..., that the vocabulary must keep."""
        return tuple(f"[{p}]" for p in self.slot_pairs)

    def indices(self, acts: Mapping[str, Sequence[Sequence[str]]] | None) -> np.ndarray:
        """Sorted multi-hot positions of ``acts``; parts unseen in training are dropped."""
        if not acts:
            return _EMPTY
        n_dom, n_act = len(self.domains), len(self.acts)
        hot = set()
        for act, slot_values in acts.items():
            domain, kind = _split_act(act)
            if domain in self.domains:
                hot.add(self.domains.index(domain))
            if kind in self.acts:
                hot.add(n_dom + self.acts.index(kind))
            for slot, *_ in slot_values:
                if slot.lower() in self.slots:
                    hot.add(n_dom + n_act + self.slots.index(slot.lower()))
        return np.array(sorted(hot), dtype=INT)

    def save(self, path: str | Path) -> None:
        """Write as JSON, atomically."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        body = {
            "domains": self.domains,
            "acts": self.acts,
            "slots": self.slots,
            "slot_pairs": self.slot_pairs,
        }
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> ActInventory:
        try:
            raw = json.loads(Path(path).read_text())
            return cls(*(tuple(raw[k]) for k in ("domains", "acts", "slots", "slot_pairs")))
        except FileNotFoundError:
            raise DataError(path, "act inventory not found; run the tokenize stage") from None
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(path, f"not an act inventory ({err})") from None


def serialize_belief(belief: Mapping[str, str] | None) -> str:
    """``{"hotel-area": "east", "hotel-stars": "4"}`` -> ``hotel area east ; hotel stars 4``."""
    items = sorted((belief or {}).items())
    return " ; ".join(f"{k.replace('-', ' ', 1)} {v}".strip() for k, v in items)


def serialize_acts(acts: Mapping[str, Sequence[Sequence[str]]] | None) -> str:
    """``{"Hotel-Inform": [["Area", "east"]]}`` -> ``hotel inform area east`` (``;`` between)."""
    parts = []
    for act, slot_values in (acts or {}).items():
        domain, kind = _split_act(act)
        if not slot_values:
            parts.append(f"{domain} {kind}")
        for slot, *value in slot_values:
            words = [domain, kind]
            if slot.lower() != _NO_SLOT:
                words.append(slot.lower())
                if value and value[0].lower() != _NO_SLOT:
                    words.append(value[0])
            parts.append(" ".join(words))
    return " ; ".join(parts)


def delexicalize(text: str, acts: Mapping[str, Sequence[Sequence[str]]] | None) -> str:
    """Replace act slot values found in ``text`` (whole words, any case) by ``[domain_slot]``.

    Longer values go first, so "cambridge lodge" wins over "cambridge".
    """
    values: dict[str, str] = {}
    for act, slot_values in (acts or {}).items():
        domain, _ = _split_act(act)
        for slot, *value in slot_values:
            if not value or slot.lower() == _NO_SLOT:
                continue
            v = value[0].strip()
            if v.lower() not in _NOT_VALUES:
                values.setdefault(v.lower(), f"[{domain}_{slot.lower()}]")
    for v in sorted(values, key=lambda s: (-len(s), s)):
        pattern = re.compile(rf"(?<!\w){re.escape(v)}(?!\w)", re.IGNORECASE)
        text = pattern.sub(values[v], text)
    return text


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
                _wrap(vocab.encode(serialize_belief(t.belief))) for t in d.turns
            )
            extras["act_ids"] = tuple(_wrap(vocab.encode(serialize_acts(t.acts))) for t in d.turns)
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


def _wrap(ids: Sequence[int] | np.ndarray, limit: int | None = None) -> np.ndarray:
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


# --------------------------------------------------------------------------- histories


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


@dataclass(frozen=True)
class _Histories:
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


class _FlatSplit:
    """Every turn of a split as one ``<bos> w.. <eos>`` token array, with per token its
    utterance number, position in the utterance and speaker code: the history of any
    (dialogue, turn) is then a range, and all of a split's are gathered in a few numpy calls.
    """

    def __init__(self, dialogues: Sequence[EncodedDialogue]) -> None:
        utterances = [u for d in dialogues for u in d.utterances]
        self.first = _offsets(np.array([len(d.utterances) for d in dialogues], dtype=np.int64))
        body = np.array([len(u) for u in utterances], dtype=np.int64)
        lengths = body + 2
        self.starts = _offsets(lengths)
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
    ) -> _Histories:
        """The histories before global utterances ``utterance`` (one per example): turns
        from ``max(lo, utterance - max_utterances)``, cut to the most recent
        ``max_history`` tokens; speaker SELF where the code equals ``responder``."""
        end = self.starts[utterance]
        first = self.starts[np.maximum(utterance - params.max_utterances, lo)]
        start = np.maximum(first, end - params.max_history)
        length = end - start
        idx = _ranges(start, length)
        head = np.minimum(start, max(len(self.tokens) - 1, 0))  # each history's first token
        utt_index = self.utt_of[idx] - np.repeat(self.utt_of[head], length)
        # A cut first utterance restarts its positions at 0.
        shift = np.where(utt_index == 0, np.repeat(self.pos[head], length), 0)
        same = self.speaker_of[idx] == np.repeat(responder, length)
        offsets = _offsets(length)
        return _Histories(
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
        offsets = _offsets(length)
        values = self.tokens[_ranges(start, length)]
        values[offsets[1:] - 1] = EOS_ID
        return Packed(values, offsets)


def response_turns(d: EncodedDialogue) -> Iterator[int]:
    """Turns that get an example: t >= 1, non-empty, by the responder if one is set."""
    for t in range(1, len(d.utterances)):
        if len(d.utterances[t]) and (d.responder is None or d.speakers[t] == d.responder):
            yield t


def _response_pairs(dialogues: Sequence[EncodedDialogue]) -> tuple[np.ndarray, np.ndarray]:
    """(dialogue index, turn) of every response turn, in order."""
    pairs = [(i, t) for i, d in enumerate(dialogues) for t in response_turns(d)]
    array = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return array[:, 0], array[:, 1]


# --------------------------------------------------------------------------- generate


def build_generate(dialogues: Sequence[EncodedDialogue], params: GenerateParams) -> ExampleTable:
    """One example per response turn: the turns before it -> ``<bos> response <eos>``
    (at most ``max_response`` tokens, ``<bos>``/``<eos>`` included)."""
    dialogue, turn = _response_pairs(dialogues)
    if not len(dialogue):
        return ExampleTable(GenerateExample, {}, 0)
    flat = _FlatSplit(dialogues)
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


def _draws(state: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """splitmix64 of ``state + counter * golden``: ``[E] x [M] -> [E, M]`` uint64.

    Draw number k of an example depends only on its seed and k, so the same draws come out
    whether they are taken one by one or a thousand examples at a time.
    """
    z = state.astype(np.uint64)[:, None] + counters.astype(np.uint64)[None, :] * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _below(values: np.ndarray, n: np.ndarray | int) -> np.ndarray:
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
    candidate and drawn incorrect ones, ``n_candidates_train`` in all. Otherwise every
    response turn gives one: the true response and ``n - 1`` negatives drawn from responses
    of OTHER dialogues of the split (distinct texts, none equal to the truth), the truth
    at a drawn position; ``n`` is ``n_candidates_train`` on the training split and
    ``n_candidates_eval`` elsewhere. Draws are seeded by (seed, dialogue id, turn).

    ``generated``: the ``build_generate`` table of the same dialogues and ``history``
    params; its histories (the same rows) are reused instead of rebuilt.
    """
    own = [d for d in dialogues if d.candidates is not None and d.utterances]
    sampled = [d for d in dialogues if d.candidates is None]
    if own and sampled:  # not met in the corpora: a slow but simple merge
        both = [*_own_candidates(own, params, history, split, seed),
                *_sampled_candidates(sampled, params, history, split, seed)]  # fmt: skip
        return ExampleTable.from_examples(both, SelectExample)
    if own:
        return _own_candidates(own, params, history, split, seed)
    return _sampled_candidates(sampled, params, history, split, seed, generated)


def _sampled_candidates(
    dialogues: Sequence[EncodedDialogue],
    params: SelectParams,
    history: GenerateParams,
    split: str,
    seed: int,
    generated: ExampleTable | None = None,
) -> ExampleTable:
    train = split == TRAIN_SPLIT
    n = params.n_candidates_train if train else params.n_candidates_eval
    key = "select.n_candidates_train" if train else "select.n_candidates_eval"
    dialogue, turn = _response_pairs(dialogues)
    if not len(dialogue):
        return ExampleTable(SelectExample, {}, 0)
    flat = _FlatSplit(dialogues)
    utterance = flat.first[dialogue] + turn
    # The pool: every example's true response; a dialogue's examples are contiguous.
    pool = flat.wrapped(utterance, params.max_candidate)
    texts: dict[bytes, int] = {}
    text_of = np.array([texts.setdefault(pool[k].tobytes(), len(texts)) for k in range(len(pool))])
    if len(texts) < n:
        raise ConfigError(
            key, f"the {split} split has only {len(texts)} distinct responses, fewer than "
            f"{n} candidates; lower it or use more dialogues",
        )  # fmt: skip
    bounds = np.flatnonzero(np.diff(dialogue, prepend=-1, append=-2))
    block_first = np.repeat(bounds[:-1], np.diff(bounds))
    block_count = np.repeat(np.diff(bounds), np.diff(bounds))
    ids = [dialogues[i].id for i in dialogue.tolist()]
    state = np.array(
        [_example_seed(seed, d, t) for d, t in zip(ids, turn.tolist(), strict=True)],
        dtype=np.uint64,
    )
    negatives = _negatives(state, text_of, block_first, block_count, n - 1)
    if negatives is None:
        raise ConfigError(
            key, f"could not draw {n - 1} distinct negatives from other dialogues for every "
            f"example of the {split} split; lower it",
        )  # fmt: skip
    at = _below(_draws(state, np.zeros(1))[:, 0], n)  # draw 0 places the truth
    column = np.arange(n)[None, :]
    shifted = np.clip(column - (column > at[:, None]), 0, n - 2)
    refs = np.where(
        column == at[:, None],
        np.arange(len(pool))[:, None],
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
    per_row = np.arange(0, len(pool) * n + 1, n, dtype=np.int64)
    columns: dict[str, Column] = {
        "dialogue_id": ids,
        "turn": turn,
        **contexts,
        "candidate_ids": Nested(pool, per_row, refs.ravel()),
        "labels": Packed(labels.ravel(), per_row),
    }
    return ExampleTable(SelectExample, columns, len(pool))


def _negatives(
    state: np.ndarray, text_of: np.ndarray, first: np.ndarray, count: np.ndarray, k: int
) -> np.ndarray | None:
    """``[E, k]`` pool indices: for example e, the first ``k`` of its draws 1, 2, ... that
    fall outside its own dialogue's block ``[first, first + count)`` and whose text is new
    (not the truth's, not drawn before). None if some example cannot get ``k``."""
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
        j = _below(_draws(state[rows], counters), others[rows][:, None])
        j += np.where(j >= first[rows][:, None], count[rows][:, None], 0)
        text = text_of[j]
        order = np.argsort(text, axis=1, kind="stable")
        ranked = np.take_along_axis(text, order, axis=1)
        new_in_rank = np.ones_like(ranked, dtype=bool)
        new_in_rank[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
        new = np.empty_like(new_in_rank)
        np.put_along_axis(new, order, new_in_rank, axis=1)
        valid = new & (text != text_of[rows][:, None])  # example e's truth is pool row e
        rank = np.cumsum(valid, axis=1)
        done = rank[:, -1] >= k
        take = valid & (rank <= k) & done[:, None]
        out[rows[done]] = j[take].reshape(-1, k)
        todo = rows[~done]
        if not len(todo):
            return out
    return None


def _own_candidates(
    dialogues: Sequence[EncodedDialogue],
    params: SelectParams,
    history: GenerateParams,
    split: str,
    seed: int,
) -> ExampleTable:
    flat = _FlatSplit(dialogues)
    kept: list[list[int]] = []
    responders = []
    for i, d in enumerate(dialogues):
        # The responder is named by the corpus or, failing that, the participant who did
        # not speak last (DSTC7 dialogues alternate between two participants).
        last = d.speakers[-1]
        named = d.response_speaker or next((s for s in reversed(d.speakers) if s != last), None)
        responders.append(flat.code(i, named))
        marks = d.labels if d.labels is not None else np.zeros(len(d.candidates or ()), np.int8)
        keep = list(range(len(marks)))
        if split == TRAIN_SPLIT and len(keep) > params.n_candidates_train:
            state = _example_seed(seed, d.id, len(d.utterances))
            keep = _training_subset(marks, params.n_candidates_train, state)
        kept.append(keep)
    limit = params.max_candidate
    pool = Packed.from_arrays(
        [_wrap(d.candidates[j], limit) for d, keep in zip(dialogues, kept, strict=True)
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
    n_turns = np.array([len(d.utterances) for d in dialogues], dtype=np.int64)
    end = flat.first[:-1] + n_turns  # the turn after the last
    h = flat.histories(end, flat.first[:-1], np.array(responders, dtype=np.int64), history)
    per_row = _offsets(np.array([len(k) for k in kept], dtype=np.int64))
    labels = [
        (d.labels if d.labels is not None else np.zeros(len(keep), np.int8))[keep]
        for d, keep in zip(dialogues, kept, strict=True)
    ]
    columns: dict[str, Column] = {
        "dialogue_id": [d.id for d in dialogues],
        "turn": n_turns,
        **h.columns(),
        "candidate_ids": Nested(pool, per_row),
        "labels": Packed.from_arrays(labels, np.int8),
        "context_knowledge": h.knowledge,
        "candidate_knowledge": None if flags is None else Nested(flags, per_row),
    }
    return ExampleTable(SelectExample, columns, len(dialogues))


def _training_subset(labels: np.ndarray, n: int, state: int) -> list[int]:
    """Indices of every correct candidate plus drawn incorrect ones, ``n`` in all, in their
    original order (the paper trains on 1 positive + 9 negatives of the 100)."""
    correct = [int(i) for i in np.flatnonzero(labels)][:n]
    wrong = [int(i) for i in np.flatnonzero(labels == 0)]
    need = n - len(correct)
    raw = _draws(np.array([state], dtype=np.uint64), np.arange(1, need + 1))[0]
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


def _sentence(words: np.ndarray, limit: int) -> np.ndarray:
    """``w.. <eos>``, at most ``limit`` tokens."""
    out = np.empty(min(len(words), limit - 1) + 1, dtype=INT)
    out[:-1], out[-1] = words[: len(out) - 1], EOS_ID
    return out
