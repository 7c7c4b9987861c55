"""DSTC7 track 1 (response selection), Ubuntu and Advising JSON files.

A file is a JSON list of examples ``{"example-id", "messages-so-far": [{"speaker",
"utterance"}], "options-for-correct-answers": [{"candidate-id", "utterance"}],
"options-for-next": [{"candidate-id", "utterance"}, ...]}``; Advising adds ``profile``.
Each example becomes a Dialogue whose turns are the non-empty ``messages-so-far`` (one
turn per message: consecutive messages of one speaker stay apart), with
``meta["candidates"]`` (``[{"id", "text"}]`` from ``options-for-next``),
``meta["correct_ids"]`` (the correct answers found among the candidates: empty when the
answer is "NONE", as in subtask 4; None when the file carries no answers),
``meta["responses"]`` (the true next utterances' texts), ``meta["profile"]`` (Advising),
``meta["dataset"]`` and ``meta["subtask"]``.

File names: ``ubuntu_{train,dev,test}_subtask_N[_variant].json`` and
``advising.scenario-N.{train,dev,test}[.variant].json``; ``variant`` selects e.g. ParlAI's
``augmented`` training file (plain files by default). Unlabelled Ubuntu test files take
their answers from ``ubuntu_responses_subtask_N.tsv`` (``example-id<TAB>candidate-id<TAB>
utterance``) where it sits beside them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.formats import ParseContext, find_files, load_json, need_root
from pipeline.data.splits import Split
from pipeline.errors import DataError

NONE_ID = "NONE"
# Subtasks whose correct answer is always among the candidates.
_ANSWER_AMONG_CANDIDATES = frozenset({1, 3, 5})
_NAME_PATTERNS = (
    re.compile(
        r"(?P<dataset>ubuntu)_(?P<split>train|dev|valid|test)_subtask_(?P<subtask>\d+)(?:_(?P<variant>\w+))?\.json"
    ),
    re.compile(
        r"(?P<dataset>advising)\.scenario-(?P<subtask>\d+)\.(?P<split>train|dev|valid|test)(?:\.(?P<variant>\w+))?\.json"
    ),
)


@dataclass(frozen=True, slots=True)
class _File:
    path: Path
    dataset: str
    split: Split
    subtask: int
    variant: str | None


def _describe(path: Path) -> _File | None:
    for pattern in _NAME_PATTERNS:
        match = pattern.fullmatch(path.name)
        if match:
            return _File(
                path,
                match["dataset"],
                Split.parse(match["split"]),
                int(match["subtask"]),
                match["variant"],
            )
    return None


def _responses(file: _File) -> dict[str, list[dict[str, str]]]:
    """Answers of an unlabelled file from its ``*_responses_subtask_N.tsv``, if present."""
    path = file.path.with_name(f"{file.dataset}_responses_subtask_{file.subtask}.tsv")
    if not path.is_file():
        return {}
    answers: dict[str, list[dict[str, str]]] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.split("\t")
        if len(fields) < 3:
            raise DataError(path, "expected example-id<TAB>candidate-id<TAB>utterance", lineno)
        answers.setdefault(fields[0], []).append(
            {"candidate-id": fields[1], "utterance": fields[2]}
        )
    return answers


def _options(file: _File, where: str, raw: Any, key: str) -> list[dict[str, str]]:
    if not isinstance(raw, list):
        raise DataError(file.path, f"{where}: {key!r} must be a list")
    options = []
    for option in raw:
        if not isinstance(option, dict) or not isinstance(option.get("utterance"), str):
            raise DataError(
                file.path, f"{where}: each of {key!r} needs 'candidate-id' and 'utterance'"
            )
        options.append({"id": str(option.get("candidate-id")), "text": option["utterance"].strip()})
    return options


def _example(
    file: _File, index: int, raw: Any, answers: dict[str, list[dict[str, str]]], ctx: ParseContext
) -> Dialogue:
    if not isinstance(raw, dict) or "example-id" not in raw:
        raise DataError(file.path, f"example {index}: expected an object with 'example-id'")
    example_id = str(raw["example-id"])
    where = f"example {index} (id {example_id})"
    messages = raw.get("messages-so-far")
    if not isinstance(messages, list) or not messages:
        raise DataError(file.path, f"{where}: 'messages-so-far' must be a non-empty list")
    turns = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("utterance"), str):
            raise DataError(file.path, f"{where}: each message needs 'speaker' and 'utterance'")
        text = message["utterance"].strip()
        if not text:  # an empty message says nothing; the recurrence is over utterances
            ctx.stats.empty_texts += 1
            continue
        turns.append(Turn(str(message.get("speaker")), text))
    if not turns:
        raise DataError(file.path, f"{where}: every message of 'messages-so-far' is empty")
    if "options-for-next" not in raw:
        raise DataError(
            file.path, f"{where}: no 'options-for-next' (subtask 2's global pool is not supported)"
        )
    candidates = _options(file, where, raw["options-for-next"], "options-for-next")
    correct_raw = raw.get("options-for-correct-answers", answers.get(example_id))
    correct_ids: list[str] | None = None
    responses: list[str] = []
    if correct_raw is not None:
        correct = _options(file, where, correct_raw, "options-for-correct-answers")
        candidate_ids = {c["id"] for c in candidates}
        responses = [c["text"] for c in correct if c["id"] != NONE_ID]
        correct_ids = [c["id"] for c in correct if c["id"] in candidate_ids]
        missing = [c["id"] for c in correct if c["id"] not in candidate_ids and c["id"] != NONE_ID]
        if missing and file.subtask in _ANSWER_AMONG_CANDIDATES:
            raise DataError(
                file.path, f"{where}: correct answer(s) {missing} not among the candidates"
            )
    meta: dict[str, Any] = {
        "split": file.split.value,
        "dataset": file.dataset,
        "subtask": file.subtask,
        "example_id": example_id,
        "candidates": candidates,
        "correct_ids": correct_ids,
        "responses": responses,
    }
    if "profile" in raw:
        meta["profile"] = raw["profile"]
    return Dialogue(f"{file.path.stem}:{example_id}", tuple(turns), meta)


def read(
    root: Path | None,
    split: Split | None,
    ctx: ParseContext,
    *,
    dataset: str | None = None,
    subtask: int | None = None,
    variant: str | None = None,
) -> Iterator[Dialogue]:
    """Examples of every DSTC7 file under ``root`` matching split, dataset, subtask, variant."""
    root = need_root(root, "dstc7")
    files = [f for p in find_files(root, r".*\.json") if (f := _describe(p)) is not None]
    chosen = [
        f
        for f in files
        if (split is None or f.split is split)
        and (dataset is None or f.dataset == dataset)
        and (subtask is None or f.subtask == subtask)
        and f.variant == variant
    ]
    if not chosen:
        raise DataError(
            root,
            f"no DSTC7 file for split={split}, dataset={dataset}, subtask={subtask}, "
            f"variant={variant} (found: {[f.path.name for f in files]})",
        )
    for file in chosen:
        data = load_json(file.path)
        if not isinstance(data, list):
            raise DataError(file.path, "expected a JSON list of examples")
        answers = _responses(file)
        for index, raw in enumerate(data):
            try:
                yield ctx.emit(_example(file, index, raw, answers, ctx))
            except DataError as err:
                ctx.bad_record(err)
