"""MultiWOZ Inform and Success in the standardized scheme (Nekvinda & Dusek 2021).

The scheme of "Shades of BLEU, Flavours of Success: The Case of MultiWOZ" (GEM 2021; github
Tomiinek/MultiWOZ_Evaluation, ``mwzeval/metrics.py``), whose numbers fill the table of the
budzianowski/multiwoz README. It reads every delexicalisation style published systems use
(``multiwoz_norm``), and for one dialogue, given a prediction per system turn (``response``;
optionally the predicted ``state`` and ``active_domains``):

- **States and domains**: a turn without a predicted ``state`` uses the ground-truth one
  (the file's states are used only when every turn has one); a turn without
  ``active_domains`` gets the domain estimated from the state's changes
  (:func:`estimate_domains`).
- **Goal**: every domain with a non-empty goal; informable = the goal's ``info`` (slot names
  as database columns); requested = its ``reqt`` among phone, address, postcode,
  reference, trainID, plus reference when the goal books.
- **Offered venues**: a turn whose response has ``NAME`` (restaurant, hotel, attraction) or
  ``TRAINID`` (train) and whose active domains include the domain queries the database with
  that turn's state of the domain; the whole result replaces the offered set when the
  previous set is empty or not contained in it (the last mention counts).
- **Inform**: per goal domain, automatic for taxi, police and hospital, for a goal naming
  its venue, and for a train when none was offered and no train id is requested; otherwise
  the offered set must be non-empty and contained in the venues meeting the goal. A
  dialogue informs when every goal domain does.
- **Success**: Inform, and every requested slot of every goal domain provided in an active
  turn of that domain; a ``REFERENCE`` counts only in a turn where the domain's booking has
  been made (``Turn.booked``).
- **Database**: the release's ``db/``, columns as slot names, a few columns ignored; names
  and foods (and train stations) match fuzzily (``partial_ratio`` >= 90), ``arrive`` keeps
  trains arriving at or before, ``leave`` those leaving at or after, the rest exactly.

Rates are percentages of dialogues, per goal domain and in total, rounded to 0.1 as the
published table. Our ground truth is the data given (MultiWOZ 2.1's belief states and
goals); the published numbers use MultiWOZ 2.2's states for systems that predict none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from functools import lru_cache
from typing import Any

from pipeline.data.dialogue import Dialogue
from pipeline.eval import multiwoz_norm as norm
from pipeline.eval.multiwoz import system_turns
from pipeline.eval.multiwoz_db import DB_DOMAINS, MultiWozDB

NO_VENUE_DOMAINS = ("taxi", "police", "hospital")
REQUESTABLE = {"phone": "PHONE", "address": "ADDRESS", "postcode": "POST",
               "reference": "REFERENCE", "trainID": "TRAINID"}  # fmt: skip
_IGNORED_COLUMNS = {
    "attraction": ("location", "openhours"),
    "hotel": ("location", "price", "takesbookings"),
    "restaurant": ("location", "introduction", "signature"),
}
_FUZZY_COLUMNS = {
    "hotel": ("name",),
    "attraction": ("name",),
    "restaurant": ("name", "food"),
    "train": ("departure", "destination"),
}
FUZZY_THRESHOLD = 90
_DONT_CARE = frozenset({"dontcare", "not mentioned", "don't care", "dont care",
                        "do n't care", "do not care"})  # fmt: skip
# MultiWOZ 2.1's annotators wrote "none" for a slot without a value (2.2 leaves it out)
_NO_VALUE = _DONT_CARE | {"none"}


# --------------------------------------------------------------------------- fuzzy match


def _lcs_ratio(a: str, b: str) -> float:
    """``2 * LCS / (len(a) + len(b))``: the indel similarity of Levenshtein's ``ratio``."""
    if not a and not b:
        return 1.0
    row = [0] * (len(b) + 1)
    for ca in a:
        diagonal = 0
        for j, cb in enumerate(b, 1):
            diagonal, row[j] = row[j], diagonal + 1 if ca == cb else max(row[j], row[j - 1])
    return 2.0 * row[-1] / (len(a) + len(b))


