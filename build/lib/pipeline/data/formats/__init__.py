"""Corpus parsers: each module reads one corpus's original files into ``Dialogue`` records.

Every parser of a built-in corpus is ``read(root, split, ctx, *, <options>) ->
Iterator[Dialogue]``, its keyword options exactly those its ``CorpusSpec.options`` declares;
a declared format's reader is ``read_file(path, ctx, *, shown_as)``, one file of a corpus
of one's own (``pipeline.data.declared``). ``tests/data/test_corpus_contract.py`` holds
every one of them to the same rules. This module holds what they share: the error policy
and counters (``ParseContext``/``ParseStats``), file lookup inside a downloaded folder, and
turn merging.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import SplitParams
from pipeline.data.dialogue import Dialogue, Turn
from pipeline.errors import DataError
from pipeline.names import OnError


@dataclass
class ParseStats:
    """What a parse produced and what it had to leave out; read it after iterating.

    ``skipped`` counts malformed records per file (only with ``on_error="skip"``), and
    ``by_reason`` by what was wrong (the error's ``kind``, ``malformed`` when it has none);
    ``empty_texts`` counts empty utterances met (dropped or kept, as the format says);
    ``single_turn`` counts yielded dialogues with fewer than two turns.
    """

    dialogues: int = 0
    turns: int = 0
    empty_texts: int = 0
    single_turn: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    by_reason: Counter[str] = field(default_factory=Counter)
    first_error: dict[str, DataError] = field(default_factory=dict)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def skip_messages(self) -> list[str]:
        """One line per file with skipped records, for the user."""
        return [
            f"skipped {n} malformed records in {path} (first: {self.first_error[path]})"
            for path, n in sorted(self.skipped.items())
        ]


@dataclass
class ParseContext:
    """One parse's settings (the error policy; ``split``: the seeded split of corpora
    without an official one, ``pipeline.data.splits``) and the counters it fills."""

    on_error: OnError = OnError.RAISE
    stats: ParseStats = field(default_factory=ParseStats)
    split: SplitParams = field(default_factory=SplitParams)

    def bad_record(self, err: DataError) -> None:
        """A record could not be parsed: raise, or count it and let the parser go on."""
        if self.on_error is OnError.RAISE:
            raise err
        self.stats.skipped[err.path] += 1
        self.stats.by_reason[getattr(err, "kind", "malformed")] += 1
        self.stats.first_error.setdefault(err.path, err)

    def emit(self, dialogue: Dialogue) -> Dialogue:
        """Count a dialogue on its way out."""
        self.stats.dialogues += 1
        self.stats.turns += len(dialogue.turns)
        if len(dialogue.turns) < 2:
            self.stats.single_turn += 1
        return dialogue


def need_root(root: Path | None, corpus: str) -> Path:
    """``root`` of a corpus that has no built-in copy."""
    if root is None:
        raise DataError(
            "<root>",
            f"{corpus} needs root: the folder the download stage filled (data/raw/{corpus})",
        )
    return root


def find_files(root: Path, pattern: str) -> list[Path]:
    """Files under ``root`` (any depth) whose name fully matches the regex ``pattern``.

    Archives unpack into folders of their own (``personachat/``, ``cornell movie-dialogs
    corpus/``), so parsers look by name rather than by fixed path; macOS resource forks
    and hidden files are not data.
    """
    if not root.is_dir():
        raise DataError(
            root, "no such folder; download the corpus first (python -m stages.download)"
        )
    regex = re.compile(pattern)
    found = [
        p
        for p in root.rglob("*")
        if p.is_file()
        and regex.fullmatch(p.name)
        and not any(
            part == "__MACOSX" or part.startswith(".") for part in p.relative_to(root).parts
        )
    ]
    return sorted(found)


def find_one(root: Path, pattern: str, what: str) -> Path:
    """The single file under ``root`` named like ``pattern``; a clear error for none or several."""
    found = find_files(root, pattern)
    if not found:
        raise DataError(root, f"no {what} found here (looked for files named {pattern!r})")
    if len(found) > 1:
        listed = ", ".join(str(p.relative_to(root)) for p in found)
        raise DataError(
            root, f"several {what} found ({listed}); point root at one of their folders"
        )
    return found[0]


def load_json(path: Path, text: str | bytes | None = None) -> Any:
    """Parse JSON from ``path`` (or from ``text`` read out of it); syntax errors name the line."""
    try:
        if text is None:
            text = path.read_bytes()
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(path, f"invalid JSON: {err.msg}", line=err.lineno) from None
    except UnicodeDecodeError as err:
        raise DataError(path, f"not UTF-8 text: {err}") from None


def merge_turns(messages: Iterable[tuple[str, str]], ctx: ParseContext) -> tuple[Turn, ...]:
    """Turns from ``(speaker, text)`` messages: empty texts are dropped (and counted), and
    consecutive messages of one speaker are joined with a space, so speakers alternate."""
    turns: list[Turn] = []
    for speaker, raw in messages:
        text = raw.strip()
        if not text:
            ctx.stats.empty_texts += 1
            continue
        if turns and turns[-1].speaker == speaker:
            turns[-1] = Turn(speaker, f"{turns[-1].text} {text}")
        else:
            turns.append(Turn(speaker, text))
    return tuple(turns)
