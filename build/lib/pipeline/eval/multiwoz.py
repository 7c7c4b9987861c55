"""MultiWOZ context-to-response metrics: Inform, Success, Entity-F1, Combined (HIER paper).

Inform and Success follow the official evaluator (``evaluate.py`` of budzianowski/multiwoz,
``MultiWozEvaluator._evaluateGeneratedDialogue``), reading the entities from the release's
``db/*_db.json`` files, the user goal from ``Dialogue.meta["goal"]`` and the ground-truth
belief state from the system turns (``Turn.belief``). For one dialogue, given one generated
delexicalised response per system turn:

- Goal: every domain of restaurant, hotel, attraction, train, taxi, police, hospital whose
  goal is non-empty. Its requested slots are the goal's ``reqt`` among phone, address,
  postcode, reference, id, plus ``reference`` when the goal books something; for trains only
  ``id`` (if ``trainID`` is requested) and ``reference`` (if booked).
- Offered venue: when a response mentions ``[<domain>_name]``, or any ``_id`` (the official
  test: a ``[train_id]`` offers a venue of EVERY goal domain), the DB is queried with that
  turn's ground-truth belief state of the domain (informable slots only; ``leaveAt`` means
  "leaves after", ``arriveBy`` "arrives before", other slots equality; ``dontcare`` values
  ignored). The offered venue becomes the FIRST match in DB order unless the previously
  offered venue still matches; no match leaves the offer unchanged.
- Inform (per dialogue): every goal domain is informed. A restaurant/hotel/attraction/
  train domain is informed if its offered venue is among the DB entities satisfying the
  goal's ``info`` constraints, or automatically if the goal names the venue, or (trains)
  if nothing was offered and no train id was requested. Taxi, police and hospital always
  count as informed.
- Success (per dialogue): Inform, and for every goal domain every requested slot has its
  placeholder (``<domain>_<slot>]``) in some response of the dialogue. A reference counts
  only where the official DB pointer allowed it: the first of ``restaurant_reference``,
  ``hotel_reference``, ``train_reference`` in the response names the domain whose booking
  must have been made at that turn (``Turn.booked``, the metadata the pointer was built
  from) and be in the goal.

Corpus Inform/Success are percentages of dialogues; Combined = BLEU + 0.5 (Inform +
Success), all on a 0-100 scale. This is the scheme the HT-Encoder paper reports; the
field's current table uses the standardized scheme (``multiwoz_standard``), which reads
more delexicalisation styles and the predicted states. ``python -m pipeline score
multiwoz`` gives both.

Placeholders are read by the official substring tests after renaming the act-based ones of
``pipeline.data.acts.delexicalize`` (``[hotel_addr]``, ``[hotel_post]``, ``[train_ref]``)
to the official names (``official_placeholders``); ``[booking_*]`` (the act-based scheme has
no domain on booking acts) becomes the placeholder of the goal domain(s) whose booking slots
in the belief state changed most recently at or before that turn. The official evaluator's
other styles (``[value_name]``) are not read: that is what the standardized scheme is for.

Belief and goal values go through the official query's text normalisation
(:func:`official_value`), with its effects on time constraints and apostrophe names. The
one deviation from the official evaluator: where several venues match, the offered one is
the first in DB order (deterministic) instead of ``random.sample``.

Entity-F1 (Wen et al. 2017, as reported by HIER) is micro-averaged over responses: for each
generated/reference pair the SETS of placeholders are compared, and true positives, false
positives and false negatives are summed over the corpus before precision, recall and F1.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.data.dialogue import Dialogue
from pipeline.data.vocab import is_placeholder, word_tokenize
from pipeline.eval.multiwoz_db import DB_DOMAINS, MultiWozDB, official_value
from pipeline.eval.text import corpus_bleu

GOAL_DOMAINS = ("restaurant", "hotel", "attraction", "train", "taxi", "police", "hospital")
REQUESTABLES = ("phone", "address", "postcode", "reference", "id")
BOOKING = "booking"
SYSTEM = "system"

# The act-based scheme's slot names that differ from the official placeholders'.
_OFFICIAL_SLOT = {"addr": "address", "post": "postcode", "ref": "reference", "trainid": "id"}
# The domains whose references the official evaluator checks against its booking pointer.
_POINTER_DOMAINS = ("restaurant", "hotel", "train")
# --------------------------------------------------------------------------- goals


@dataclass(frozen=True)
class DomainGoal:
    """One domain of a user goal: informable constraints, requested slots, booking."""

    domain: str
    informable: dict[str, str]
    requestable: frozenset[str]
    books: bool

    @property
    def names_venue(self) -> bool:
        """The goal gives the venue's name, so whatever is offered matches (official rule)."""
        return "name" in self.informable


