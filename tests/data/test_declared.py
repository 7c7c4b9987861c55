"""Corpora declared in params: the download stage's links and records, ``read_corpus`` from
the folder alone, the seeded split, per-split files, sha256 checks, and tokenize's counts and
errors for records as people export them."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from pipeline.artifacts import SOURCES_FILE, DownloadRecord
from pipeline.config import CorpusSource, DownloadParams, SourceFormat, TokenizeParams, parse_params
from pipeline.data.corpora import corpus_spec, read_corpus
from pipeline.data.download import download_corpus
from pipeline.data.formats.convlab import SPEAKERS
from pipeline.data.tokenize import tokenize_corpus
from pipeline.errors import ConfigError, DataError, DownloadError
from pipeline.names import Task


def chat_line(*turns: str, id: str | None = None) -> str:
    roles = ["user", "assistant"]
    record: dict = {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}
    if id is not None:
        record["id"] = id
    return json.dumps(record, ensure_ascii=False)


def chat_file(path: Path, n: int = 40, extra: list[str] | None = None) -> Path:
    lines = [
        chat_line(f"hello number {i}", f"hi there {i}", f"how is it {i}", f"fine {i} thanks")
        for i in range(n)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*lines, *(extra or [])]) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # relative sources are from the project root, the stage's cwd
    chat_file(tmp_path / "mine" / "chat.jsonl")
    return tmp_path


def download(declared: CorpusSource) -> Path:
    return download_corpus("mychats", "data/raw", DownloadParams(), False, declared)


def source(**fields: object) -> CorpusSource:
    return CorpusSource.model_validate({"format": "chat_jsonl", **fields})


def test_a_local_file_is_linked_verified_and_recorded(project: Path) -> None:
    folder = download_corpus(
        "mychats", "data/raw", DownloadParams(), False, source(file="mine/chat.jsonl")
    )
    link = folder / "all.jsonl"
    assert link.is_symlink() and link.resolve() == (project / "mine" / "chat.jsonl").resolve()
    assert not Path(link.readlink()).is_absolute()  # a copied project reads its own file
    record = DownloadRecord.read(folder / SOURCES_FILE)
    assert record.declared == source(file="mine/chat.jsonl")
    assert record.split_files == {"all": "all.jsonl"}
    assert record.files["all.jsonl"].url == "mine/chat.jsonl"


def test_read_corpus_needs_no_params_and_splits_by_dialogue(project: Path) -> None:
    folder = download_corpus(
        "mychats", "data/raw", DownloadParams(), False, source(file="mine/chat.jsonl")
    )
    splits = {
        s: [d.id for d in read_corpus("mychats", folder, s)] for s in ("train", "valid", "test")
    }
    assert sorted(len(v) for v in splits.values()) == [4, 4, 32]
    assert not set(splits["train"]) & set(splits["test"])
    whole = list(read_corpus("mychats", folder))
    assert {d.meta["split"] for d in whole} == {"train", "valid", "test"} and len(whole) == 40
    assert [t.speaker for t in whole[0].turns] == ["user", "assistant", "user", "assistant"]


def test_a_file_per_split_gives_its_dialogues_that_split(project: Path) -> None:
    for split in ("train", "valid", "test"):
        chat_file(project / "per" / f"{split}.jsonl", n=4 if split != "train" else 10)
    declared = source(splits={s: {"file": f"per/{s}.jsonl"} for s in ("train", "valid", "test")})
    folder = download(declared)
    assert {len(list(read_corpus("mychats", folder, s))) for s in ("valid", "test")} == {4}
    assert len(list(read_corpus("mychats", folder, "train"))) == 10


def test_a_pinned_sha256_is_checked_on_every_run(project: Path) -> None:
    wrong = "0" * 64
    with pytest.raises(
        DownloadError, match=r"tokenize\.corpora\.mychats\.source\.sha256: .*changed"
    ):
        download_corpus(
            "mychats",
            "data/raw",
            DownloadParams(),
            False,
            source(file="mine/chat.jsonl", sha256=wrong),
        )
    with pytest.raises(DownloadError, match="no such file"):
        download(source(file="nope.jsonl"))


def test_file_urls_and_absolute_paths_are_local_files(project: Path) -> None:
    path = (project / "mine" / "chat.jsonl").resolve()
    for where in (str(path), path.as_uri()):
        folder = download(source(file=where))
        assert (folder / "all.jsonl").resolve() == path


def test_the_spec_has_the_traits_of_its_format() -> None:
    chat = corpus_spec("mychats", source(file="a.jsonl", targets="assistant"))
    assert (chat.acts, chat.responder, chat.task_oriented) == (False, "assistant", False)
    assert corpus_spec("mychats", source(file="a.jsonl")).responder is None
    convlab = corpus_spec("mine", CorpusSource(format="convlab_unified", file="data.zip"))
    assert (convlab.acts, convlab.responder) == (True, SPEAKERS[1])
    with pytest.raises(ConfigError, match=r"built in: .*declare its file and format"):
        corpus_spec("mychats")


@pytest.mark.parametrize(
    ("source_fields", "key", "reason"),
    [
        (
            {"splits": {s: {"file": f"{s}.json"} for s in ("train", "valid", "test")}},
            "splits",
            "a ConvLab data.zip holds its own splits: give one file",
        ),
        (
            {"file": "d.zip", "targets": "user"},
            "targets",
            "a ConvLab data.zip answers as the system",
        ),
    ],
)
def test_a_formats_traits_decide_what_its_source_may_say(
    source_fields: dict, key: str, reason: str
) -> None:
    """ConvLab's row (``own_splits``, ``answers_as``) refuses what a chat file takes."""

    def params(form: str) -> dict:
        declared = {"format": form, **source_fields}
        return {"corpora": ["mine"], "tokenize": {"corpora": {"mine": {"source": declared}}}}

    with pytest.raises(ConfigError) as err:
        parse_params(params("convlab_unified"))
    assert err.value.key == f"tokenize.corpora.mine.source.{key}"
    assert err.value.reason.startswith(reason)
    traits = SourceFormat.CHAT_JSONL.traits
    assert not traits.own_splits and traits.answers_as is None
    parse_params(params("chat_jsonl"))


