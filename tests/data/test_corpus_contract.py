"""The corpus contract: every built-in corpus (``corpora.CORPORA``, one spec per
``names.CorpusName``) and every declared format (``SourceFormat``, one reader each in
``declared.READERS``), read through ``read_corpus`` as the stages read them, yields valid
splits and well-formed dialogues with the traits its spec states, names or counts a
malformed record, and takes exactly the options its spec declares.

The cases come from the registry, and each corpus's data from where it lies, so a new
corpus or format is tested once its data is there, with no edit here:

- well-formed: ``tests/fixtures/<corpus>/`` if present, else the installed package of a
  bundled corpus, else its files in the real-corpora mirror, fetched by the download stage
  (``SourceFile.mirror_path``; slow: real corpora); a declared format: the one file in
  ``tests/fixtures/declared/<format>/``, declared in params and downloaded as users do;
- malformed: ``tests/fixtures/malformed/<corpus>/`` (``malformed/declared/<format>/``) with,
  beside it, ``<corpus>.json``: the ``file`` its error names, the ``line`` or the ``record``
  it names, and how many records ``on_error: skip`` counts (``skipped``) and how many
  dialogues it still yields (``dialogues``).
"""

from __future__ import annotations

import ast
import inspect
import json
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.config import CorpusParams, CorpusSource, DownloadParams, SourceFormat
from pipeline.config.data import FormatTraits
from pipeline.data.corpora import (
    CORPORA,
    CorpusSpec,
    corpus_spec,
    declared_reader_spec,
    read_corpus,
)
from pipeline.data.declared import READERS
from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.download import download_corpus
from pipeline.data.formats import ParseStats
from pipeline.data.splits import Split
from pipeline.errors import ConfigError, DataError
from pipeline.names import CorpusName, one_per_name

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
MALFORMED = FIXTURES / "malformed"
BUILT_IN = sorted(map(str, CORPORA))
FORMATS = [f.value for f in SourceFormat]
SPLITS = {s.value for s in Split}
MINE = "mine"  # the name a declared corpus takes here


def _built_in_cases() -> list[object]:
    """Each built-in corpus; slow where it is read from a real corpus, not a fixture."""
    return [
        pytest.param(name, id=name, marks=() if (FIXTURES / name).is_dir() else pytest.mark.slow)
        for name in BUILT_IN
    ]


@dataclass(frozen=True)
class Corpus:
    """A corpus to read as the stages do: its name, spec and download folder."""

    name: str
    spec: CorpusSpec
    root: Path | None

    def read(
        self, split: str | None = None, on_error: str = "raise"
    ) -> tuple[list[Dialogue], ParseStats]:
        stats = ParseStats()
        found = read_corpus(self.name, self.root, split, on_error, stats=stats)
        return list(found), stats


def _from_mirror(spec: CorpusSpec, mirror: Path, dest: Path) -> Path:
    """The corpus's files the mirror holds, fetched by the download stage; the splits whose
    files it lacks are skipped (``download.skip``), as on a machine without them."""
    absent = [f for f in spec.files if not (mirror / f.mirror_path).is_file()]
    whole = [f.path for f in absent if f.split is None]
    if whole or len(absent) == len(spec.files):
        pytest.fail(
            f"{spec.name}: no tests/fixtures/{spec.name}/ and the mirror lacks "
            f"{whole or 'every file'}: add that folder, written from the format's spec"
        )
    skip = {spec.name: tuple(sorted({str(f.split) for f in absent}))}
    params = DownloadParams(mirror=str(mirror), skip=skip)
    return download_corpus(spec.name, dest, params, progress=False)


