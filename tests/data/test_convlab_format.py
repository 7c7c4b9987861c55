"""ConvLab-3 unified format reader (``pipeline.data.formats.convlab``): zipped and plain
files, acts and belief in MultiWOZ's form, splits, every error message, skip mode, and the
real MultiWOZ 2.1 test set converted to the unified format and read back."""

from __future__ import annotations

import copy
import io
import json
import zipfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pipeline.data.acts import ActInventory
from pipeline.data.dialogue import Dialogue
from pipeline.data.formats import ParseContext
from pipeline.data.formats.convlab import KINDS, RecordError, act_name, read_file, reason_kind
from pipeline.data.formats.multiwoz import read as read_multiwoz
from pipeline.names import OnError
from tests.data.convlab_unified import data_zip, to_unified
from tests.data.recording import Recording


def act(intent: str, domain: str, slot: str, value: str | None = None) -> dict[str, Any]:
    found = {"intent": intent, "domain": domain, "slot": slot}
    return found if value is None else {**found, "value": value}


def acts(cat: Sequence = (), noncat: Sequence = (), binary: Sequence = ()) -> dict[str, list]:
    return {"categorical": list(cat), "non-categorical": list(noncat), "binary": list(binary)}


HOTEL = {
    "dataset": "toy",
    "data_split": "train",
    "dialogue_id": "toy-train-0",
    "original_id": "SNG1.json",
    "domains": ["hotel", "general"],
    "goal": {"description": "find a hotel", "inform": {"hotel": {"area": "east"}}, "request": {}},
    "turns": [
        {
            "speaker": "user",
            "utterance": "I need a cheap hotel in the east.",
            "utt_idx": 0,
            "dialogue_acts": acts(
                cat=[act("inform", "hotel", "price range", "cheap")],
                noncat=[{**act("inform", "hotel", "area", "east"), "start": 28, "end": 32}],
            ),
            "state": {"hotel": {"area": "east", "price range": "cheap", "stars": ""}, "taxi": {}},
        },
        {
            "speaker": "system",
            "utterance": "Which day do you arrive? I can't book Tuesday.",
            "utt_idx": 1,
            "dialogue_acts": acts(
                cat=[act("nobook", "booking", "day", "Tuesday")],
                binary=[act("request", "hotel", "book day", ""), act("reqmore", "general", "")],
            ),
            "db_results": {},
            "booked": {"hotel": []},
        },
        {
            "speaker": "user",
            "utterance": "Wednesday. Thanks!",
            "utt_idx": 2,
            "dialogue_acts": acts(
                cat=[act("inform", "hotel", "book day", "wednesday")],
                binary=[act("thank", "", ""), act("inform", "hotel", "parking")],
            ),
            "state": {"hotel": {"area": "east", "book day": "wednesday", "name": None}},
            "emotion": "happy",
        },
        {
            "speaker": "system",
            "utterance": "  ",
            "utt_idx": 3,
            "dialogue_acts": acts(noncat=[{**act("inform", "hotel", "choice"), "value": None}]),
            "db_results": {},
        },
    ],
}
CHITCHAT = {
    "dataset": "toy",
    "data_split": "validation",
    "dialogue_id": 17,
    "turns": [
        {"speaker": "system", "utterance": "Hello!"},
        {"speaker": "user", "utterance": "Hi, how are you?"},
        {"speaker": "system", "utterance": "Fine, thanks."},
    ],
}
TEST = {**copy.deepcopy(CHITCHAT), "data_split": "test", "dialogue_id": "t-1"}