@lru_cache(maxsize=65536)
def partial_ratio(a: str, b: str) -> int:
    """The best similarity (0-100) of the shorter string with a window of the longer one,
    the windows aligned on the strings' matching blocks: fuzzywuzzy's ``partial_ratio``
    (with python-Levenshtein), which the standardized evaluator uses. 0 if one is empty."""
    if not a or not b:
        return 0
    short, long = (a, b) if len(a) <= len(b) else (b, a)
    best = 0.0
    for block in SequenceMatcher(None, short, long, autojunk=False).get_matching_blocks():
        start = max(block.b - block.a, 0)
        score = _lcs_ratio(short, long[start : start + len(short)])
        if score > 0.995:
            return 100
        best = max(best, score)
    return round(100 * best)


# --------------------------------------------------------------------------- database


class VenueDatabase:
    """The restaurant, hotel, attraction and train entities, queried the standardized way
    (module docstring). Built from the release's DB (:class:`multiwoz_db.MultiWozDB`)."""

    def __init__(self, db: MultiWozDB) -> None:
        self.rows: dict[str, list[dict[str, str]]] = {}
        for domain in DB_DOMAINS:
            ignored = _IGNORED_COLUMNS.get(domain, ())
            self.rows[domain] = [
                {
                    norm.slot_name(key): _db_value(key, value)
                    for key, value in entity.items()
                    if key not in ignored and not isinstance(value, dict | list)
                }
                for entity in db.entities[domain]
            ]
        self.columns = {d: tuple(rows[0]) for d, rows in self.rows.items() if rows}
        self._cache: dict[tuple[str, tuple[tuple[str, Any], ...]], tuple[str, ...]] = {}

    def query(self, domain: str, constraints: Mapping[str, str]) -> tuple[str, ...]:
        """Ids (train ids for trains) of the ``domain`` venues meeting ``constraints``;
        none for a domain without a database."""
        if domain not in self.columns:
            return ()
        wanted: list[tuple[str, Any]] = []
        for column in self.columns[domain]:
            value = constraints.get(column)
            if value is None or value in _DONT_CARE:
                continue
            value = norm.slot_value(column, value)
            wanted.append((column, norm.minutes(value) if column in ("arrive", "leave") else value))
        key = (domain, tuple(wanted))
        if key not in self._cache:
            fuzzy = _FUZZY_COLUMNS.get(domain, ())
            self._cache[key] = tuple(
                row["trainid" if domain == "train" else "id"]
                for row in self.rows[domain]
                if all(_meets(row[c], c, v, c in fuzzy) for c, v in wanted)
            )
        return self._cache[key]


def _db_value(key: str, value: object) -> str:
    text = str(value)
    return norm.slot_value("type", text) if key == "type" else text


def _meets(have: str, column: str, wanted: Any, fuzzy: bool) -> bool:
    if have == "?":  # unknown in the DB: no constraint can rule the venue out
        return True
    if column == "arrive":
        return norm.minutes(have) <= wanted
    if column == "leave":
        return norm.minutes(have) >= wanted
    if fuzzy:
        return partial_ratio(have, wanted) >= FUZZY_THRESHOLD
    return have == wanted


# --------------------------------------------------------------------------- dialogues


@dataclass
class Prediction:
    """One system turn of a predictions file: the response and what it may carry."""

    response: str
    state: dict[str, dict[str, str]] | None = None
    active_domains: list[str] | None = None


@dataclass(frozen=True)
class Goal:
    """One goal domain: informable constraints (database columns) and requested slots."""

    informable: dict[str, str]
    requestable: frozenset[str]


