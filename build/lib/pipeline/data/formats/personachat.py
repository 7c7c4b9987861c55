"""PersonaChat / ConvAI2 in ParlAI text form (``valid_self_original_no_cands.txt``, ...).

Each line starts with a number that restarts at 1 for every dialogue. Persona lines
(``your persona: ...``, ``partner's persona: ...`` in ``both_*`` files) go to
``meta["persona"]`` / ``meta["partner_persona"]``. Every other line is an exchange
``partner utterance<TAB>self reply`` and, in files with candidates, ``<TAB><TAB>c1|c2|...``;
it gives two turns (``partner``, ``self``) and, if candidates are present, one entry of
``meta["candidates"]``. A partner ``__SILENCE__`` (the self speaks first) gives no turn.
Files are ``{train,valid,test}_{variant}[_no_cands].txt``; where both exist for a split the
one with candidates is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.formats import ParseContext, find_files, need_root
from pipeline.data.splits import Split
from pipeline.errors import DataError

SELF, PARTNER = "self", "partner"
SILENCE = "__SILENCE__"
_PERSONA_PREFIX = "your persona:"
_PARTNER_PERSONA_PREFIX = "partner's persona:"


class _Builder:
    """The dialogue being read: lines accumulate until the numbering restarts."""

    def __init__(self, dialogue_id: str, split: Split) -> None:
        self.id = dialogue_id
        self.split = split
        self.turns: list[Turn] = []
        self.persona: list[str] = []
        self.partner_persona: list[str] = []
        self.candidates: list[list[str]] = []
        self.has_candidates = False
        self.last_number = 0

    def dialogue(self) -> Dialogue:
        meta: dict[str, Any] = {
            "split": self.split.value,
            "persona": self.persona,
            "partner_persona": self.partner_persona,
        }
        if self.has_candidates:
            meta["candidates"] = self.candidates
        return Dialogue(self.id, tuple(self.turns), meta)


def _add_line(builder: _Builder, body: str, ctx: ParseContext) -> None:
    if body.startswith(_PERSONA_PREFIX):
        builder.persona.append(body[len(_PERSONA_PREFIX) :].strip())
        return
    if body.startswith(_PARTNER_PERSONA_PREFIX):
        builder.partner_persona.append(body[len(_PARTNER_PERSONA_PREFIX) :].strip())
        return
    fields = body.split("\t")
    if len(fields) < 2:
        raise ValueError("an exchange needs 'partner utterance<TAB>self reply'")
    partner, reply = fields[0].strip(), fields[1].strip()
    for text in (partner, reply):
        if not text:
            ctx.stats.empty_texts += 1
    if partner != SILENCE:
        builder.turns.append(Turn(PARTNER, partner))
    builder.turns.append(Turn(SELF, reply))
    candidates = fields[3].split("|") if len(fields) > 3 and fields[3].strip() else []
    builder.has_candidates = builder.has_candidates or bool(candidates)
    builder.candidates.append([c.strip() for c in candidates])


def _read_file(path: Path, split: Split, ctx: ParseContext) -> Iterator[Dialogue]:
    builder: _Builder | None = None
    count = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
                number_text, _, body = line.partition(" ")
                if not number_text.isdigit():
                    raise ValueError("a line must start with its number within the dialogue")
                number = int(number_text)
                if number == 1 or builder is None:
                    if builder is not None and builder.turns:
                        yield ctx.emit(builder.dialogue())
                    builder = _Builder(f"{path.stem}:{count}", split)
                    count += 1
                elif number != builder.last_number + 1:
                    raise ValueError(f"line number {number} does not follow {builder.last_number}")
                builder.last_number = number
                _add_line(builder, body, ctx)
            except (ValueError, UnicodeDecodeError) as err:
                ctx.bad_record(DataError(path, str(err), line=lineno))
    if builder is not None and builder.turns:
        yield ctx.emit(builder.dialogue())


def read(
    root: Path | None,
    split: Split | None,
    ctx: ParseContext,
    *,
    variant: str = "self_original",
) -> Iterator[Dialogue]:
    """Dialogues of the ``variant`` files (``self_original``, ``both_revised``, ...)."""
    root = need_root(root, "personachat")
    pattern = rf"(train|valid|test)_{re.escape(variant)}(_no_cands)?\.txt"
    chosen: dict[Split, Path] = {}
    for path in find_files(root, pattern):
        match = re.fullmatch(pattern, path.name)
        assert match is not None  # find_files matched the same pattern
        part = Split.parse(match.group(1))
        with_candidates = match.group(2) is None
        if part not in chosen or with_candidates:
            chosen[part] = path
    wanted = [split] if split is not None else list(Split)
    if not any(part in chosen for part in wanted):
        raise DataError(
            root, f"no PersonaChat files named like {pattern!r} for {[s.value for s in wanted]}"
        )
    for part in wanted:
        if part in chosen:
            yield from _read_file(chosen[part], part, ctx)