def tokenize(project: Path, declared: CorpusSource, on_error: str = "raise", **corpus: object):
    folder = download(declared)
    params = TokenizeParams.model_validate(
        {
            "on_error": on_error,
            "corpora": {
                "mychats": {
                    "source": declared.model_dump(),
                    "tasks": ["generate", "select", "lm"],
                    "vocab": {"size": 200},
                    "select": {"n_candidates_train": 2, "n_candidates_eval": 2},
                    **corpus,
                }
            },
        }
    )
    return tokenize_corpus("mychats", folder, project / "data" / "shards" / "mychats", params)


BAD = [
    chat_line("fine", "ok") + "\r",  # a Windows line ending: fine
    "",
    '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null}]}',
    '{"messages": [{"role": "tool", "content": "x"}]}',
    "not json at all",
    chat_line("only one turn"),
]


def test_a_bad_line_stops_tokenize_naming_the_declared_file_line_and_field(project: Path) -> None:
    chat_file(project / "mine" / "chat.jsonl", extra=BAD)
    with pytest.raises(DataError) as err:
        tokenize(project, source(file="mine/chat.jsonl"))
    assert str(err.value) == "mine/chat.jsonl:43: messages[1].content: expected a string, got null"


def test_skipped_records_are_counted_by_reason(project: Path) -> None:
    chat_file(project / "mine" / "chat.jsonl", extra=BAD)
    record = tokenize(project, source(file="mine/chat.jsonl"), on_error="skip")
    assert record.skipped_by_reason == {"bad_content": 1, "bad_json": 1, "bad_role": 1}
    assert record.skipped["malformed_records"] == 3
    assert record.skipped["single_turn_dialogues"] == 1  # counted, not an error
    assert record.rows(Task.GENERATE, "train") > 0 and record.rows(Task.LM, "train") > 0


CHAT_FIX = (
    'write its dialogues as one JSON object per line, {"messages": [{"role": "user", '
    '"content": "Hi"}, {"role": "assistant", "content": "Hello"}]}, or point '
    "tokenize.corpora.mychats.source.file at the file that holds them"
)


@pytest.mark.parametrize(
    ("content", "what"),
    [
        ("", "the file is empty"),
        ("\n \n\r\n", "the file is empty"),
        (
            '{"messages": [{"role": "system", "content": "Be brief."}]}\n',
            "no dialogue with a turn in the file",
        ),
    ],
)
def test_a_chat_file_without_dialogues_stops_naming_the_declared_file_and_the_fix(
    project: Path, content: str, what: str
) -> None:
    """Issue 34, item 6: the user's own path as declared (not data/raw/mychats), what is
    wrong with it, and the fix, on one line, before any vocabulary is built."""
    (project / "mine" / "empty.jsonl").write_text(content)
    with pytest.raises(DataError) as err:
        tokenize(project, source(file="mine/empty.jsonl"))
    assert str(err.value) == f"mine/empty.jsonl: {what}: {CHAT_FIX}"


