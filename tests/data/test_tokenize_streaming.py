"""Streamed tokenize writes what tokenizing each split whole writes, for every corpus.

The reference is the corpus tokenized split by split in memory: ``read_splits`` lists
every dialogue, each split is encoded whole, its examples built whole (select negatives
drawn over the whole split) and written by ``write_shards``. The streamed stage
(``tokenize_corpus``) must write the same files, byte for byte, and the same manifest, for
every built-in corpus and every declared format, at any ``chunk_dialogues``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.artifacts import MANIFEST_FILE, TokenizeRecord
from pipeline.config import SourceFormat, TokenizeParams
from pipeline.data import tokenize
from pipeline.data.corpora import corpus_spec
from pipeline.data.encoding import encode_dialogues
from pipeline.data.formats import ParseStats
from pipeline.data.shards import write_shards
from pipeline.data.tokenize import build_examples, encode_options, read_splits, tokenize_corpus
from pipeline.errors import DataError, HiertxError
from pipeline.names import Task
from tests.data.test_corpus_contract import FIXTURES, MINE, _built_in, _built_in_cases, _declared

CHUNKS = (1, 4, 10_000)
SETTINGS = {
    "tasks": ["generate", "select", "lm"],
    "max_dialogues": 40,
    "vocab": {"size": 300},
    "select": {"n_candidates_train": 3, "n_candidates_eval": 4},
}


def reference(name: str, raw: Path | None, out: Path, params: TokenizeParams) -> TokenizeRecord:
    """The corpus tokenized with every split in memory, encoded and built whole."""
    corpus = params.corpora[name]
    stats = ParseStats()
    by_split = read_splits(name, raw, params, stats)
    train = by_split["train"]
    if not train:
        where = raw if raw is not None else name
        raise DataError(where, "no training dialogues: the vocabulary is built from train")
    options = encode_options(corpus_spec(name, corpus.source), corpus, train)
    vocab = tokenize._vocabulary(train, options, corpus, out)
    tasks = tuple(sorted(dict.fromkeys(corpus.tasks), key=list(Task).index))
    written = tokenize._Written.empty(tasks)
    for split, dialogues in by_split.items():
        encoded = encode_dialogues(dialogues, vocab, options)
        generated = None
        for task in tasks:
            examples = build_examples(task, encoded, corpus, split, generated)
            generated = examples if task is Task.GENERATE else generated
            files = write_shards(out, task, split, examples, params.shard_rows)
            written.add(task, split, examples.scored_tokens(), files)
    return written.record(name, vocab, options.inventory, stats, raw, params, corpus)


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }


def check_streamed_equals_whole(
    name: str, raw: Path | None, tmp_path: Path, source: dict | None = None, **settings: object
) -> None:
    corpus = {**SETTINGS, **settings} | ({"source": source} if source else {})
    base = {"on_error": "skip", "shard_rows": 7, "corpora": {name: corpus}}
    params = TokenizeParams.model_validate(base)
    try:
        expected = reference(name, raw, tmp_path / "whole", params)
    except (HiertxError, TypeError) as err:  # a corpus refused (or failing) fails alike
        with pytest.raises(type(err)) as caught:
            tokenize_corpus(name, raw, tmp_path / "refused", params)
        assert str(caught.value).endswith(str(err))  # the stage names the params key whole
        if "select" in corpus["tasks"]:  # a fixture too small for select: the other tasks
            less = {**settings, "tasks": ["generate", "lm"]}
            check_streamed_equals_whole(name, raw, tmp_path / "no-select", source, **less)
        return
    for chunk in CHUNKS:
        params = TokenizeParams.model_validate({**base, "chunk_dialogues": chunk})
        out = tmp_path / f"chunk-{chunk}"
        manifest = tokenize_corpus(name, raw, out, params)
        assert files_of(out) == files_of(tmp_path / "whole"), f"{name}, chunks of {chunk}"
        assert manifest.model_dump() == expected.model_dump(), f"{name}, chunks of {chunk}"
        assert TokenizeRecord.read(out / MANIFEST_FILE) == manifest


def _cases() -> list[object]:
    """Each built-in corpus; slow where it is read from a real corpus (chitchat's is
    read four times for each chunk size), not a fixture."""
    return [
        pytest.param(*case.values, id=case.id, marks=pytest.mark.slow)
        if case.values[0] == "chitchat"
        else case
        for case in _built_in_cases()
    ]


@pytest.mark.parametrize("name", _cases())
def test_every_built_in_corpus_streams_to_the_files_of_its_splits_built_whole(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    corpus = _built_in(name, tmp_path, request)
    check_streamed_equals_whole(name, corpus.root, tmp_path)


@pytest.mark.parametrize("form", [f.value for f in SourceFormat])
def test_every_declared_format_streams_to_the_files_of_its_splits_built_whole(
    form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    corpus, declared = _declared(form, FIXTURES / "declared" / form, tmp_path)
    source = {"format": form, "file": declared}
    split = {"seed": 3, "valid": 0.2, "test": 0.2}
    check_streamed_equals_whole(MINE, corpus.root, tmp_path, source, split=split)


@pytest.mark.slow
def test_split_variants_stream_to_the_files_of_their_splits_built_whole(
    tmp_path: Path, shared_data: Path
) -> None:
    """``train_on: valid`` (MultiWOZ 2.1's validation file, with acts) and
    ``resplit_train`` (PersonaChat's training file) plan their splits as read whole."""
    raw = shared_data / "multiwoz" / "convlab2"
    check_streamed_equals_whole("multiwoz21", raw, tmp_path / "mwz", train_on="valid")
    split = {"seed": 13, "valid": 0.1, "test": 0.1}
    persona = FIXTURES / "personachat"
    check_streamed_equals_whole(
        "personachat", persona, tmp_path / "pc", resplit_train=True, split=split
    )
