"""Chat JSONL: one dialogue per line, the way chat logs and fine-tuning sets are exported.

A line holds one JSON object::

    {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}],
     "id": "optional"}

Rules (the contract users write their files against):

* **Encoding.** UTF-8, with or without a byte-order mark (on any line: concatenated
  exports have them); Windows (CRLF) line endings are fine. Any script is kept as
  written. A line that is not valid UTF-8 is an error naming the file and the line; a
  UTF-16 file is refused as a whole (re-save it as UTF-8).
* **Lines.** Blank lines are skipped but still counted, so line numbers in messages match
  what an editor shows. Lines may be arbitrarily long. Only ``\\n`` ends a line: a JSON
  string may hold U+2028 or a form feed without splitting the record.
* **Keys.** Top level: ``messages`` (required) and ``id`` (optional); each message:
  ``role`` and ``content``, both required. Any other key is an error, so a typo
  (``mesages``) or a feature this reader does not implement (a message ``weight``, ``name``
  or tool call) is reported rather than silently ignored.
* **Roles.** ``user`` and ``assistant`` messages become turns whose speaker is the role.
  ``system`` messages are not turns: their contents, in order, go to ``meta["system"]``
  (a list of strings, present only when there is at least one).
* **Turns.** Contents are stripped; empty or whitespace-only contents are dropped and
  counted in ``ParseStats.empty_texts``. Consecutive messages of one role (system
  messages and dropped empty ones between them do not separate them) are one turn, their
  contents joined with a single space, so speakers alternate.
* **Ids.** ``Dialogue.id`` is the record's ``id`` (a non-empty string, or an integer
  stored as its decimal string), else ``line-<n>`` with ``n`` the 1-based line number. Two
  records with one id are an error naming both lines.
* **Short records.** A record left with no turn (its messages all empty, or only system
  messages) is not yielded; it adds one to ``ParseStats.empty_texts`` (on top of its empty
  messages), so a dropped record always shows in the counts. Single-turn dialogues are
  yielded (``ParseStats.single_turn`` counts them); which tasks can use them is decided
  later.
* **Meta.** ``meta["line"]`` is the record's line number, for later messages.
* **Errors.** A malformed record is a :class:`RecordError` at ``file:line`` whose reason
  names the field JSON-path style (``messages[2].content: expected a string, got null``),
  raised, or with ``on_error: skip`` counted and skipped (``ParseContext.bad_record``).
  :func:`reason_kind` gives a short stable slug for each error (``bad_content``), for
  counting skips by reason.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.data.dialogue import Dialogue
from pipeline.data.formats import ParseContext, merge_turns
from pipeline.errors import DataError

ROLES = ("user", "assistant", "system")
RECORD_KEYS = ("messages", "id")
MESSAGE_KEYS = ("role", "content")

# Kinds of RecordError. Slugs are stable: the integration layer counts skips under them.
KINDS = (
    "bad_encoding",
    "bad_json",
    "not_an_object",
    "unknown_key",
    "bad_messages",
    "bad_role",
    "bad_content",
    "bad_id",
    "duplicate_id",
)

_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


class RecordError(DataError):
    """A malformed record: a ``DataError`` with ``kind``, a short stable slug of the reason."""

    def __init__(self, path: object, reason: str, *, kind: str, line: int | None = None) -> None:
        super().__init__(path, reason, line=line)
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through their args; keep ``kind`` (errors cross process pools).
        return (_rebuild, (self.path, self.reason, self.kind, self.line))


def _rebuild(path: str, reason: str, kind: str, line: int | None) -> RecordError:
    return RecordError(path, reason, kind=kind, line=line)


def reason_kind(err: DataError) -> str:
    """The slug under which to count ``err`` (``RecordError.kind``; ``other`` for the rest)."""
    return getattr(err, "kind", None) or "other"


def json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, as error messages say it (``object``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


class FieldError(Exception):
    """A field failed a check; the reader turns it into a ``RecordError`` at the record's
    place (file and line), which the field itself does not know."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def check_keys(obj: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    """Fail (kind ``unknown_key``) on the first key of ``obj`` not in ``allowed``."""
    for key in obj:
        if key not in allowed:
            prefix = f"{where}: " if where else ""
            raise FieldError(
                "unknown_key", f"{prefix}unknown key {key!r}; expected {', '.join(allowed)}"
            )


def string_field(obj: dict[str, Any], key: str, where: str, kind: str) -> str:
    """``obj[key]``, which must be present and a string that can be written as UTF-8."""
    if key not in obj:
        raise FieldError(kind, f"{where}.{key}: missing")
    value = obj[key]
    if not isinstance(value, str):
        raise FieldError(kind, f"{where}.{key}: expected a string, got {json_type(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        # json.loads accepts "\ud83d" escapes; such text cannot be written out again.
        char = value[err.start]
        raise FieldError(kind, f"{where}.{key}: unpaired surrogate \\u{ord(char):04x}") from None
    return value


def _messages(record: dict[str, Any]) -> list[tuple[str, str]]:
    """``(role, content)`` of each message, checked."""
    if "messages" not in record:
        raise FieldError("bad_messages", "messages: missing")
    messages = record["messages"]
    if not isinstance(messages, list):
        raise FieldError("bad_messages", f"messages: expected a list, got {json_type(messages)}")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise FieldError(
                "bad_messages", f"{where}: expected an object, got {json_type(message)}"
            )
        check_keys(message, MESSAGE_KEYS, where)
        role = string_field(message, "role", where, "bad_role")
        if role not in ROLES:
            expected = ", ".join(ROLES)
            raise FieldError("bad_role", f"{where}.role: expected one of {expected}, got {role!r}")
        checked.append((role, string_field(message, "content", where, "bad_content")))
    return checked


def _record_id(record: dict[str, Any], line: int) -> str:
    if "id" not in record:
        return f"line-{line}"
    value = record["id"]
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value
    got = repr(value) if isinstance(value, str) else json_type(value)
    raise FieldError("bad_id", f"id: expected a non-empty string or an integer, got {got}")


def _parse_line(raw: bytes) -> dict[str, Any]:
    """The JSON object on one line (without its line ending)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        byte = raw[err.start]
        raise FieldError(
            "bad_encoding",
            f"not UTF-8 text (byte 0x{byte:02x} at byte {err.start + 1} of the line); "
            "save the file as UTF-8",
        ) from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise FieldError("bad_json", f"invalid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(record, dict):
        raise FieldError("not_an_object", f"not a JSON object (got {json_type(record)})")
    check_keys(record, RECORD_KEYS, "")
    return record


def _lines(path: Path, shown: str) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines with their 1-based numbers, BOM and CR removed, read one at a time
    (a file larger than memory streams through)."""
    with path.open("rb") as f:
        if f.read(2) in _UTF16_BOMS:
            raise RecordError(
                shown, "UTF-16 text; save the file as UTF-8", kind="bad_encoding", line=1
            )
        f.seek(0)
        # A binary file's lines end at b"\n" only: str.splitlines would also split inside
        # JSON strings holding U+2028, U+0085 or a form feed, breaking a record in two.
        for number, raw in enumerate(f, start=1):
            # A BOM on any line, not just the first: files exported with one get concatenated.
            line = raw.removesuffix(b"\n").removesuffix(b"\r").removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield number, line


def read_file(path: Path, ctx: ParseContext, *, shown_as: str | None = None) -> Iterator[Dialogue]:
    """Dialogues of the chat JSONL file ``path`` (rules in the module docstring).

    ``shown_as`` names the file in errors instead of ``path`` (the user's own file name
    where ``path`` is a copy).
    """
    shown = shown_as if shown_as is not None else str(path)
    first_line: dict[str, int] = {}
    for number, raw in _lines(path, shown):
        try:
            record = _parse_line(raw)
            messages = _messages(record)
            did = _record_id(record, number)
            if did in first_line:
                # A record without "id" gets line-<n>, which an explicit id may already hold.
                reason = (
                    f"id: duplicate {did!r} (first on line {first_line[did]})"
                    if "id" in record
                    else f"id: missing, and the default {did!r} is used on line {first_line[did]}"
                )
                raise FieldError("duplicate_id", reason)
        except FieldError as bad:
            ctx.bad_record(RecordError(shown, bad.reason, kind=bad.kind, line=number))
            continue
        first_line[did] = number
        system = [text.strip() for role, text in messages if role == "system"]
        ctx.stats.empty_texts += sum(1 for text in system if not text)
        turns = merge_turns(((r, t) for r, t in messages if r != "system"), ctx)
        if not turns:
            ctx.stats.empty_texts += 1
            continue
        meta: dict[str, Any] = {"line": number}
        if any(system):
            meta["system"] = [text for text in system if text]
        yield ctx.emit(Dialogue(did, turns, meta))
