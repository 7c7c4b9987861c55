"""Chat JSONL reader (``pipeline.data.formats.chat``): files as people export them, the
turn rules, ids, every error message, both ``on_error`` modes, and the example corpus."""

from __future__ import annotations

import itertools
import json
import pickle
from collections import Counter
from pathlib import Path

import pytest

from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.formats import ParseContext
from pipeline.data.formats.chat import KINDS, RecordError, read_file, reason_kind
from pipeline.errors import DataError
from pipeline.names import OnError
from tests.data.recording import Recording

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chat.jsonl"


def msg(role: str, content: object) -> dict[str, object]:
    return {"role": role, "content": content}


def line(*messages: dict[str, object], **extra: object) -> str:
    return json.dumps({**extra, "messages": list(messages)}, ensure_ascii=False)


def write(tmp_path: Path, *lines: str, name: str = "chat.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(f"{text}\n" for text in lines), encoding="utf-8")
    return path


def read(path: Path, ctx: ParseContext | None = None, **kw: str) -> list[Dialogue]:
    return list(read_file(path, ctx or ParseContext(), **kw))


HELLO = line(msg("user", "Hi"), msg("assistant", "Hello!"))


# --------------------------------------------------------------------------- turns


def test_turns_ids_and_line_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, line(msg("user", " Hi there "), msg("assistant", "Hello.")), HELLO)
    first, second = read(path)
    assert first == Dialogue(
        "line-1", (Turn("user", "Hi there"), Turn("assistant", "Hello.")), {"line": 1}
    )
    assert second.id == "line-2" and second.meta == {"line": 2}


def test_bom_crlf_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "windows.jsonl"
    body = f"{HELLO}\r\n\r\n   \r\n{line(msg('user', 'Bye'), id='b')}\r\n\r\n"
    bom = b"\xef\xbb\xbf"
    path.write_bytes(bom + body.encode("utf-8") + bom + HELLO.encode("utf-8"))  # concatenated
    dialogues = read(path)
    assert [(d.id, d.meta["line"]) for d in dialogues] == [("line-1", 1), ("b", 4), ("line-6", 6)]
    assert dialogues[0].turns[1].text == "Hello!"  # no stray \r


def test_long_lines_and_any_script(tmp_path: Path) -> None:
    long = "word " * 20_000  # 100,000 characters
    texts = ["Привет, как дела?", "你好，今天天气很好。", "مرحبا، كيف حالك؟"]
    odd = "one\u2028two\x0cthree\x85four"  # line breaks for str.splitlines, not for JSONL
    path = write(
        tmp_path,
        line(msg("user", long), msg("assistant", texts[0])),
        line(*(msg(r, t) for r, t in zip(["user", "assistant", "user"], texts, strict=True))),
        line(msg("user", odd)),
    )
    first, second, third = read(path)
    assert first.turns[0].text == long.strip() and len(first.turns[0].text) == 99_999
    assert first.turns[1].text == texts[0]
    assert [t.text for t in second.turns] == texts
    assert third.turns[0].text == odd and third.meta["line"] == 3


def test_system_messages_go_to_meta(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        line(
            msg("system", "Be brief."),
            msg("user", "Hi"),
            msg("system", "  Be kind.  "),
            msg("user", "anyone?"),
            msg("assistant", "Yes."),
        ),
    )
    (dialogue,) = read(path)
    assert dialogue.meta == {"line": 1, "system": ["Be brief.", "Be kind."]}
    # The system message between them does not separate the two user messages.
    assert dialogue.turns == (Turn("user", "Hi anyone?"), Turn("assistant", "Yes."))


def test_consecutive_roles_join_and_empty_contents_count(tmp_path: Path) -> None:
    ctx = ParseContext()
    path = write(
        tmp_path,
        line(
            msg("user", "Hello."),
            msg("user", "  I need help. "),
            msg("assistant", "  "),
            msg("user", "Anyone?"),
            msg("assistant", "Sure."),
            msg("assistant", ""),
            msg("system", " "),
        ),
    )
    (dialogue,) = read(path, ctx)
    assert dialogue.turns == (
        Turn("user", "Hello. I need help. Anyone?"),
        Turn("assistant", "Sure."),
    )
    assert "system" not in dialogue.meta
    assert ctx.stats.empty_texts == 3 and ctx.stats.turns == 2 and ctx.stats.dialogues == 1


