"""Penn Treebank (Mikolov's preprocessing): ``ptb.{train,valid,test}.txt``.

One sentence per line, lowercased, ``N`` for numbers, ``<unk>`` for rare words; lines begin
and end with a space, which is stripped. For language modelling a "document" is a run of
``sentences_per_document`` consecutive sentences (the last one may be shorter); each
sentence is a turn of the speaker ``narrator``. Official splits from the file names.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.formats import ParseContext, find_one, need_root
from pipeline.data.splits import Split
from pipeline.errors import DataError

SPEAKER = "narrator"


def _sentences(path: Path, ctx: ParseContext) -> Iterator[str]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                sentence = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                ctx.bad_record(DataError(path, f"not UTF-8 text: {err.reason}", line=lineno))
                continue
            if not sentence:
                ctx.stats.empty_texts += 1
                continue
            yield sentence


def read(
    root: Path | None,
    split: Split | None,
    ctx: ParseContext,
    *,
    sentences_per_document: int = 10,
) -> Iterator[Dialogue]:
    """Documents of ``sentences_per_document`` sentences from each requested split file."""
    root = need_root(root, "ptb")
    if sentences_per_document < 1:
        raise ValueError("sentences_per_document must be at least 1")
    for part in [split] if split is not None else list(Split):
        path = find_one(root, rf"ptb\.{part.value}\.txt", f"PTB {part.value} file")
        document: list[Turn] = []
        index = 0
        for sentence in _sentences(path, ctx):
            document.append(Turn(SPEAKER, sentence))
            if len(document) == sentences_per_document:
                yield ctx.emit(
                    Dialogue(f"ptb.{part.value}.{index}", tuple(document), {"split": part.value})
                )
                document, index = [], index + 1
        if document:
            yield ctx.emit(
                Dialogue(f"ptb.{part.value}.{index}", tuple(document), {"split": part.value})
            )
