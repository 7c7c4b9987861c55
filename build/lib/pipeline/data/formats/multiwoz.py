"""MultiWOZ in its original layout: ``{dialogue_id: {"goal": {...}, "log": [turn, ...]}}``.

Two folder layouts are read:

* ConvLab (MultiWOZ 2.0 from ConvLab-1, 2.1 from ConvLab-2): ``{train,val,test}.json``, or
  the ``.json.zip`` holding it, with acts inline in each turn's ``dialog_act`` (user and
  system turns).
* Official release: ``data.json`` (+ ``dialogue_acts.json``, system acts keyed by dialogue
  id without ``.json`` then the 1-based system-turn number, ``"No Annotation"`` where none)
  + ``valListFile.json``/``testListFile.json`` (one dialogue file name per line; every
  other dialogue is train).

Turns alternate user/system. ``Turn.acts`` = ``{"Hotel-Inform": [["Area", "east"], ...]}``
(None where the release has no annotation); ``Turn.belief`` on system turns is the
``metadata`` belief state flattened to ``{"hotel-area": "east", "hotel-book people": "2"}``
(empty and ``not mentioned`` values skipped); ``Turn.booked`` names the domains whose
``booked`` list is non-empty there (a booking was made, with its reference; taxi bookings,
which the scorers ignore, left out). ``meta["goal"]`` keeps the user goal. Dialogue ids
drop the ``.json`` suffix of the official files.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.formats import ParseContext, find_files, find_one, load_json, need_root
from pipeline.data.splits import Split
from pipeline.errors import DataError

USER, SYSTEM = "user", "system"
_FILE_SPLIT = {Split.TRAIN: "train", Split.VALID: "val", Split.TEST: "test"}
_NO_VALUE = frozenset({"", "not mentioned"})
_NO_ANNOTATION = "No Annotation"

Acts = dict[str, list[list[str]]]


def _bare_id(name: str) -> str:
    return name.removesuffix(".json")


def _load_convlab(path: Path) -> Any:
    """A ConvLab split file, read straight out of its zip if it is one."""
    if path.suffix != ".zip":
        return load_json(path)
    try:
        with zipfile.ZipFile(path) as zf:
            members = [n for n in zf.namelist() if n.endswith(".json") and "__MACOSX" not in n]
            if len(members) != 1:
                raise DataError(path, f"expected one .json member, found {members}")
            return load_json(path, zf.read(members[0]))
    except zipfile.BadZipFile as err:
        raise DataError(path, f"not a valid zip file: {err}") from None


def _acts(path: Path, did: str, raw: Any) -> Acts:
    if raw == _NO_ANNOTATION or raw is None:
        return {}
    if not isinstance(raw, dict):
        raise DataError(path, f"dialogue {did!r}: dialog acts must be an object")
    acts: Acts = {}
    for act, pairs in raw.items():
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in pairs
        ):
            raise DataError(path, f"dialogue {did!r}: act {act!r} must list [slot, value] pairs")
        acts[act] = [[str(slot), str(value)] for slot, value in pairs]
    return acts


def belief_state(metadata: dict[str, Any]) -> dict[str, str]:
    """``{"domain-slot": value}`` from a system turn's ``metadata`` (semi and book slots)."""
    belief: dict[str, str] = {}
    for domain, state in metadata.items():
        if not isinstance(state, dict):
            continue
        for slot, value in (state.get("semi") or {}).items():
            if isinstance(value, str) and value.strip() not in _NO_VALUE:
                belief[f"{domain}-{slot}"] = value
        for slot, value in (state.get("book") or {}).items():
            if slot != "booked" and isinstance(value, str) and value.strip() not in _NO_VALUE:
                belief[f"{domain}-book {slot}"] = value
    return belief


def booked_domains(metadata: dict[str, Any]) -> frozenset[str]:
    """The domains of a system turn's ``metadata`` with a booking made (a non-empty
    ``book.booked`` list), taxi left out: the standardized evaluator's booked domains, which
    equal these on every turn of the 2.1 test set (checked against its
    ``booked_domains.json``), and the official evaluator's booking pointer."""
    booked = set()
    for domain, state in metadata.items():
        book = state.get("book") if isinstance(state, dict) else None
        if domain != "taxi" and isinstance(book, dict) and book.get("booked"):
            booked.add(domain)
    return frozenset(booked)