def test_records_without_turns_are_counted_not_yielded(tmp_path: Path) -> None:
    ctx = ParseContext()
    path = write(
        tmp_path,
        line(msg("user", " "), msg("assistant", "")),  # 2 empty messages + the record
        line(msg("system", "Only a prompt.")),  # the record
        line(),  # "messages": [], the record
        line(msg("user", "Just one turn.")),
    )
    dialogues = read(path, ctx)
    assert [d.id for d in dialogues] == ["line-4"]
    assert ctx.stats.empty_texts == 2 + 1 + 1 + 1
    assert ctx.stats.single_turn == 1 and ctx.stats.skipped_total == 0


def test_ids(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        line(msg("user", "a"), id="chat-1"),
        line(msg("user", "b"), id=7),
        line(msg("user", "c")),
        line(msg("user", "d"), id="   spaced id "),
    )
    assert [d.id for d in read(path)] == ["chat-1", "7", "line-3", "   spaced id "]


# --------------------------------------------------------------------------- errors

BAD_RECORDS = [
    ('{"messages": [}', "invalid JSON: Expecting value (column 15)", "bad_json"),
    ('{"messages": [] "id": 1}', "invalid JSON: Expecting ',' delimiter (column 17)", "bad_json"),
    ("[1, 2]", "not a JSON object (got list)", "not_an_object"),
    ('"text"', "not a JSON object (got string)", "not_an_object"),
    ('{"mesages": []}', "unknown key 'mesages'; expected messages, id", "unknown_key"),
    ('{"id": "x"}', "messages: missing", "bad_messages"),
    ('{"messages": {"role": "user"}}', "messages: expected a list, got object", "bad_messages"),
    ('{"messages": ["hi"]}', "messages[0]: expected an object, got string", "bad_messages"),
    (
        line(msg("user", "hi"), {"role": "user", "content": "x", "weight": 0}),
        "messages[1]: unknown key 'weight'; expected role, content",
        "unknown_key",
    ),
    (line({"content": "hi"}), "messages[0].role: missing", "bad_role"),
    (line(msg(None, "hi")), "messages[0].role: expected a string, got null", "bad_role"),
    (
        line(msg("tool", "{}")),
        "messages[0].role: expected one of user, assistant, system, got 'tool'",
        "bad_role",
    ),
    (
        line(msg("User", "hi")),
        "messages[0].role: expected one of user, assistant, system, got 'User'",
        "bad_role",
    ),
    (line({"role": "user"}), "messages[0].content: missing", "bad_content"),
    (
        line(msg("user", "a"), msg("assistant", "b"), msg("user", None)),
        "messages[2].content: expected a string, got null",
        "bad_content",
    ),
    (
        line(msg("user", [{"type": "text", "text": "hi"}])),
        "messages[0].content: expected a string, got list",
        "bad_content",
    ),
    (
        '{"messages": [{"role": "user", "content": "\\ud83d!"}]}',
        "messages[0].content: unpaired surrogate \\ud83d",
        "bad_content",
    ),
    (
        line(msg("user", "a"), id=""),
        "id: expected a non-empty string or an integer, got ''",
        "bad_id",
    ),
    (
        line(msg("user", "a"), id=None),
        "id: expected a non-empty string or an integer, got null",
        "bad_id",
    ),
    (
        line(msg("user", "a"), id=1.5),
        "id: expected a non-empty string or an integer, got number",
        "bad_id",
    ),
    (
        line(msg("user", "a"), id=True),
        "id: expected a non-empty string or an integer, got boolean",
        "bad_id",
    ),
]


@pytest.mark.parametrize(("text", "reason", "kind"), BAD_RECORDS)
def test_malformed_record_message(tmp_path: Path, text: str, reason: str, kind: str) -> None:
    path = write(tmp_path, HELLO, "", text)
    with pytest.raises(RecordError) as raised:
        read(path)
    err = raised.value
    assert (err.path, err.line, err.reason, err.kind) == (str(path), 3, reason, kind)
    assert str(err) == f"{path}:3: {reason}"
    assert reason_kind(err) == kind and kind in KINDS
    # The user's own file name, where the reader is given a copy.
    with pytest.raises(RecordError, match=r"^my chats\.jsonl:3: "):
        read(path, shown_as="my chats.jsonl")