def _built_in(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> Corpus:
    spec = CORPORA[name]
    if (FIXTURES / name).is_dir():
        return Corpus(name, spec, FIXTURES / name)
    if spec.bundled is not None:
        return Corpus(name, spec, None)
    mirror = request.getfixturevalue("shared_data")
    return Corpus(name, spec, _from_mirror(spec, mirror, tmp_path / "raw"))


def _declared(form: str, folder: Path, project: Path) -> tuple[Corpus, str]:
    """The one file of ``folder`` declared in params as a corpus of format ``form`` (from
    the project ``project``, the working folder) and downloaded: the corpus, and the file
    as declared."""
    (file,) = [p for p in folder.iterdir() if p.is_file()]
    declared = f"{MINE}/{file.name}"
    (project / MINE).mkdir(exist_ok=True)
    shutil.copyfile(file, project / declared)
    source = CorpusSource(format=form, file=declared)
    raw = download_corpus(MINE, project / "raw", DownloadParams(), False, source)
    spec = corpus_spec(MINE, source)
    assert declared_reader_spec(MINE, raw) == spec  # the folder alone reads as params say
    return Corpus(MINE, spec, raw), declared


# --------------------------------------------------------------------------- the rules


def check_dialogues(spec: CorpusSpec, dialogues: list[Dialogue], stats: ParseStats) -> None:
    """Well-formed dialogues with the traits ``spec`` states, counted in ``stats``."""
    name = spec.name
    assert dialogues, f"{name}: no dialogue"
    ids = [d.id for d in dialogues]
    assert all(isinstance(i, str) and i for i in ids), f"{name}: an id is not a non-empty string"
    twice = sorted(i for i, n in Counter(ids).items() if n > 1)
    assert not twice, f"{name}: ids {twice[:5]} name several dialogues"
    turns = [t for d in dialogues for t in d.turns]
    for d in dialogues:
        assert isinstance(d.turns, tuple) and d.turns, f"{name}/{d.id}: no turns"
        assert d.meta.get("split") in SPLITS, f"{name}/{d.id}: split {d.meta.get('split')!r}"
        for turn in d.turns:
            assert isinstance(turn, Turn) and isinstance(turn.text, str)
            assert isinstance(turn.speaker, str) and turn.speaker, f"{name}/{d.id}: a speaker"
            assert turn.text == turn.text.strip(), f"{name}/{d.id}: unstripped {turn.text!r}"
            if not spec.acts:
                assert turn.acts is None and turn.belief is None, f"{name}/{d.id}: acts"
            if not spec.task_oriented:
                assert not turn.booked, f"{name}/{d.id}: a booking outside MultiWOZ"
    empty = sum(1 for t in turns if not t.text)
    assert empty <= stats.empty_texts, f"{name}: {empty} empty turns, {stats.empty_texts} counted"
    if not spec.empty_turns:
        assert empty == 0, f"{name}: {empty} empty turns, and its spec keeps none"
    if spec.acts:
        assert any(t.acts for t in turns), f"{name}: acts in its spec, none in its turns"
    if spec.responder is not None:
        speakers = sorted({t.speaker for t in turns})
        assert spec.responder in speakers, f"{name}: responder {spec.responder}, {speakers}"
    assert (stats.dialogues, stats.turns) == (len(dialogues), len(turns))
    assert stats.single_turn == sum(1 for d in dialogues if len(d.turns) < 2)


def check_splits(corpus: Corpus, dialogues: list[Dialogue]) -> None:
    """Each split read alone yields that split's dialogues of the whole read, in order."""
    for split in sorted({str(d.meta["split"]) for d in dialogues}):
        part, _ = corpus.read(split)
        expected = [d.id for d in dialogues if d.meta["split"] == split]
        assert [d.id for d in part] == expected, f"{corpus.name}: split {split}"


def check_malformed(corpus: Corpus, expected: dict, named: str | None) -> None:
    """The error of a malformed record names its file (``named``: exactly, as declared)
    and its line or record; ``on_error: skip`` counts it under that file and reads on."""
    with pytest.raises(DataError) as raised:
        corpus.read()
    err = raised.value
    assert Path(err.path).name == expected["file"]
    if named is not None:
        assert err.path == named
    if "line" in expected:
        assert err.line == expected["line"], str(err)
    else:
        assert expected["record"] in err.reason, str(err)
    dialogues, stats = corpus.read(on_error="skip")
    assert stats.skipped == {err.path: expected["skipped"]}
    assert len(dialogues) == expected["dialogues"]
    stats.skipped.clear()
    check_dialogues(corpus.spec, dialogues, stats)


def check_options(corpus: Corpus) -> None:
    """The parser takes ``(root, split, ctx)`` and, by keyword, exactly the options the
    spec declares, each with a default; an option params set has the params default as
    its default (``read_corpus`` without it reads as tokenize does by default);
    ``read_corpus`` refuses any other."""
    spec = corpus.spec
    params = list(inspect.signature(spec.parser).parameters.values())
    keyword = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert [p.name for p in params if p.name not in keyword] == ["root", "split", "ctx"]
    assert set(keyword) == set(spec.options)
    assert inspect.Parameter.empty not in keyword.values()
    for option, value in spec.params_options(CorpusParams()).items():
        assert value == keyword[option], f"{spec.name}: {option} defaults differ"
    with pytest.raises(ConfigError, match=rf"read_corpus\.not_an_option: {spec.name} takes only"):
        read_corpus(corpus.name, corpus.root, not_an_option=1)


# --------------------------------------------------------------------------- built-in corpora


def test_every_corpus_name_has_one_spec_and_every_format_one_reader() -> None:
    assert list(CORPORA) == list(CorpusName)
    assert all(CORPORA[name].name == name.value for name in CorpusName)
    assert list(READERS) == list(SourceFormat)
    assert all(isinstance(form.traits, FormatTraits) for form in SourceFormat)


def test_a_table_out_of_step_with_its_names_fails_on_import() -> None:
    ptb, chitchat = CORPORA["ptb"], CORPORA["chitchat"]
    entries = [(spec.name, spec) for spec in CORPORA.values()]
    with pytest.raises(TypeError, match=r"^T: no entry for ptb \(CorpusName\)$"):
        one_per_name(CorpusName, [e for e in entries if e[1] is not ptb], "T")
    with pytest.raises(TypeError, match=r"^T: 'chitchat' has two entries$"):
        one_per_name(CorpusName, [*entries, ("chitchat", chitchat)], "T")
    with pytest.raises(TypeError, match=r"'ubuntu' is not a CorpusName: add it to pipeline\."):
        one_per_name(CorpusName, [*entries, ("ubuntu", chitchat)], "T")


@pytest.mark.parametrize("name", _built_in_cases())
def test_a_built_in_corpus_reads_to_valid_splits_and_well_formed_dialogues(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    corpus = _built_in(name, tmp_path, request)
    dialogues, stats = corpus.read()
    check_dialogues(corpus.spec, dialogues, stats)
    assert stats.skipped_total == 0
    check_splits(corpus, dialogues)


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_malformed_record_of_a_built_in_corpus_is_named_or_counted(name: str) -> None:
    folder, expectation = MALFORMED / name, MALFORMED / f"{name}.json"
    assert folder.is_dir() and expectation.is_file(), (
        f"add {folder.relative_to(REPO)}/ (a corpus folder with one malformed record) and "
        f"{expectation.relative_to(REPO)} (what its error names and skip counts)"
    )
    corpus = Corpus(name, CORPORA[name], folder)
    check_malformed(corpus, json.loads(expectation.read_text()), None)


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_built_in_corpus_takes_the_options_its_spec_declares(name: str, tmp_path: Path) -> None:
    check_options(Corpus(name, CORPORA[name], tmp_path))


# --------------------------------------------------------------------------- declared formats


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # declared paths are from the project root, the stages' cwd
    return tmp_path


@pytest.mark.parametrize("form", FORMATS)
def test_a_declared_format_reads_to_valid_splits_and_well_formed_dialogues(
    form: str, project: Path
) -> None:
    corpus, _ = _declared(form, FIXTURES / "declared" / form, project)
    traits = SourceFormat(form).traits
    assert (corpus.spec.acts, corpus.spec.empty_turns) == (traits.acts, traits.empty_turns)
    dialogues, stats = corpus.read()
    check_dialogues(corpus.spec, dialogues, stats)
    check_splits(corpus, dialogues)
    check_options(corpus)
    reader = inspect.signature(READERS[SourceFormat(form)]).parameters
    assert list(reader) == ["path", "ctx", "shown_as"]


@pytest.mark.parametrize("form", FORMATS)
def test_a_malformed_record_of_a_declared_format_is_named_or_counted(
    form: str, project: Path
) -> None:
    folder = MALFORMED / "declared" / form
    corpus, declared = _declared(form, folder, project)
    expected = json.loads(folder.with_suffix(".json").read_text())
    check_malformed(corpus, expected, declared)


# --------------------------------------------------------------------------- one table of formats


def _spells_a_format(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id == "SourceFormat" and node.attr in SourceFormat.__members__
    return isinstance(node, ast.Constant) and node.value in FORMATS


def test_only_the_table_and_the_readers_spell_a_declared_format() -> None:
    """A format's traits are its row of ``SourceFormat``, its reader its entry in
    ``READERS``: no other code names a format or compares one (``if format == ...``)."""
    allowed = {REPO / "pipeline" / "config" / "data.py", REPO / "pipeline" / "data" / "declared.py"}
    found = []
    for path in sorted([*(REPO / "pipeline").rglob("*.py"), *(REPO / "stages").rglob("*.py")]):
        text = path.read_text(encoding="utf-8")
        if not any(word in text for word in ["SourceFormat", *FORMATS]):
            continue
        tree = ast.parse(text)
        for node in ast.walk(tree):
            compared = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            spelled = isinstance(node, ast.Attribute) and path not in allowed
            if any(_spells_a_format(n) for n in compared) or (spelled and _spells_a_format(node)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"format named outside its row and reader: {found}"