def parse_goal(goal: Mapping[str, Any]) -> dict[str, DomainGoal]:
    """The goal domains of a MultiWOZ ``goal`` object, as the official ``_parseGoal``."""
    domains: dict[str, DomainGoal] = {}
    for domain in GOAL_DOMAINS:
        spec = goal.get(domain)
        if not spec:
            continue
        if not isinstance(spec, Mapping):
            raise ValueError(f"goal[{domain!r}]: expected an object, got {type(spec).__name__}")
        info = spec.get("info")
        requested: set[str] = set()
        books = bool(spec.get("book"))
        if info is not None:
            reqt = spec.get("reqt") or []
            if domain == "train":
                if "trainID" in reqt:
                    requested.add("id")
            else:
                requested.update(r for r in reqt if r in REQUESTABLES)
            if books:
                requested.add("reference")
        informable = {str(k): str(v) for k, v in (info or {}).items()}
        domains[domain] = DomainGoal(domain, informable, frozenset(requested), books)
    return domains


# --------------------------------------------------------------------------- responses


def placeholders(text: str) -> list[str]:
    """The ``[domain_slot]`` placeholders of ``text``, in order (``[hotel_name]``)."""
    return [w for w in word_tokenize(text) if is_placeholder(w)]


def _domain_beliefs(belief: Mapping[str, str] | None) -> dict[str, dict[str, dict[str, str]]]:
    """``{"hotel-area": "x", "hotel-book day": "y"}`` -> ``{hotel: {semi: {..}, book: {..}}}``."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for key, value in (belief or {}).items():
        domain, _, slot = key.partition("-")
        part = "book" if slot.startswith("book ") else "semi"
        slot = slot.removeprefix("book ")
        out.setdefault(domain, {"semi": {}, "book": {}})[part][slot] = value
    return out


def _booking_domains(beliefs: Sequence[dict[str, dict[str, dict[str, str]]]]) -> list[set[str]]:
    """Per system turn, the domains whose booking slots changed most recently (at or before)."""
    active: list[set[str]] = []
    current: set[str] = set()
    previous: dict[str, dict[str, dict[str, str]]] = {}
    for state in beliefs:
        changed = {
            d
            for d in set(state) | set(previous)
            if state.get(d, {}).get("book", {}) != previous.get(d, {}).get("book", {})
            and state.get(d, {}).get("book")
        }
        if changed:
            current = changed
        active.append(set(current))
        previous = state
    return active


_PLACEHOLDER_RE = re.compile(r"\[([a-z]+)_(\w+)\]")


def official_placeholders(response: str, booking: set[str]) -> str:
    """``response`` with the act-based placeholders of ``pipeline.data.acts.delexicalize``
    renamed to the official ones (``[hotel_addr]`` -> ``[hotel_address]``, ``post`` ->
    ``postcode``, ``ref`` -> ``reference``; ``[booking_x]`` -> ``[<d>_x]`` for each active
    booking domain ``d``); official placeholders pass unchanged."""

    def rename(match: re.Match[str]) -> str:
        domain, slot = match.group(1), _OFFICIAL_SLOT.get(match.group(2), match.group(2))
        if domain == BOOKING:
            return " ".join(f"[{d}_{slot}]" for d in sorted(booking)) or match.group(0)
        return f"[{domain}_{slot}]"

    return _PLACEHOLDER_RE.sub(rename, response)


def official_responses(dialogue: Dialogue, responses: Sequence[str]) -> list[str]:
    """The responses to ``dialogue``'s system turns with official placeholder names
    (:func:`official_placeholders`, each turn's active booking domains from the belief)."""
    turns = [dialogue.turns[i] for i in system_turns(dialogue)]
    booking = _booking_domains([_domain_beliefs(t.belief) for t in turns])
    return [official_placeholders(r, b) for r, b in zip(responses, booking, strict=False)]


@dataclass(frozen=True)
class DomainOutcome:
    """What one goal domain got: its offered venue (DB index or None), informed, slots."""

    domain: str
    offered: int | None
    informed: bool
    requested: frozenset[str]
    provided: frozenset[str]

    @property
    def succeeded(self) -> bool:
        return self.informed and self.requested <= self.provided


@dataclass(frozen=True)
class DialogueOutcome:
    """Inform and Success of one dialogue, with the per-domain detail."""

    dialogue_id: str
    inform: bool
    success: bool
    domains: tuple[DomainOutcome, ...]


def system_turns(dialogue: Dialogue) -> list[int]:
    """Indices of the system turns of ``dialogue`` (those the model responds in)."""
    return [i for i, t in enumerate(dialogue.turns) if t.speaker == SYSTEM]


def _informed(goal: DomainGoal, venue: int | None, db: MultiWozDB) -> bool:
    """Whether a domain's offered ``venue`` meets its goal (official rules, module docstring)."""
    if goal.domain not in DB_DOMAINS or goal.names_venue:
        return True
    if goal.domain == "train" and venue is None:
        # nothing to check when the user needs no particular train (no id requested)
        return "id" not in goal.requestable
    wanted = {slot: official_value(v) for slot, v in goal.informable.items()}
    return venue is not None and venue in db.query(goal.domain, wanted)


def evaluate_dialogue(
    dialogue: Dialogue, responses: Sequence[str], db: MultiWozDB
) -> DialogueOutcome:
    """Inform and Success of the generated ``responses`` (one per system turn, in order;
    fewer are scored over the first turns, as the official loop over generated turns)."""
    turns = [dialogue.turns[i] for i in system_turns(dialogue)]
    if isinstance(responses, str) or len(responses) > len(turns):
        got = "one string" if isinstance(responses, str) else f"{len(responses)} responses"
        raise ValueError(
            f"dialogue {dialogue.id!r}: {got} for {len(turns)} system turns; "
            "give one generated response per system turn"
        )
    goal = parse_goal(dialogue.meta.get("goal") or {})
    beliefs = [_domain_beliefs(t.belief) for t in turns]
    offered: dict[str, int | None] = dict.fromkeys(goal)
    provided: dict[str, set[str]] = {d: set() for d in goal}
    for t, sent in enumerate(official_responses(dialogue, responses)):
        # the official booking pointer: the first of these references the response has
        pointer = next((d for d in _POINTER_DOMAINS if f"{d}_reference" in sent), None)
        for domain in goal:
            # official: a name of the domain, or ANY "_id", offers a venue of every domain
            if (f"[{domain}_name]" in sent or "_id" in sent) and domain in DB_DOMAINS:
                semi = beliefs[t].get(domain, {}).get("semi", {})
                venues = db.query(domain, {k: official_value(v) for k, v in semi.items()})
                if venues and offered[domain] not in venues:
                    offered[domain] = venues[0]
            for requestable in REQUESTABLES:
                if requestable != "reference":
                    if f"{domain}_{requestable}]" in sent:
                        provided[domain].add(requestable)
                elif f"{domain}_reference" in sent and (
                    pointer is None or (pointer in goal and pointer in turns[t].booked)
                ):
                    provided[domain].add(requestable)
    outcomes = tuple(
        DomainOutcome(
            domain,
            offered[domain],
            _informed(spec, offered[domain], db),
            spec.requestable,
            frozenset(provided[domain]),
        )
        for domain, spec in goal.items()
    )
    inform = all(o.informed for o in outcomes)
    success = inform and all(o.succeeded for o in outcomes)
    return DialogueOutcome(dialogue.id, inform, success, tuple(outcomes))


@dataclass(frozen=True)
class InformSuccess:
    """Corpus Inform and Success rates (percent of dialogues) and each dialogue's outcome."""

    inform: float
    success: float
    outcomes: tuple[DialogueOutcome, ...]


def inform_success(
    dialogues: Sequence[Dialogue], responses: Mapping[str, Sequence[str]], db: MultiWozDB
) -> InformSuccess:
    """Inform and Success rates over the dialogues that have responses.

    ``responses`` maps a dialogue id to its generated responses (one per system turn). Every
    id must name one of ``dialogues``; dialogues without responses are not scored.
    """
    by_id = {d.id: d for d in dialogues}
    unknown = sorted(set(responses) - set(by_id))
    if unknown:
        raise ValueError(f"responses for unknown dialogues {unknown[:5]} ({len(unknown)} in all)")
    if not responses:
        raise ValueError("inform_success: no responses to score")
    outcomes = tuple(evaluate_dialogue(by_id[i], responses[i], db) for i in responses)
    n = len(outcomes)
    return InformSuccess(
        inform=100.0 * sum(o.inform for o in outcomes) / n,
        success=100.0 * sum(o.success for o in outcomes) / n,
        outcomes=outcomes,
    )


# --------------------------------------------------------------------------- entity F1


@dataclass(frozen=True)
class EntityF1:
    """Micro-averaged placeholder precision, recall and F1 (fractions in [0, 1])."""

    precision: float
    recall: float
    f1: float


def entity_f1(hyps: Sequence[str], refs: Sequence[str] | None) -> EntityF1:
    """Entity-F1 of generated vs reference responses (module docstring); 0 where undefined.

    ``refs`` may only be None to fit ``stats.paired_bootstrap``; it is required.
    """
    if refs is None:
        raise ValueError("entity_f1: references are required")
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    tp = fp = fn = 0
    for hyp, ref in zip(hyps, refs, strict=True):
        h, r = set(placeholders(hyp)), set(placeholders(ref))
        tp += len(h & r)
        fp += len(h - r)
        fn += len(r - h)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return EntityF1(precision, recall, f1)


def combined_score(bleu: float, inform: float, success: float) -> float:
    """HIER's overall score: ``BLEU + 0.5 * (Inform + Success)``, all on a 0-100 scale."""
    return bleu + 0.5 * (inform + success)


@dataclass(frozen=True)
class MultiWozScores:
    """The HIER paper's columns, all 0-100: BLEU, Entity-F1, Inform, Success, Combined."""

    bleu: float
    entity_f1: float
    inform: float
    success: float
    combined: float


def multiwoz_scores(
    dialogues: Sequence[Dialogue],
    responses: Mapping[str, Sequence[str]],
    references: Mapping[str, Sequence[str]],
    db: MultiWozDB,
    tokenize: str = "none",
) -> MultiWozScores:
    """Every MultiWOZ metric of generated ``responses`` against delexicalised ``references``.

    Both map dialogue ids to one text per system turn. BLEU is sacrebleu corpus BLEU over
    all turns (``tokenize="none"``: the texts are already tokenised, placeholders whole).
    """
    if set(references) != set(responses):
        raise ValueError("responses and references must cover the same dialogue ids")
    hyps: list[str] = []
    refs: list[str] = []
    for did, generated in responses.items():
        if len(references[did]) != len(generated):
            raise ValueError(
                f"dialogue {did!r}: {len(generated)} responses, {len(references[did])} references"
            )
        hyps.extend(generated)
        refs.extend(references[did])
    rates = inform_success(dialogues, responses, db)
    bleu = corpus_bleu(hyps, refs, tokenize=tokenize)
    return MultiWozScores(
        bleu=bleu,
        entity_f1=100.0 * entity_f1(hyps, refs).f1,
        inform=rates.inform,
        success=rates.success,
        combined=combined_score(bleu, rates.inform, rates.success),
    )
