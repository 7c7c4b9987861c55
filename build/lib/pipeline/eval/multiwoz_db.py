"""The MultiWOZ databases as the official evaluator queries them (``evaluate.py`` of
budzianowski/multiwoz): the venues of each DB domain in file order, constraints from a
belief state or a goal put through the official query's text normalisation
(:func:`official_value`); ``leaveAt`` means "leaves after", ``arriveBy`` "arrives
before", other slots equality, ``dontcare`` values ignored. Used by both scoring schemes
(``multiwoz``, ``multiwoz_standard``)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import DataError

DB_DOMAINS = ("restaurant", "hotel", "attraction", "train")
_DONT_CARE = frozenset({"", "dontcare", "dont care", "don't care", "do n't care", "not mentioned"})
_TIME_RE = re.compile(r"^(\d{1,2}):(\d{2})$")
_AFTER, _BEFORE = "leaveat", "arriveby"


_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "eleven", "twelve")  # fmt: skip
_NUMBER_WORDS = {word: str(i) for i, word in enumerate(_NUMBERS, 1)}


def official_value(value: str) -> str:
    """A belief or goal value as the official evaluator puts it into its SQL query: through
    its text ``normalize`` (``utils/nlp.py`` of budzianowski/multiwoz), whose steps that
    can touch a slot value are: lowercase; ``b&b``/``b and b`` -> ``bed and breakfast``;
    every ``h:mm`` time -> the literal ``[value_time]`` and ``12.50`` -> ``[value_price]``;
    ``;`` -> ``,``, ``/`` -> `` and ``, ``-`` -> space, ``":<>@()`` dropped; spaces around
    ``? . , !`` (not between digits) and before ``'s``, then quotes beside spaces dropped
    (``christ's college`` -> ``christ s college``); number words -> digits. So a time
    constraint compares the DB's times with the string ``[value_time]`` (``leaveAt >``
    matches no train, ``arriveBy <`` every train) and an apostrophe name matches nothing:
    the official numbers carry these effects, and so do ours."""
    text = value.lower().strip().replace("\u2018", "'").replace("\u2019", "'")
    text = re.sub(r"b&b|b and b", "bed and breakfast", text)
    text = re.sub(r"\d{1,2}:\d{1,2}", " [value_time] ", text)
    text = re.sub(r"\d{1,3}\.\d{1,2}", " [value_price] ", text)
    text = text.replace(";", ",").replace("/", " and ").replace("-", " ")
    text = re.sub(r'[":<>@()]', "", text)
    text = re.sub(r"(?<!\d)([?.,!])|([?.,!])(?!\d)", lambda m: f" {m.group(0)} ", text)
    text = re.sub(r"(?<! )'s", " 's", text)
    text = re.sub(r"^'|'$", "", text)
    text = re.sub(r"' | '", " ", text)
    words = [_NUMBER_WORDS.get(w, w) for w in text.split()]
    return " ".join(words)


def _norm(value: object) -> str:
    text = " ".join(str(value).lower().split())
    time = _TIME_RE.match(text)
    return f"{int(time.group(1)):02d}:{time.group(2)}" if time else text


class MultiWozDB:
    """The venues of the DB domains, in file order, queried like the official SQL."""

    def __init__(self, entities: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        missing = [d for d in DB_DOMAINS if d not in entities]
        if missing:
            raise ValueError(f"MultiWozDB: no entities for {missing}")
        self.entities = {d: tuple(entities[d]) for d in DB_DOMAINS}
        # normalised attribute values, keys lower-cased ("leaveAt" -> "leaveat")
        self._rows = {
            d: tuple(
                {k.lower(): _norm(v) for k, v in e.items() if not isinstance(v, dict | list)}
                for e in rows
            )
            for d, rows in self.entities.items()
        }
        self._index: dict[str, dict[tuple[str, str], set[int]]] = {}
        for domain, rows in self._rows.items():
            index = self._index[domain] = {}
            for i, row in enumerate(rows):
                for item in row.items():
                    index.setdefault(item, set()).add(i)
        self._cache: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, ...]] = {}

    @classmethod
    def load(cls, path: str | Path) -> MultiWozDB:
        """Read ``<domain>_db.json`` from ``path`` (the release's ``db/`` folder, or a folder
        holding ``db/``)."""
        folder = Path(path)
        if (folder / "db").is_dir():
            folder = folder / "db"
        entities: dict[str, list[dict[str, Any]]] = {}
        for domain in DB_DOMAINS:
            file = folder / f"{domain}_db.json"
            if not file.is_file():
                raise DataError(
                    file, "MultiWOZ database file missing; run the download stage (db/ folder)"
                )
            try:
                rows = json.loads(file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as err:
                raise DataError(file, f"invalid JSON: {err.msg}", err.lineno) from None
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise DataError(file, "expected a JSON list of entity objects")
            entities[domain] = rows
        return cls(entities)

    def query(self, domain: str, constraints: Mapping[str, str]) -> list[int]:
        """Indices (DB order) of the ``domain`` entities meeting ``constraints``.

        ``leaveAt`` keeps entities leaving after the value, ``arriveBy`` those arriving
        before it (string comparison of ``HH:MM``), other slots must be equal; don't-care
        values are ignored. A slot the domain's entities lack matches nothing (the official
        SQL query fails and returns no venue).
        """
        if domain not in self._rows:
            raise ValueError(f"query: {domain!r} has no database (one of {DB_DOMAINS})")
        tests = tuple(
            sorted(
                (slot.lower(), _norm(value))
                for slot, value in constraints.items()
                if _norm(value) not in _DONT_CARE
            )
        )
        key = (domain, tests)
        if key not in self._cache:  # belief states repeat from turn to turn
            self._cache[key] = self._select(domain, tests)
        return list(self._cache[key])

    def _select(self, domain: str, tests: Sequence[tuple[str, str]]) -> tuple[int, ...]:
        rows = self._rows[domain]
        # equality tests first, through the per-attribute index; ranges on the survivors
        found: set[int] | None = None
        for slot, value in tests:
            if slot not in (_AFTER, _BEFORE):
                hits = self._index[domain].get((slot, value), set())
                found = hits if found is None else found & hits
        candidates = range(len(rows)) if found is None else sorted(found)
        ranges = [(slot, value) for slot, value in tests if slot in (_AFTER, _BEFORE)]
        return tuple(i for i in candidates if _in_range(rows[i], ranges))


def _in_range(row: Mapping[str, str], ranges: Sequence[tuple[str, str]]) -> bool:
    for slot, value in ranges:
        have = row.get(slot)
        if have is None or not (have > value if slot == _AFTER else have < value):
            return False
    return True