def _dialogue(
    path: Path,
    did: str,
    raw: Any,
    split: Split,
    system_acts: dict[str, Any] | None,
    ctx: ParseContext,
) -> Dialogue:
    if not isinstance(raw, dict) or not isinstance(raw.get("log"), list):
        raise DataError(path, f"dialogue {did!r}: expected an object with a 'log' list")
    turns: list[Turn] = []
    for index, turn in enumerate(raw["log"]):
        if not isinstance(turn, dict) or not isinstance(turn.get("text"), str):
            raise DataError(path, f"dialogue {did!r}, turn {index}: expected an object with 'text'")
        is_system = index % 2 == 1
        text = turn["text"].strip()
        if not text:
            ctx.stats.empty_texts += 1
        acts: Acts | None = None
        if "dialog_act" in turn:
            acts = _acts(path, did, turn["dialog_act"])
        elif system_acts is not None and is_system:
            acts = _acts(path, did, system_acts.get(str(index // 2 + 1)))
        belief, booked = None, frozenset[str]()
        if is_system:
            metadata = turn.get("metadata")
            if not isinstance(metadata, dict):
                raise DataError(
                    path, f"dialogue {did!r}, turn {index}: system turn without metadata"
                )
            belief, booked = belief_state(metadata), booked_domains(metadata)
        turns.append(Turn(SYSTEM if is_system else USER, text, acts, belief, booked))
    return Dialogue(did, tuple(turns), {"split": split.value, "goal": raw.get("goal", {})})


def _read_mapping(
    path: Path,
    data: Any,
    splits: dict[str, Split],
    ctx: ParseContext,
    acts: dict[str, Any] | None = None,
) -> Iterator[Dialogue]:
    if not isinstance(data, dict):
        raise DataError(path, "expected a JSON object {dialogue_id: dialogue}")
    for name, raw in data.items():
        did = _bare_id(name)
        if did not in splits:
            continue
        try:
            system_acts = None
            if acts is not None:
                found = acts.get(did, {})
                system_acts = found if isinstance(found, dict) else {}
            yield ctx.emit(_dialogue(path, did, raw, splits[did], system_acts, ctx))
        except DataError as err:
            ctx.bad_record(err)


def _convlab_files(root: Path) -> dict[Split, Path]:
    files: dict[Split, Path] = {}
    for split, stem in _FILE_SPLIT.items():
        plain = find_files(root, rf"{stem}\.json")
        zipped = find_files(root, rf"{stem}\.json\.zip")
        candidates = plain or zipped  # an extracted file wins over its archive
        if len(candidates) > 1:
            listed = ", ".join(str(p.relative_to(root)) for p in candidates)
            raise DataError(
                root, f"several MultiWOZ {stem} files ({listed}); point root at one folder"
            )
        if candidates:
            files[split] = candidates[0]
    return files


def _list_file(root: Path, stem: str) -> set[str]:
    path = find_one(root, rf"{stem}ListFile(\.json|\.txt)?", f"MultiWOZ {stem}ListFile")
    return {_bare_id(line.strip()) for line in path.read_text().splitlines() if line.strip()}


def _read_official(root: Path, wanted: list[Split], ctx: ParseContext) -> Iterator[Dialogue]:
    path = find_one(root, r"data\.json", "MultiWOZ data.json")
    data = load_json(path)
    if not isinstance(data, dict):
        raise DataError(path, "expected a JSON object {dialogue_id: dialogue}")
    acts_files = find_files(root, r"dialogue_acts\.json")
    acts = load_json(acts_files[0]) if acts_files else None
    valid, test = _list_file(root, "val"), _list_file(root, "test")
    splits: dict[str, Split] = {}
    for name in data:
        did = _bare_id(name)
        split = Split.TEST if did in test else Split.VALID if did in valid else Split.TRAIN
        if split in wanted:
            splits[did] = split
    yield from _read_mapping(path, data, splits, ctx, acts)


def read(root: Path | None, split: Split | None, ctx: ParseContext) -> Iterator[Dialogue]:
    """MultiWOZ dialogues of ``split`` (all splits if None) from a ConvLab or official folder."""
    root = need_root(root, "multiwoz")
    wanted = [split] if split is not None else list(Split)
    files = _convlab_files(root)
    if not files:
        if not find_files(root, r"data\.json"):
            raise DataError(
                root,
                "no MultiWOZ files here: expected {train,val,test}.json(.zip) (ConvLab layout) "
                "or data.json + valListFile/testListFile (official release)",
            )
        yield from _read_official(root, wanted, ctx)
        return
    missing = [s.value for s in wanted if s not in files]
    if split is not None and missing:
        raise DataError(root, f"no MultiWOZ {_FILE_SPLIT[split]}.json(.zip) here")
    for part in wanted:
        if part not in files:
            continue
        path = files[part]
        data = _load_convlab(path)
        ids = {_bare_id(name): part for name in data} if isinstance(data, dict) else {}
        yield from _read_mapping(path, data, ids, ctx)