def test_a_declared_file_without_dialogues_is_named_by_its_own_key(project: Path) -> None:
    for split in ("train", "test"):
        chat_file(project / "per" / f"{split}.jsonl", n=4)
    (project / "per" / "valid.jsonl").write_text("")
    declared = source(splits={s: {"file": f"per/{s}.jsonl"} for s in ("train", "valid", "test")})
    with pytest.raises(
        DataError,
        match=r"^per/valid\.jsonl: the file is empty: .* point "
        r"tokenize\.corpora\.mychats\.source\.splits\.valid\.file at",
    ):
        tokenize(project, declared)
    (project / "mine" / "bad.jsonl").write_text("not json\n" + BAD[3] + "\n")
    with pytest.raises(
        DataError,
        match=r"^mine/bad\.jsonl: no dialogue in the file: its 2 "
        r"malformed records were skipped \(tokenize\.on_error: skip\): write",
    ):
        tokenize(project, source(file="mine/bad.jsonl"), on_error="skip")
    (project / "mine" / "none.json").write_text("[]")
    convlab = CorpusSource(format="convlab_unified", file="mine/none.json")
    with pytest.raises(
        DataError,
        match=r"^mine/none\.json: no dialogue with a turn in the "
        r"file: write its dialogues as ConvLab-3's unified format",
    ):
        tokenize(project, convlab)


def test_assistant_targets_answer_only_as_the_assistant(project: Path) -> None:
    every = tokenize(project, source(file="mine/chat.jsonl"))
    assistant = tokenize(project, source(file="mine/chat.jsonl", targets="assistant"))
    total = sum(every.rows(Task.GENERATE, s) for s in ("train", "valid", "test"))
    assert total == 40 * 3  # every turn after the first of 4-turn dialogues
    assert sum(assistant.rows(Task.GENERATE, s) for s in ("train", "valid", "test")) == 40 * 2


@pytest.mark.slow
def test_a_convlab_file_trains_hier_pp_on_the_acts_it_holds(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MultiWOZ 2.1 test dialogues in ConvLab-3's unified format (split 80/10/10 here),
    declared in params alone: the act inventory comes from the file, and HIER++ (an
    act-aware model) trains on it."""
    from pipeline.artifacts import MANIFEST_FILE, TokenizeRecord
    from pipeline.data.acts import ActInventory
    from pipeline.plan import RunRequest, checked
    from pipeline.train.training import train_seeds
    from tests.data.convlab_unified import data_zip, to_unified

    monkeypatch.chdir(tmp_path)
    with zipfile.ZipFile(shared_data / "multiwoz" / "convlab2" / "test.json.zip") as zf:
        raw = json.loads(zf.read(zf.namelist()[0]))
    names = sorted(raw)[:60]
    parts = {"train": names[:48], "validation": names[48:54], "test": names[54:]}
    dialogues = [
        d for split, ids in parts.items() for d in to_unified({i: raw[i] for i in ids}, split)
    ]
    (tmp_path / "data.zip").write_bytes(data_zip(dialogues))
    params = checked(
        {
            "corpora": ["mwz"],
            "tokenize": {
                "corpora": {
                    "mwz": {
                        "source": {"format": "convlab_unified", "file": "data.zip"},
                        "vocab": {"size": 500},
                        "generate": {"max_history": 60, "max_utterances": 4},
                    }
                }
            },
            "train": {
                "defaults": {"batch_size": 8, "epochs": 1, "max_batches_per_epoch": 4,
                             "eval_every": 2, "patience": None, "log_every": 1},
                "models": {"hier_pp": {"model": {"d_model": 16, "d_ff": 32, "n_heads": 2,
                                                 "n_utterance_layers": 1, "n_context_layers": 1,
                                                 "n_decoder_layers": 1}}},
                "runs": {"hier_pp-mwz": {"model": "hier_pp", "corpus": "mwz"}},
            },
            "tracking": {"enabled": False},
        }
    )  # fmt: skip
    folder = download_corpus("mwz", "data/raw", params.download, False, params.corpus("mwz").source)
    record = tokenize_corpus("mwz", folder, tmp_path / "data" / "shards" / "mwz", params)
    inventory = ActInventory.from_dialogues(read_corpus("mwz", folder, "train"))
    assert record.n_acts == len(inventory) > 20 and record.act_names == list(inventory.names)
    assert record.rows(Task.GENERATE, "train") > 100
    trained = train_seeds(RunRequest.of(params, "hier_pp-mwz"), tmp_path, show_progress=False)
    (seed,) = trained.seeds
    assert seed.metric("steps") == 4 and seed.metric("best_valid_loss") < 10
    assert TokenizeRecord.read(tmp_path / "data" / "shards" / "mwz" / MANIFEST_FILE).n_acts
