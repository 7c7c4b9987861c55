"""MultiWOZ dialogue acts: the act inventory (the act vector's dimensions), the text
serialisation of belief states and acts (HIER-Joint's targets), and delexicalisation of
responses with ``[domain_slot]`` placeholders."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.dialogue import Dialogue
from pipeline.data.records import _EMPTY, INT
from pipeline.errors import DataError

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