def test_duplicate_ids_name_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, line(msg("user", "a"), id=5), HELLO, line(msg("user", "b"), id="5"))
    with pytest.raises(RecordError) as raised:
        read(path, shown_as="in.jsonl")
    assert str(raised.value) == "in.jsonl:3: id: duplicate '5' (first on line 1)"
    assert raised.value.kind == "duplicate_id"
    # A record without an id gets line-<n>, which an explicit id may already hold.
    path = write(tmp_path, line(msg("user", "a"), id="line-2"), HELLO)
    with pytest.raises(RecordError) as raised:
        read(path, shown_as="in.jsonl")
    assert str(raised.value) == (
        "in.jsonl:2: id: missing, and the default 'line-2' is used on line 1"
    )


def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    bad = line(msg("user", "café")).encode("latin-1")
    path.write_bytes(HELLO.encode() + b"\n" + bad + b"\n")
    with pytest.raises(RecordError) as raised:
        read(path, shown_as="export.jsonl")
    assert str(raised.value) == (
        "export.jsonl:2: not UTF-8 text (byte 0xe9 at byte 47 of the line); save the file as UTF-8"
    )
    assert raised.value.kind == "bad_encoding"
    ctx = Recording()
    assert [d.id for d in read(path, ctx)] == ["line-1"]
    assert [reason_kind(e) for e in ctx.errors] == ["bad_encoding"]


def test_utf16_file_is_refused_whole(tmp_path: Path) -> None:
    path = tmp_path / "utf16.jsonl"
    path.write_bytes(f"{HELLO}\n{HELLO}\n".encode("utf-16"))
    for ctx in (ParseContext(), ParseContext(OnError.SKIP)):
        with pytest.raises(
            RecordError, match=r"utf16\.jsonl:1: UTF-16 text; save the file as UTF-8"
        ):
            read(path, ctx)


def test_skip_mode_counts_each_bad_record_by_kind(tmp_path: Path) -> None:
    lines = [HELLO, *(text for text, _, _ in BAD_RECORDS), line(msg("user", "x"), id="x"), HELLO]
    lines.append(line(msg("user", "again"), id="x"))  # duplicate of the line before last
    path = write(tmp_path, *lines)
    ctx = Recording()
    dialogues = read(path, ctx, shown_as="mine.jsonl")
    assert [d.id for d in dialogues] == ["line-1", "x", f"line-{len(lines) - 1}"]
    assert ctx.stats.skipped == {"mine.jsonl": len(BAD_RECORDS) + 1}
    assert ctx.stats.first_error["mine.jsonl"].line == 2
    expected = Counter(kind for _, _, kind in BAD_RECORDS) + Counter(["duplicate_id"])
    assert Counter(reason_kind(e) for e in ctx.errors) == expected
    assert all(e.path == "mine.jsonl" for e in ctx.errors)
    assert [e.line for e in ctx.errors] == [*range(2, len(BAD_RECORDS) + 2), len(lines)]
    first = f"skipped {len(BAD_RECORDS) + 1} malformed records in mine.jsonl (first: mine.jsonl:2: "
    assert ctx.stats.skip_messages()[0].startswith(first)


def test_reason_kind_of_other_errors_and_pickling() -> None:
    assert reason_kind(DataError("f", "something else")) == "other"
    err = RecordError("f.jsonl", "messages: missing", kind="bad_messages", line=4)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.path, copy.line, copy.reason, copy.kind) == (
        "f.jsonl",
        4,
        "messages: missing",
        "bad_messages",
    )
    assert str(copy) == str(err)


# --------------------------------------------------------------------------- the example corpus


def test_example_corpus_parses_cleanly() -> None:
    ctx = ParseContext()
    dialogues = read(EXAMPLE, ctx)
    assert len(dialogues) >= 300 and ctx.stats.skipped_total == 0
    assert ctx.stats.empty_texts == 0 and ctx.stats.single_turn == 0
    assert all(4 <= len(d.turns) <= 10 for d in dialogues)
    for d in dialogues:
        speakers = [t.speaker for t in d.turns]
        assert speakers == ["user", "assistant"] * (len(speakers) // 2)
    assert sum("system" in d.meta for d in dialogues) >= 50
    assert len({d.id for d in dialogues}) == len(dialogues)
    raw = [json.loads(text) for text in EXAMPLE.read_text(encoding="utf-8").splitlines()]
    merged = sum(
        any(a["role"] == b["role"] for a, b in itertools.pairwise(r["messages"])) for r in raw
    )
    assert merged >= 5
    assert EXAMPLE.stat().st_size < 400_000