def parse_goal(goal: Mapping[str, Any]) -> dict[str, Goal]:
    """The goal domains of a MultiWOZ ``goal`` object (module docstring)."""
    out: dict[str, Goal] = {}
    for domain, spec in goal.items():
        if not isinstance(spec, Mapping) or not spec or domain in ("topic", "message"):
            continue
        requested = {REQUESTABLE[r] for r in spec.get("reqt") or () if r in REQUESTABLE}
        if spec.get("book"):
            requested.add("REFERENCE")
        info = {norm.slot_name(k): str(v) for k, v in (spec.get("info") or {}).items()}
        out[domain] = Goal(info, frozenset(requested))
    return out


def gold_states(dialogue: Dialogue) -> list[dict[str, dict[str, str]]]:
    """The ground-truth state of each system turn as ``{domain: {slot: value}}``: the
    belief's informable and booking slots (``book day`` -> ``bookday``), don't-care and
    ``none`` values left out, domains without a value left out: as MultiWOZ 2.2's states,
    which the standardized evaluator uses."""
    states = []
    for index in system_turns(dialogue):
        state: dict[str, dict[str, str]] = {}
        for key, value in (dialogue.turns[index].belief or {}).items():
            domain, _, slot = key.partition("-")
            if value.lower() not in _NO_VALUE:
                state.setdefault(domain, {})[slot] = value
        states.append(state)
    return states


def estimate_domains(states: Sequence[Mapping[str, Mapping[str, str]]]) -> list[list[str]]:
    """The active domain of each turn from a dialogue's states: the domain whose state just
    changed (the one with most slots when several did, unless the current one is among
    them); when none changed, the current one stays, or, when the last change touched
    several domains, another of those still in the state takes over. Empty before any
    state."""
    active: list[list[str]] = []
    current: str | None = None
    previous: Mapping[str, Mapping[str, str]] = {}
    last_changed: list[str] = []
    for state in states:
        changed = [d for d in state if set(state[d].items()) - set(previous.get(d, {}).items())]
        if not changed:
            if current is None:
                active.append([])
                continue
            if len(last_changed) > 1:
                last_changed = [d for d in last_changed if d in state and d != current]
                if last_changed:
                    current = last_changed[0]
        elif current not in changed:
            current = max(changed, key=lambda d: len(state[d]))
        previous, last_changed = state, changed
        active.append([current] if current is not None else [])
    return active


@dataclass
class DialogueResult:
    """Per goal domain of one dialogue: informed, and (when it informs) succeeded."""

    inform: dict[str, bool]
    success: dict[str, bool] = field(default_factory=dict)

    @property
    def informs(self) -> bool:
        return all(self.inform.values())

    @property
    def succeeds(self) -> bool:
        return self.informs and all(self.success.values())


def score_dialogue(
    goal: Mapping[str, Goal],
    responses: Sequence[str],
    states: Sequence[Mapping[str, Mapping[str, str]]],
    domains: Sequence[Sequence[str]],
    booked: Sequence[frozenset[str]],
    db: VenueDatabase,
) -> DialogueResult:
    """Inform and Success of one dialogue from its normalised responses (module docstring)."""
    offered: dict[str, tuple[str, ...]] = {d: () for d in goal}
    provided: dict[str, set[str]] = {d: set() for d in goal}
    for response, state, active, booked_now in zip(responses, states, domains, booked, strict=True):
        for domain in goal:
            if domain not in active:
                continue
            names_venue = "NAME" in response and domain in ("restaurant", "hotel", "attraction")
            if names_venue or ("TRAINID" in response and domain == "train"):
                venues = db.query(domain, state[domain]) if domain in state else ()
                if not offered[domain] or any(v not in venues for v in offered[domain]):
                    offered[domain] = venues
            for slot in REQUESTABLE.values():
                if slot in response and (slot != "REFERENCE" or domain in booked_now):
                    provided[domain].add(slot)
    inform: dict[str, bool] = {}
    for domain, spec in goal.items():
        automatic = (
            "name" in spec.informable
            or domain in NO_VENUE_DOMAINS
            or (domain == "train" and not offered[domain] and "TRAINID" not in spec.requestable)
        )
        inform[domain] = automatic or (
            domain in DB_DOMAINS
            and bool(offered[domain])
            and set(offered[domain]) <= set(db.query(domain, spec.informable))
        )
    result = DialogueResult(inform)
    if result.informs:
        result.success = {d: goal[d].requestable <= provided[d] for d in goal}
    return result


