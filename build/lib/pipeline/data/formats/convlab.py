"""ConvLab-3's unified data format: a JSON list of dialogues, usually inside ``data.zip``.

ConvLab-3 (``data/unified_datasets/README.md``) ships each dataset as ``data.zip`` holding
``data/dialogues.json`` (plus ``ontology.json`` and databases, not read here). Accepted:

* a zip with exactly one member named ``dialogues.json`` at any depth or, failing that,
  exactly one named ``data.json`` (``__MACOSX`` and hidden members ignored);
* a plain ``dialogues.json``/``data.json`` file (UTF-8, byte-order mark allowed).

Each dialogue::

    {"dataset", "data_split": "train"|"validation"|"test", "dialogue_id", "original_id"?,
     "domains"?, "goal"?, "turns": [{"speaker": "user"|"system", "utterance", "utt_idx",
     "dialogue_acts"?: {"categorical": [...], "non-categorical": [...], "binary": [...]},
     "state"? (user turns), "db_results"? (system turns), ...}]}

Other keys (``utt_idx``, ``db_results``, ``booked``, ``emotion`` ...) are allowed and not read.

What comes out:

* ``Dialogue.id`` = ``dialogue_id`` (a non-empty string, or an integer as its decimal
  string); a duplicate is an error. ``meta["split"]`` = ``train``/``valid``/``test``
  (``validation`` -> ``valid``); ``meta["goal"]``, ``meta["domains"]``, ``meta["dataset"]``,
  ``meta["original_id"]`` where present.
* ``Turn.speaker`` = ``user``/``system``; ``Turn.text`` = the stripped utterance. Every turn
  is kept, an empty one too (counted in ``ParseStats.empty_texts``), so acts and states stay
  on their turns. A dialogue with no turns is not yielded and counts once in
  ``empty_texts``.
* ``Turn.acts`` in MultiWOZ's form, ``{"Hotel-Inform": [["area", "east"]]}``: the act name
  is ``<Domain>-<Intent>`` with the first letters capitalised (MultiWOZ's ``NoBook``,
  ``NoOffer``, ``OfferBook``, ``OfferBooked`` spelled so), an empty domain is ``General``,
  a ``-`` inside a domain becomes ``_`` (the act name splits at its first ``-``). Slots and
  values are kept as written, stripped. An empty slot or an empty or null value is ``none``
  (the slot ``none`` is no slot for ``ActInventory``); a binary act's value is ``?`` for a
  ``request`` of a slot, else ``none``, as MultiWOZ writes them. A ``dialogue_acts`` key
  other than the three types is an error; ``Turn.acts`` is None where the turn has no
  ``dialogue_acts``.
* ``Turn.belief`` on a system turn = the ``state`` of the user turn just before it,
  flattened to ``{"hotel-area": "east"}`` (empty, ``null`` and ``not mentioned`` values
  skipped), as ``multiwoz`` does; ``None`` on user turns, and on a system turn not right
  after a user turn with a ``state``. Slot names are the unified ones (``price range``),
  not MultiWOZ's (``pricerange``).

Errors: a file that cannot be read as a whole (not a zip, no or several data members, not
UTF-8, invalid JSON, not a list) raises whatever ``on_error`` says; a malformed dialogue is
a ``RecordError`` (see ``chat``) whose reason starts with its index and field path
(``[12].turns[3].speaker: expected user or system, got 'sys'``), raised or, with
``on_error: skip``, counted and skipped. Items of a JSON list have no line of their own:
``line`` is None except for JSON syntax and encoding errors in a plain file.
"""

from __future__ import annotations

import codecs
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.formats import ParseContext
from pipeline.data.formats.chat import (
    FieldError,
    RecordError,
    check_keys,
    json_type,
    reason_kind,
    string_field,
)

__all__ = [
    "KINDS",
    "RecordError",
    "act_name",
    "convert_acts",
    "flatten_state",
    "read_file",
    "reason_kind",
]

MEMBER_NAMES = ("dialogues.json", "data.json")
SPLITS = {"train": "train", "validation": "valid", "test": "test"}
SPEAKERS = ("user", "system")
ACT_TYPES = ("categorical", "non-categorical", "binary")
# Kinds of RecordError this reader raises (file-level ones first). Stable slugs.
KINDS = (
    "bad_zip",
    "no_data_file",
    "several_data_files",
    "bad_encoding",
    "bad_json",
    "not_a_list",
    "not_an_object",
    "unknown_key",
    "bad_id",
    "duplicate_id",
    "bad_split",
    "bad_meta",
    "bad_turns",
    "bad_speaker",
    "bad_utterance",
    "bad_acts",
    "bad_state",
)

# MultiWOZ's camel-case intents; every other intent just gets a capital first letter.
_INTENTS = {
    "nobook": "NoBook",
    "nooffer": "NoOffer",
    "offerbook": "OfferBook",
    "offerbooked": "OfferBooked",
}
_NO_VALUE = frozenset({"", "not mentioned"})

