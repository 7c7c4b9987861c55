"""ConvLab-2 MultiWOZ dialogues turned into ConvLab-3's unified format, for reader tests.

Follows ConvLab-3's ``data/unified_datasets/multiwoz21/preprocess.py`` where it matters to
the reader: acts split into categorical / non-categorical (value found in the utterance,
with its span) / binary (requests, no slot, or no value: ``?``/``none``), with lowercased
intent, domain and slot; the ``metadata`` of a system turn becomes the ``state`` of the
user turn before it (``book`` slots as ``book <slot>``, ``not mentioned`` emptied). Unlike
ConvLab-3 it keeps MultiWOZ's slot names (``pricerange``, ``leaveAt``) and values, so that
the result can be compared with what the ``multiwoz`` reader gives for the same file.
"""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

_NO_VALUE = frozenset({"?", "none", ""})


def unified_acts(dialog_act: dict[str, list[list[str]]], text: str) -> dict[str, list[dict]]:
    """ConvLab-2 ``{"Hotel-Inform": [["Area", "east"]]}`` as unified ``dialogue_acts``."""
    acts: dict[str, list[dict]] = {"categorical": [], "non-categorical": [], "binary": []}
    for name, pairs in dialog_act.items():
        domain, intent = name.lower().split("-")
        for slot, value in pairs:
            slot = slot.lower()
            if intent == "request" or slot == "none" or value in _NO_VALUE:
                no_slot = "" if slot == "none" else slot
                act = {"intent": intent, "domain": domain, "slot": no_slot, "value": ""}
                acts["binary"].append(act)
                continue
            act = {"intent": intent, "domain": domain, "slot": slot, "value": value}
            start = text.lower().find(value.lower())
            if start >= 0:
                acts["non-categorical"].append({**act, "start": start, "end": start + len(value)})
            else:
                acts["categorical"].append(act)
    return acts


def unified_state(metadata: dict[str, Any]) -> dict[str, dict[str, str]]:
    """A system turn's ``metadata`` as a unified ``state`` (``{domain: {slot: value}}``)."""
    state: dict[str, dict[str, str]] = {}
    for domain, parts in metadata.items():
        slots = state.setdefault(domain, {})
        for slot, value in parts.get("semi", {}).items():
            slots[slot] = "" if value == "not mentioned" else value
        for slot, value in parts.get("book", {}).items():
            if slot != "booked":
                slots[f"book {slot}"] = "" if value == "not mentioned" else value
    return state


def to_unified(data: dict[str, Any], split: str, dataset: str = "multiwoz21") -> list[dict]:
    """ConvLab-2 ``{dialogue_id: {"goal", "log"}}`` as a list of unified dialogues."""
    dialogues = []
    for index, (name, raw) in enumerate(data.items()):
        turns: list[dict[str, Any]] = []
        for number, turn in enumerate(raw["log"]):
            speaker = "user" if number % 2 == 0 else "system"
            unified = {
                "speaker": speaker,
                "utterance": turn["text"],
                "utt_idx": number,
                "dialogue_acts": unified_acts(turn.get("dialog_act", {}), turn["text"]),
            }
            if speaker == "system":
                turns[-1]["state"] = unified_state(turn["metadata"])
                unified["db_results"] = {}
            turns.append(unified)
        acts = [name for turn in raw["log"] for name in turn.get("dialog_act", {})]
        domains = sorted({name.split("-")[0].lower() for name in acts})
        dialogues.append(
            {
                "dataset": dataset,
                "data_split": split,
                "dialogue_id": f"{dataset}-{split}-{index}",
                "original_id": name,
                "domains": domains,
                "goal": raw.get("goal", {}),
                "turns": turns,
            }
        )
    return dialogues


def data_zip(dialogues: list[dict]) -> bytes:
    """A ConvLab-3 ``data.zip`` holding ``data/dialogues.json`` (and an ontology stub)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("data/ontology.json", json.dumps({"domains": {}, "intents": {}}))
        zf.writestr("data/dialogues.json", json.dumps(dialogues, ensure_ascii=False))
    return buffer.getvalue()
