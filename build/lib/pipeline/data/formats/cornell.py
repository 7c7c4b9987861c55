"""Cornell Movie-Dialogs: ``movie_lines.txt`` + ``movie_conversations.txt``.

ISO-8859-1 text, fields separated by `` +++$+++ ``. ``movie_lines.txt``: lineID,
characterID, movieID, character name, text (may be empty). ``movie_conversations.txt``:
char1, char2, movieID, a Python-style list of line ids in order, parsed as a literal
(never evaluated). Lines are not in conversation order, so all lines are indexed first.
A turn is the consecutive non-empty lines of one character (speaker = character id);
empty lines are counted and dropped. Dialogue id: ``<movieID>-<first lineID>``.
No official split: a seeded 80/10/10 split by conversation (``pipeline.data.splits``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.dialogue import Dialogue
from pipeline.data.formats import ParseContext, find_one, merge_turns, need_root
from pipeline.data.splits import Split, assign_splits
from pipeline.errors import DataError

SEPARATOR = " +++$+++ "
ENCODING = "iso-8859-1"


@dataclass(frozen=True, slots=True)
class _Line:
    character: str
    movie: str
    name: str
    text: str


@dataclass(frozen=True, slots=True)
class _Conversation:
    id: str
    movie: str
    line_ids: tuple[str, ...]
    lineno: int


def _fields(line: str, n: int) -> list[str]:
    """Split a record into ``n`` fields; an empty last field loses its trailing space."""
    fields = line.split(SEPARATOR, n - 1)
    if len(fields) == n - 1 and fields[-1].endswith(SEPARATOR.rstrip()):
        fields[-1] = fields[-1][: -len(SEPARATOR.rstrip())]
        fields.append("")
    return fields


def _records(path: Path) -> Iterator[tuple[int, str]]:
    # Only "\n" ends a record: a stray "\r" inside a text is text.
    text = path.read_bytes().decode(ENCODING)
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            yield lineno, line


def _read_lines(path: Path, ctx: ParseContext) -> dict[str, _Line]:
    lines: dict[str, _Line] = {}
    for lineno, record in _records(path):
        fields = _fields(record, 5)
        if len(fields) != 5 or not fields[0].strip():
            ctx.bad_record(DataError(path, f"expected 5 fields separated by {SEPARATOR!r}", lineno))
            continue
        line_id, character, movie, name, text = (f.strip() for f in fields)
        if line_id in lines:
            ctx.bad_record(DataError(path, f"duplicate line id {line_id}", lineno))
            continue
        lines[line_id] = _Line(character, movie, name, text)
    return lines


def _line_ids(literal: str) -> tuple[str, ...]:
    try:
        value = ast.literal_eval(literal.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"line ids {literal.strip()!r} are not a list literal") from None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"line ids {literal.strip()!r} are not a non-empty list of strings")
    return tuple(value)


def _read_conversations(path: Path, ctx: ParseContext) -> list[_Conversation]:
    conversations: list[_Conversation] = []
    seen: set[str] = set()
    for lineno, record in _records(path):
        fields = _fields(record, 4)
        try:
            if len(fields) != 4:
                raise ValueError(f"expected 4 fields separated by {SEPARATOR!r}")
            movie = fields[2].strip()
            line_ids = _line_ids(fields[3])
            cid = f"{movie}-{line_ids[0]}"
            if cid in seen:
                raise ValueError(f"a second conversation starting at {line_ids[0]}")
        except ValueError as err:
            ctx.bad_record(DataError(path, str(err), lineno))
            continue
        seen.add(cid)
        conversations.append(_Conversation(cid, movie, line_ids, lineno))
    return conversations


def read(root: Path | None, split: Split | None, ctx: ParseContext) -> Iterator[Dialogue]:
    """Conversations of ``root/**/movie_{lines,conversations}.txt`` in file order."""
    root = need_root(root, "cornell")
    lines_path = find_one(root, r"movie_lines\.txt", "Cornell movie_lines.txt")
    conv_path = find_one(root, r"movie_conversations\.txt", "Cornell movie_conversations.txt")
    lines = _read_lines(lines_path, ctx)
    conversations = _read_conversations(conv_path, ctx)
    assignment = assign_splits((c.id for c in conversations), ctx.split)
    for conv in conversations:
        if split is not None and assignment[conv.id] is not split:
            continue
        missing = [i for i in conv.line_ids if i not in lines]
        if missing:
            reason = f"conversation refers to lines missing from {lines_path.name}: {missing}"
            ctx.bad_record(DataError(conv_path, reason, conv.lineno))
            continue
        records = [lines[i] for i in conv.line_ids]
        turns = merge_turns(((r.character, r.text) for r in records), ctx)
        if not turns:
            continue
        meta = {
            "split": assignment[conv.id].value,
            "movie": conv.movie,
            "characters": {r.character: r.name for r in records},
        }
        yield ctx.emit(Dialogue(conv.id, turns, meta))