@dataclass(frozen=True)
class StandardizedRates:
    """Inform and Success (0-100, one decimal) in total and per goal domain, over
    ``dialogues`` dialogues; ``unknown_placeholders`` counts what no rule could read;
    ``turn_count_mismatches`` lists the dialogues whose predicted turns were not one per
    system turn of the data (scored over the turns both have, as the evaluator does)."""

    inform: float
    success: float
    inform_by_domain: dict[str, float]
    success_by_domain: dict[str, float]
    dialogues: int
    unknown_placeholders: dict[str, int]
    turn_count_mismatches: list[str]


def standardized_rates(
    dialogues: Mapping[str, Dialogue],
    predictions: Mapping[str, Sequence[Prediction]],
    db: MultiWozDB,
) -> StandardizedRates:
    """Score ``predictions`` (dialogue id -> one prediction per system turn) against the
    ``dialogues`` they answer (same ids). Raises ``ValueError`` naming a predicted
    dialogue the data lacks."""
    venues = VenueDatabase(db)
    normalizer = norm.ResponseNormalizer()
    with_states = all(p.state is not None for turns in predictions.values() for p in turns)
    with_domains = all(p.active_domains is not None for t in predictions.values() for p in t)
    mismatched: list[str] = []
    totals: Counter[str] = Counter()
    informed: Counter[str] = Counter()
    succeeded: Counter[str] = Counter()
    for did, turns in predictions.items():
        if did not in dialogues:
            raise ValueError(f"prediction for dialogue {did!r}, which the data does not hold")
        dialogue = dialogues[did]
        gold = gold_states(dialogue)
        booked = [dialogue.turns[i].booked for i in system_turns(dialogue)]
        if len(turns) != len(gold):
            # as the evaluator: the turns both have (a few 2.1 dialogues differ from 2.2's)
            mismatched.append(did)
            n = min(len(turns), len(gold))
            turns, gold, booked = turns[:n], gold[:n], booked[:n]
        raw_states = [p.state for p in turns] if with_states else gold
        states = [norm.state(s or {}) for s in raw_states]
        if with_domains:
            domains = [p.active_domains or [] for p in turns]
        else:  # a turn whose placeholders name their domain says it; the others estimate it
            estimates = estimate_domains(states)
            domains = [
                norm.placeholder_domains(p.response) or e
                for p, e in zip(turns, estimates, strict=True)
            ]
        result = score_dialogue(
            parse_goal(dialogue.meta.get("goal") or {}),
            [normalizer(p.response) for p in turns],
            states,
            domains,
            booked,
            venues,
        )
        inform = dict(result.inform, total=result.informs)
        success = dict(result.success, total=result.succeeds)
        for domain in inform:
            totals[domain] += 1
            informed[domain] += inform[domain]
            succeeded[domain] += success.get(domain, False)
    if not totals:
        raise ValueError("no predictions to score")

    def rate(hits: Counter[str], domain: str) -> float:
        return round(100.0 * hits[domain] / totals[domain], 1)

    per_domain = sorted(d for d in totals if d != "total")
    return StandardizedRates(
        inform=rate(informed, "total"),
        success=rate(succeeded, "total"),
        inform_by_domain={d: rate(informed, d) for d in per_domain},
        success_by_domain={d: rate(succeeded, d) for d in per_domain},
        dialogues=totals["total"],
        unknown_placeholders=dict(normalizer.unknown),
        turn_count_mismatches=mismatched,
    )