Acts = dict[str, list[list[str]]]


# --------------------------------------------------------------------------- the file


def _member(path: Path, shown: str) -> tuple[str, bytes]:
    """Name and bytes of the dialogues member of the zip ``path``."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = [
                n
                for n in zf.namelist()
                if not n.endswith("/")
                and not any(p == "__MACOSX" or p.startswith(".") for p in PurePosixPath(n).parts)
            ]
            for wanted in MEMBER_NAMES:
                found = [n for n in names if PurePosixPath(n).name == wanted]
                if len(found) > 1:
                    raise RecordError(
                        shown,
                        f"several {wanted} members ({', '.join(found)}); expected one",
                        kind="several_data_files",
                    )
                if found:
                    return found[0], zf.read(found[0])
    except zipfile.BadZipFile as err:
        raise RecordError(shown, f"not a valid zip file ({err})", kind="bad_zip") from None
    listed = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "") if names else "none"
    raise RecordError(
        shown,
        f"no dialogues.json (or data.json) member in the zip; members: {listed}",
        kind="no_data_file",
    )


def _load(path: Path, shown: str) -> list[Any]:
    """The list of dialogues in ``path`` (a zip or a plain JSON file)."""
    data = path.read_bytes()
    member = None
    # Look at the bytes too: a data.zip renamed, or a truncated one, is still a zip.
    if path.suffix.lower() == ".zip" or data.startswith(b"PK\x03\x04"):
        member, data = _member(path, shown)
    data = data.removeprefix(codecs.BOM_UTF8)
    # Inside a zip, a line of the member is no line of the file named: the reason says it.
    prefix = f"member {member}: " if member else ""
    try:
        dialogues = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        where = f"line {line}, " if member else ""
        raise RecordError(
            shown,
            f"{prefix}not UTF-8 text ({where}byte 0x{data[err.start]:02x}); save it as UTF-8",
            kind="bad_encoding",
            line=None if member else line,
        ) from None
    except json.JSONDecodeError as err:
        where = f"line {err.lineno}, " if member else ""
        raise RecordError(
            shown,
            f"{prefix}invalid JSON: {err.msg} ({where}column {err.colno})",
            kind="bad_json",
            line=None if member else err.lineno,
        ) from None
    if not isinstance(dialogues, list):
        raise RecordError(
            shown,
            f"{prefix}expected a JSON list of dialogues (ConvLab-3's data/dialogues.json), "
            f"got {json_type(dialogues)}",
            kind="not_a_list",
        )
    return dialogues


# --------------------------------------------------------------------------- acts and state


def _capitalised(word: str) -> str:
    return word[:1].upper() + word[1:]


def act_name(domain: str, intent: str) -> str:
    """MultiWOZ's act name: ``("hotel", "inform")`` -> ``Hotel-Inform``, ``("", "thank")``
    -> ``General-Thank``."""
    domain = domain.strip().replace("-", "_") or "general"
    intent = intent.strip()
    return f"{_capitalised(domain)}-{_INTENTS.get(intent.lower(), _capitalised(intent))}"


def _act_pair(act: Any, act_type: str, where: str) -> tuple[str, list[str]]:
    if not isinstance(act, dict):
        raise FieldError("bad_acts", f"{where}: expected an object, got {json_type(act)}")
    intent = string_field(act, "intent", where, "bad_acts")
    if not intent.strip():
        raise FieldError("bad_acts", f"{where}.intent: empty")
    domain = string_field(act, "domain", where, "bad_acts")
    slot = string_field(act, "slot", where, "bad_acts").strip() or "none"
    if act_type == "binary":
        value = "?" if intent.strip().lower() == "request" and slot != "none" else "none"
    else:
        # ConvLab-3's checker lists null among the "no value" values.
        if "value" in act and act["value"] is None:
            value = "none"
        else:
            value = string_field(act, "value", where, "bad_acts").strip() or "none"
    return act_name(domain, intent), [slot, value]


def convert_acts(raw: Any, where: str = "dialogue_acts") -> Acts:
    """A unified ``dialogue_acts`` object in MultiWOZ's form (rules in the module docstring)."""
    if not isinstance(raw, dict):
        raise FieldError("bad_acts", f"{where}: expected an object, got {json_type(raw)}")
    check_keys(raw, ACT_TYPES, where)
    acts: Acts = {}
    for act_type in ACT_TYPES:
        items = raw.get(act_type, [])
        if not isinstance(items, list):
            raise FieldError(
                "bad_acts", f"{where}.{act_type}: expected a list, got {json_type(items)}"
            )
        for index, act in enumerate(items):
            name, pair = _act_pair(act, act_type, f"{where}.{act_type}[{index}]")
            acts.setdefault(name, []).append(pair)
    return acts


