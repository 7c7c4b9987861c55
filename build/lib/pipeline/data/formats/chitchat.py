"""BYU Chit-Chat Challenge ``dataset.json`` (PyPI ``chitchat-dataset``).

``{conversation_id: {"messages": [[{"text", "timestamp", "sender"}, ...], ...], "start",
"prompt"?, "ratings"?}}``. A turn is the consecutive non-empty messages of one sender joined
with a space (empty messages are counted, not kept). Single-turn conversations are kept
here (``ParseStats.single_turn`` counts them); the generation builders drop them. No
official split: a seeded 80/10/10 split by conversation id (``pipeline.data.splits``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from pipeline.data.dialogue import Dialogue
from pipeline.data.formats import ParseContext, find_one, load_json, merge_turns
from pipeline.data.splits import Split, assign_splits
from pipeline.errors import DataError

PACKAGE = "chitchat_dataset"
FILE_NAME = "dataset.json"


def package_file() -> Path:
    """``dataset.json`` inside the installed ``chitchat-dataset`` package."""
    return Path(str(resources.files(PACKAGE).joinpath(FILE_NAME)))


def _messages(path: Path, cid: str, conv: Any) -> Iterator[tuple[str, str]]:
    if not isinstance(conv, dict) or not isinstance(conv.get("messages"), list):
        raise DataError(path, f"conversation {cid!r}: expected an object with a 'messages' list")
    for turn in conv["messages"]:
        if not isinstance(turn, list):
            raise DataError(path, f"conversation {cid!r}: a turn must be a list of messages")
        for message in turn:
            if not isinstance(message, dict):
                raise DataError(path, f"conversation {cid!r}: a message must be an object")
            text, sender = message.get("text"), message.get("sender")
            if not isinstance(text, str) or not isinstance(sender, str):
                raise DataError(path, f"conversation {cid!r}: message without text or sender")
            yield sender, text


def read(root: Path | None, split: Split | None, ctx: ParseContext) -> Iterator[Dialogue]:
    """Conversations of ``root/**/dataset.json``, or of the installed package if no root."""
    path = (
        package_file()
        if root is None
        else find_one(root, re.escape(FILE_NAME), "chitchat dataset.json")
    )
    data = load_json(path)
    if not isinstance(data, dict):
        raise DataError(path, "expected a JSON object {conversation_id: conversation}")
    # Split over every id in the file, so a skipped record does not shift the others.
    assignment = assign_splits(data, ctx.split)
    for cid, conv in data.items():
        if split is not None and assignment[cid] is not split:
            continue
        try:
            turns = merge_turns(_messages(path, cid, conv), ctx)
        except DataError as err:
            ctx.bad_record(err)
            continue
        if not turns:
            continue
        meta: dict[str, Any] = {"split": assignment[cid].value}
        for key in ("prompt", "ratings", "start"):
            if key in conv:
                meta[key] = conv[key]
        yield ctx.emit(Dialogue(cid, turns, meta))