def zipped(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def write(tmp_path: Path, dialogues: Any, name: str = "dialogues.json") -> Path:
    path = tmp_path / name
    text = json.dumps(dialogues, indent=1, ensure_ascii=False).encode()
    if name.endswith(".zip"):
        text = zipped({"data/ontology.json": b"{}", "data/dialogues.json": text})
    path.write_bytes(text)
    return path


def read(path: Path, ctx: ParseContext | None = None, **kw: str) -> list[Dialogue]:
    return list(read_file(path, ctx or ParseContext(), **kw))


# --------------------------------------------------------------------------- reading


@pytest.mark.parametrize("name", ["dialogues.json", "data.zip"])
def test_dialogues_meta_and_splits(tmp_path: Path, name: str) -> None:
    ctx = ParseContext()
    hotel, chat, test = read(write(tmp_path, [HOTEL, CHITCHAT, TEST], name), ctx)
    assert (hotel.id, chat.id, test.id) == ("toy-train-0", "17", "t-1")
    assert [d.meta["split"] for d in (hotel, chat, test)] == ["train", "valid", "test"]
    assert hotel.meta == {
        "split": "train",
        "domains": ["hotel", "general"],
        "goal": HOTEL["goal"],
        "dataset": "toy",
        "original_id": "SNG1.json",
    }
    assert [(t.speaker, t.text) for t in hotel.turns] == [
        ("user", "I need a cheap hotel in the east."),
        ("system", "Which day do you arrive? I can't book Tuesday."),
        ("user", "Wednesday. Thanks!"),
        ("system", ""),  # kept, so acts and belief stay on their turns; counted
    ]
    assert ctx.stats.empty_texts == 1 and ctx.stats.dialogues == 3 and ctx.stats.turns == 10
    assert all(t.acts is None and t.belief is None for t in chat.turns)


def test_acts_in_multiwoz_form(tmp_path: Path) -> None:
    (hotel,) = read(write(tmp_path, [HOTEL]))
    assert [t.acts for t in hotel.turns] == [
        {"Hotel-Inform": [["price range", "cheap"], ["area", "east"]]},
        {
            "Booking-NoBook": [["day", "Tuesday"]],
            "Hotel-Request": [["book day", "?"]],
            "General-Reqmore": [["none", "none"]],
        },
        {
            "Hotel-Inform": [["book day", "wednesday"], ["parking", "none"]],
            "General-Thank": [["none", "none"]],
        },
        {"Hotel-Inform": [["choice", "none"]]},
    ]
    inventory = ActInventory.from_dialogues([hotel])
    assert inventory.domains == ("booking", "general", "hotel")
    assert inventory.acts == ("inform", "nobook", "reqmore", "request", "thank")
    assert inventory.slots == ("area", "book day", "choice", "day", "parking", "price range")


def test_act_names() -> None:
    assert act_name("hotel", "inform") == "Hotel-Inform"
    assert act_name("", "thank") == "General-Thank"
    assert act_name("train", "offerbooked") == "Train-OfferBooked"
    assert act_name("Attitude & Emotion", "directive") == "Attitude & Emotion-Directive"
    assert act_name("e-mail", "send") == "E_mail-Send"  # the act name splits at its first "-"


def test_belief_on_system_turns(tmp_path: Path) -> None:
    (hotel,) = read(write(tmp_path, [HOTEL]))
    assert [t.belief for t in hotel.turns] == [
        None,
        {"hotel-area": "east", "hotel-price range": "cheap"},
        None,
        {"hotel-area": "east", "hotel-book day": "wednesday"},
    ]


def test_zip_member_lookup(tmp_path: Path) -> None:
    body = json.dumps([CHITCHAT]).encode()
    # Any depth; data.json accepted where there is no dialogues.json; resource forks ignored.
    for members in (
        {"unified/mydata/data.json": body, "__MACOSX/unified/._data.json": b"\0"},
        {"data/dialogues.json": body, "data/data.json": b"not read"},
    ):
        path = tmp_path / "data.zip"
        path.write_bytes(zipped(members))
        assert [d.id for d in read(path)] == ["17"]
    path = tmp_path / "renamed.bin"  # a zip whatever its name
    path.write_bytes(zipped({"data/dialogues.json": body}))
    assert [d.id for d in read(path)] == ["17"]


def test_bom_and_non_latin_text(tmp_path: Path) -> None:
    dialogue = copy.deepcopy(CHITCHAT)
    dialogue["turns"][1]["utterance"] = "你好，今天怎么样？"
    path = tmp_path / "dialogues.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([dialogue], ensure_ascii=False).encode())
    assert read(path)[0].turns[1].text == "你好，今天怎么样？"


def test_dialogue_without_turns_is_counted_not_yielded(tmp_path: Path) -> None:
    ctx = ParseContext()
    empty = {**CHITCHAT, "dialogue_id": "e", "turns": []}
    assert [d.id for d in read(write(tmp_path, [empty, CHITCHAT]), ctx)] == ["17"]
    assert ctx.stats.empty_texts == 1 and ctx.stats.dialogues == 1


# --------------------------------------------------------------------------- errors


def _broken(change: str) -> dict[str, Any]:
    """HOTEL with one thing wrong: ``change`` is ``path=json`` (``turns.1.speaker="sys"``)."""
    dialogue = copy.deepcopy(HOTEL)
    where, _, value = change.partition("=")
    *parents, last = where.split(".")
    node: Any = dialogue
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value:
        node[int(last) if isinstance(node, list) else last] = json.loads(value)
    else:
        del node[int(last) if isinstance(node, list) else last]
    return dialogue


T1, D1, A1 = "[1].turns[1]", "turns.1.dialogue_acts", "[1].turns[1].dialogue_acts"
NOT_ID = "expected a non-empty string or an integer, got"
BAD_DIALOGUES = [
    ("dialogue_id", "[1].dialogue_id: missing", "bad_id"),
    ('dialogue_id=""', f"[1].dialogue_id: {NOT_ID} ''", "bad_id"),
    ("dialogue_id=null", f"[1].dialogue_id: {NOT_ID} null", "bad_id"),
    ("data_split", "[1].data_split: missing", "bad_split"),
    ('data_split="dev"',
     "[1].data_split: expected one of train, validation, test, got 'dev'", "bad_split"),
    ('domains="hotel"', "[1].domains: expected a list of strings", "bad_meta"),
    ("turns", "[1].turns: missing", "bad_turns"),
    ("turns={}", "[1].turns: expected a list, got object", "bad_turns"),
    ('turns.1="hi"', f"{T1}: expected an object, got string", "bad_turns"),
    ('turns.1.speaker="sys"', f"{T1}.speaker: expected user or system, got 'sys'", "bad_speaker"),
    ("turns.1.speaker", f"{T1}.speaker: missing", "bad_speaker"),
    ("turns.1.utterance=3", f"{T1}.utterance: expected a string, got number", "bad_utterance"),
    (f"{D1}=[]", f"{A1}: expected an object, got list", "bad_acts"),
    (f"{D1}.span=[]",
     f"{A1}: unknown key 'span'; expected categorical, non-categorical, binary", "unknown_key"),
    (f"{D1}.binary=null", f"{A1}.binary: expected a list, got null", "bad_acts"),
    (f'{D1}.binary.0=["request"]', f"{A1}.binary[0]: expected an object, got list", "bad_acts"),
    (f"{D1}.binary.0.intent", f"{A1}.binary[0].intent: missing", "bad_acts"),
    (f'{D1}.binary.0.intent=" "', f"{A1}.binary[0].intent: empty", "bad_acts"),
    (f"{D1}.categorical.0.domain=null",
     f"{A1}.categorical[0].domain: expected a string, got null", "bad_acts"),
    (f"{D1}.categorical.0.value", f"{A1}.categorical[0].value: missing", "bad_acts"),
    (f"{D1}.categorical.0.value=4",
     f"{A1}.categorical[0].value: expected a string, got number", "bad_acts"),
    ('turns.0.state=""', "[1].turns[0].state: expected an object, got string", "bad_state"),
    ('turns.0.state.hotel=["east"]',
     "[1].turns[0].state.hotel: expected an object, got list", "bad_state"),
    ("turns.0.state.hotel.stars=4",
     "[1].turns[0].state.hotel.stars: expected a string, got number", "bad_state"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "reason", "kind"), BAD_DIALOGUES)
def test_malformed_dialogue_message(tmp_path: Path, change: str, reason: str, kind: str) -> None:
    path = write(tmp_path, [CHITCHAT, _broken(change)])
    with pytest.raises(RecordError) as raised:
        read(path, shown_as="corpus/data.zip")
    err = raised.value
    assert (err.path, err.line, err.reason, err.kind) == ("corpus/data.zip", None, reason, kind)
    assert str(err) == f"corpus/data.zip: {reason}"
    assert reason_kind(err) == kind and kind in KINDS


def test_not_an_object_and_duplicate_ids(tmp_path: Path) -> None:
    path = write(tmp_path, [CHITCHAT, [1], {**HOTEL, "dialogue_id": "17"}, HOTEL, HOTEL])
    with pytest.raises(RecordError, match=r"^\S+: \[1\]: expected an object, got list$"):
        read(path)
    ctx = Recording()
    assert [d.id for d in read(path, ctx, shown_as="u.zip")] == ["17", "toy-train-0"]
    assert [str(e) for e in ctx.errors] == [
        "u.zip: [1]: expected an object, got list",
        "u.zip: [2].dialogue_id: duplicate '17' (first at [0])",
        "u.zip: [4].dialogue_id: duplicate 'toy-train-0' (first at [3])",
    ]
    assert [e.kind for e in ctx.errors] == ["not_an_object", "duplicate_id", "duplicate_id"]


def test_skip_mode_counts_each_bad_dialogue(tmp_path: Path) -> None:
    broken = [_broken(change) for change, _, _ in BAD_DIALOGUES]
    for index, dialogue in enumerate(broken):
        if isinstance(dialogue.get("dialogue_id"), str) and dialogue["dialogue_id"]:
            dialogue["dialogue_id"] = f"bad-{index}"
    ctx = Recording()
    dialogues = read(write(tmp_path, [CHITCHAT, *broken, HOTEL], "data.zip"), ctx)
    assert [d.id for d in dialogues] == ["17", "toy-train-0"]
    path = str(tmp_path / "data.zip")
    assert ctx.stats.skipped == {path: len(BAD_DIALOGUES)}
    assert Counter(reason_kind(e) for e in ctx.errors) == Counter(k for _, _, k in BAD_DIALOGUES)
    # The empty utterance of HOTEL is counted once, those of skipped dialogues not at all.
    assert ctx.stats.empty_texts == 1


M = "member data/dialogues.json: "
QUOTES = "Expecting property name enclosed in double quotes"
LIST = "expected a JSON list of dialogues (ConvLab-3's data/dialogues.json), got object"
FILE_ERRORS = [  # a zip where the bytes start with PK, else a plain dialogues.json
    (b"PK\x03\x04 truncated", "not a valid zip file (File is not a zip file)", "bad_zip"),
    (
        zipped({"data/ontology.json": b"{}"}),
        "no dialogues.json (or data.json) member in the zip; members: data/ontology.json",
        "no_data_file",
    ),
    (
        zipped({"a/dialogues.json": b"[]", "b/dialogues.json": b"[]"}),
        "several dialogues.json members (a/dialogues.json, b/dialogues.json); expected one",
        "several_data_files",
    ),
    (zipped({"data/dialogues.json": b'[\n{"a": 1,}\n]'}),
     f"{M}invalid JSON: {QUOTES} (line 2, column 9)", "bad_json"),
    (zipped({"data/dialogues.json": b'[\n"caf\xe9"]'}),
     f"{M}not UTF-8 text (line 2, byte 0xe9); save it as UTF-8", "bad_encoding"),
    (zipped({"data/dialogues.json": b'{"train": []}'}), f"{M}{LIST}", "not_a_list"),
    (b"[\n\n{]", f"invalid JSON: {QUOTES} (column 2)", "bad_json"),
    (b'[\n"caf\xe9"]', "not UTF-8 text (byte 0xe9); save it as UTF-8", "bad_encoding"),
    (b'{"train": []}', LIST, "not_a_list"),
]  # fmt: skip


@pytest.mark.parametrize(("data", "reason", "kind"), FILE_ERRORS)
def test_file_errors_raise_whatever_on_error_says(
    tmp_path: Path, data: bytes, reason: str, kind: str
) -> None:
    path = tmp_path / ("data.zip" if data.startswith(b"PK") else "dialogues.json")
    path.write_bytes(data)
    with pytest.raises(RecordError) as raised:
        read(path, ParseContext(OnError.SKIP), shown_as="their.file")
    assert (raised.value.path, raised.value.reason, raised.value.kind) == (
        "their.file",
        reason,
        kind,
    )
    assert kind in KINDS


def test_file_error_lines(tmp_path: Path) -> None:
    path = tmp_path / "dialogues.json"
    path.write_bytes(b"[\n\n{]")
    with pytest.raises(RecordError) as raised:
        read(path)
    assert raised.value.line == 3 and str(raised.value).startswith(f"{path}:3: invalid JSON")
    path.write_bytes(b'[\n"caf\xe9"]')
    with pytest.raises(RecordError) as raised:
        read(path)
    assert raised.value.line == 2


# --------------------------------------------------------------------------- MultiWOZ 2.1


def _act_set(turn_acts: dict[str, list[list[str]]] | None) -> set[tuple[str, str, str]]:
    return {
        (name.lower(), slot.lower(), value.lower())
        for name, pairs in (turn_acts or {}).items()
        for slot, value in pairs
    }


def _check_against_multiwoz(shared_data: Path, tmp_path: Path, count: int | None) -> None:
    with zipfile.ZipFile(shared_data / "multiwoz" / "convlab2" / "test.json.zip") as zf:
        data = json.loads(zf.read("test.json"))
    if count is not None:
        data = dict(list(data.items())[:count])
    # The multiwoz reader on the same dialogues (a folder of their own, ConvLab layout).
    (tmp_path / "convlab2").mkdir()
    (tmp_path / "convlab2" / "test.json").write_text(json.dumps(data))
    expected = list(read_multiwoz(tmp_path / "convlab2", None, ParseContext()))
    (tmp_path / "data.zip").write_bytes(data_zip(to_unified(data, "test")))
    ctx = ParseContext()
    got = read(tmp_path / "data.zip", ctx)
    assert len(got) == len(expected) == len(data) and ctx.stats.skipped_total == 0
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.meta["original_id"] == theirs.id and ours.meta["split"] == "test"
        assert [(t.speaker, t.text) for t in ours.turns] == [
            (t.speaker, t.text) for t in theirs.turns
        ]
        assert [_act_set(t.acts) for t in ours.turns] == [_act_set(t.acts) for t in theirs.turns]
        assert [t.belief for t in ours.turns] == [t.belief for t in theirs.turns]
    inventory = ActInventory.from_dialogues(got)
    assert inventory == ActInventory.from_dialogues(expected)
    assert {"hotel", "general"} <= set(inventory.domains) and "request" in inventory.acts
    assert "none" not in inventory.slots and len(inventory) > 0


def test_multiwoz21_test_dialogues_read_back(shared_data: Path, tmp_path: Path) -> None:
    _check_against_multiwoz(shared_data, tmp_path, 50)


@pytest.mark.slow
def test_multiwoz21_whole_test_set_reads_back(shared_data: Path, tmp_path: Path) -> None:
    _check_against_multiwoz(shared_data, tmp_path, None)