def flatten_state(raw: Any, where: str = "state") -> dict[str, str]:
    """``{"hotel": {"area": "east", "stars": ""}}`` -> ``{"hotel-area": "east"}``."""
    if not isinstance(raw, dict):
        raise FieldError("bad_state", f"{where}: expected an object, got {json_type(raw)}")
    belief: dict[str, str] = {}
    for domain, slots in raw.items():
        if not isinstance(slots, dict):
            raise FieldError(
                "bad_state", f"{where}.{domain}: expected an object, got {json_type(slots)}"
            )
        for slot, value in slots.items():
            if value is None:
                continue
            if not isinstance(value, str):
                raise FieldError(
                    "bad_state",
                    f"{where}.{domain}.{slot}: expected a string, got {json_type(value)}",
                )
            if value.strip() not in _NO_VALUE:
                belief[f"{domain}-{slot}"] = value
    return belief


# --------------------------------------------------------------------------- dialogues


def _turns(raw: dict[str, Any], where: str) -> tuple[list[Turn], int]:
    """The turns of dialogue ``raw``, and how many of them are empty."""
    if "turns" not in raw:
        raise FieldError("bad_turns", f"{where}.turns: missing")
    items = raw["turns"]
    if not isinstance(items, list):
        raise FieldError("bad_turns", f"{where}.turns: expected a list, got {json_type(items)}")
    turns: list[Turn] = []
    empty = 0
    state: dict[str, str] | None = None  # of the user turn just before
    for index, turn in enumerate(items):
        at = f"{where}.turns[{index}]"
        if not isinstance(turn, dict):
            raise FieldError("bad_turns", f"{at}: expected an object, got {json_type(turn)}")
        speaker = string_field(turn, "speaker", at, "bad_speaker")
        if speaker not in SPEAKERS:
            raise FieldError(
                "bad_speaker", f"{at}.speaker: expected user or system, got {speaker!r}"
            )
        text = string_field(turn, "utterance", at, "bad_utterance").strip()
        if not text:
            empty += 1
        acts = None
        if "dialogue_acts" in turn:
            acts = convert_acts(turn["dialogue_acts"], f"{at}.dialogue_acts")
        if speaker == "user":
            state = flatten_state(turn["state"], f"{at}.state") if "state" in turn else None
            turns.append(Turn(speaker, text, acts))
        else:
            turns.append(Turn(speaker, text, acts, state))
            state = None
    return turns, empty


def _dialogue_id(raw: dict[str, Any], where: str) -> str:
    if "dialogue_id" not in raw:
        raise FieldError("bad_id", f"{where}.dialogue_id: missing")
    value = raw["dialogue_id"]
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value
    got = repr(value) if isinstance(value, str) else json_type(value)
    raise FieldError(
        "bad_id", f"{where}.dialogue_id: expected a non-empty string or an integer, got {got}"
    )


def _meta(raw: dict[str, Any], where: str) -> dict[str, Any]:
    if "data_split" not in raw:
        raise FieldError("bad_split", f"{where}.data_split: missing")
    split = raw["data_split"]
    if not isinstance(split, str) or split not in SPLITS:
        got = repr(split) if isinstance(split, str) else json_type(split)
        raise FieldError(
            "bad_split", f"{where}.data_split: expected one of {', '.join(SPLITS)}, got {got}"
        )
    meta: dict[str, Any] = {"split": SPLITS[split]}
    if "domains" in raw:
        domains = raw["domains"]
        if not isinstance(domains, list) or not all(isinstance(d, str) for d in domains):
            raise FieldError("bad_meta", f"{where}.domains: expected a list of strings")
        meta["domains"] = domains
    for key in ("goal", "dataset", "original_id"):
        if key in raw:
            meta[key] = raw[key]
    return meta


def read_file(path: Path, ctx: ParseContext, *, shown_as: str | None = None) -> Iterator[Dialogue]:
    """Dialogues of a ConvLab-3 ``data.zip`` or ``dialogues.json`` (rules in the module
    docstring). ``shown_as`` names the file in errors instead of ``path``."""
    shown = shown_as if shown_as is not None else str(path)
    first_index: dict[str, int] = {}
    for index, raw in enumerate(_load(path, shown)):
        where = f"[{index}]"
        try:
            if not isinstance(raw, dict):
                raise FieldError(
                    "not_an_object", f"{where}: expected an object, got {json_type(raw)}"
                )
            did = _dialogue_id(raw, where)
            if did in first_index:
                raise FieldError(
                    "duplicate_id",
                    f"{where}.dialogue_id: duplicate {did!r} (first at [{first_index[did]}])",
                )
            meta = _meta(raw, where)
            turns, empty = _turns(raw, where)
        except FieldError as bad:
            ctx.bad_record(RecordError(shown, bad.reason, kind=bad.kind))
            continue
        first_index[did] = index
        # Counted only now: the empty turns of a skipped dialogue are not met.
        ctx.stats.empty_texts += empty
        if not turns:
            ctx.stats.empty_texts += 1
            continue
        yield ctx.emit(Dialogue(did, tuple(turns), meta))
