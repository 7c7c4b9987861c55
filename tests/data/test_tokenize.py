"""The tokenize stage end to end: real chitchat, DSTC7 fixtures, error policy, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.artifacts import MANIFEST_FILE, SOURCES_FILE, DownloadRecord, VerifiedFile
from pipeline.config import CorpusSource, DownloadParams, Params, TokenizeParams
from pipeline.data.download import download_corpus
from pipeline.data.formats import ParseStats
from pipeline.data.loader import load_vocab, open_split
from pipeline.data.shards import read_manifest
from pipeline.data.special import SPECIAL_TOKENS
from pipeline.data.splits import Split
from pipeline.data.tokenize import read_splits, tokenize_corpus
from pipeline.data.vocab import word_tokenize
from pipeline.errors import ConfigError, DataError
from pipeline.names import Task
from stages import tokenize as stage

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def tokenize_params(corpus: str = "chitchat", **settings: object) -> TokenizeParams:
    return TokenizeParams.model_validate({"corpora": {corpus: settings}})


CHITCHAT = {
    "tasks": ["generate", "select", "lm"],
    "max_dialogues": 20,
    "vocab": {"size": 400},
    "select": {"n_candidates_train": 4, "n_candidates_eval": 10},
}


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.slow
def test_chitchat_tokenizes_deterministically_with_a_train_only_vocab(tmp_path: Path) -> None:
    params = tokenize_params(**CHITCHAT)
    manifest = tokenize_corpus("chitchat", None, tmp_path / "a", params)
    tokenize_corpus("chitchat", tmp_path / "missing-raw", tmp_path / "b", params)
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")  # same input, same bytes

    splits = read_splits("chitchat", None, params, ParseStats())
    train = splits[Split.TRAIN]
    assert len(train) == 20 == len(splits["valid"]) == len(splits["test"])
    expected = sum(len([t for t in d.turns[1:] if t.text]) for d in train)
    assert manifest.counts["generate"]["train"] == expected == manifest.counts["select"]["train"]
    assert manifest.counts["lm"]["train"] >= len(train)

    vocab = load_vocab(tmp_path / "a")
    train_words = {w for d in train for t in d.turns for w in word_tokenize(t.text)}
    assert set(vocab.tokens) - set(SPECIAL_TOKENS) <= train_words
    held_out = {w for s in ("valid", "test") for d in splits[s] for t in d.turns
                for w in word_tokenize(t.text)}  # fmt: skip
    assert held_out - train_words and not (held_out - train_words) & set(vocab.tokens)
    assert manifest.params is not None and manifest.params.corpus.max_dialogues == 20
    assert len(open_split(tmp_path / "a", Task.SELECT, "test")[0].candidate_ids) == 10


def test_dstc7_keeps_its_candidates(tmp_path: Path) -> None:
    params = tokenize_params("dstc7", tasks=["select"], select={"n_candidates_train": 5})
    manifest = tokenize_corpus("dstc7", FIXTURES / "dstc7", tmp_path, params)
    train = open_split(tmp_path, Task.SELECT, "train")
    assert len(train) == 3  # 2 Ubuntu + 1 Advising examples
    for example in train:  # training keeps every correct candidate + drawn wrong ones
        assert len(example.candidate_ids) == 5 and example.labels.sum() >= 1
    valid = list(open_split(tmp_path, Task.SELECT, "valid"))
    assert {len(e.candidate_ids) for e in valid} == {10}
    assert manifest.counts["select"]["valid"] == len(valid)


def broken_chitchat(root: Path) -> Path:
    good = {"messages": [[{"text": "hi there", "sender": "a"}], [{"text": "hello", "sender": "b"}]]}
    data = {f"c{i}": good for i in range(12)} | {"bad": {"messages": "not a list"}}
    root.mkdir(parents=True)
    (root / "dataset.json").write_text(json.dumps(data))
    verified = VerifiedFile(url="pypi:x", sha256="ab", bytes=1, pinned=True)
    DownloadRecord(corpus="chitchat", files={"dataset.json": verified}).write(root / SOURCES_FILE)
    return root


def test_malformed_records_raise_or_are_counted(tmp_path: Path) -> None:
    raw = broken_chitchat(tmp_path / "raw")
    settings = {"select": {"n_candidates_train": 2}}
    with pytest.raises(DataError, match="bad"):
        tokenize_corpus("chitchat", raw, tmp_path / "out", tokenize_params(**settings))
    assert not (tmp_path / "out" / MANIFEST_FILE).exists()
    params = Params.model_validate(
        {"tokenize": {"on_error": "skip", "corpora": {"chitchat": settings}}}
    )
    manifest = tokenize_corpus("chitchat", raw, tmp_path / "out", params)
    assert manifest.skipped["malformed_records"] == 1 and "bad" in manifest.warnings[0]
    assert manifest.sources.files["dataset.json"].sha256 == "ab"
    assert read_manifest(tmp_path / "out").counts == {
        "generate": {"train": 10, "valid": 1, "test": 1}
    }


def test_no_training_split_is_an_error(tmp_path: Path, shared_data: Path) -> None:
    params = tokenize_params("multiwoz", max_dialogues=3)
    with pytest.raises(DataError, match="no training dialogues"):
        tokenize_corpus("multiwoz", shared_data / "multiwoz" / "convlab1", tmp_path, params)


def test_too_many_candidates_names_the_params_key(tmp_path: Path) -> None:
    raw = broken_chitchat(tmp_path / "raw")
    settings = {"tasks": ["select"], "split": {"valid": 0.0, "test": 0.0}}
    params = Params.model_validate(
        {"tokenize": {"on_error": "skip", "corpora": {"chitchat": settings}}}
    )
    with pytest.raises(ConfigError) as err:  # 12 identical responses, 10 candidates wanted
        tokenize_corpus("chitchat", raw, tmp_path / "out", params)
    assert err.value.key == "tokenize.corpora.chitchat.select.n_candidates_train"


def test_stage_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = broken_chitchat(tmp_path / "raw" / "chitchat")
    params = tmp_path / "params.yaml"
    params.write_text(
        "tokenize:\n  on_error: skip\n  corpora:\n    chitchat:\n"
        "      generate: {max_history: 20}\n"
    )
    argv = ["chitchat", "--params", str(params), "--raw", str(raw.parent), "--out", str(tmp_path)]
    assert stage.main(argv) == 0
    out = capsys.readouterr().out
    assert "generate" in out and "malformed records 1" in out
    assert read_manifest(tmp_path / "chitchat").counts["generate"]["train"] == 10
    params.write_text("tokenize:\n  corpora:\n    chitchat:\n      generate: {max_history: 0}\n")
    assert stage.main(argv) == 1
    assert "tokenize.corpora.chitchat.generate.max_history" in capsys.readouterr().err


def test_stage_reports_each_step_in_a_log_and_nothing_with_no_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = broken_chitchat(tmp_path / "raw" / "chitchat")
    params = tmp_path / "params.yaml"
    params.write_text(
        "tokenize:\n  on_error: skip\n  corpora:\n    chitchat:\n      tasks: [generate, lm]\n"
    )
    argv = ["chitchat", "--params", str(params), "--raw", str(raw.parent), "--out", str(tmp_path)]
    assert stage.main(argv) == 0
    lines = capsys.readouterr().err.splitlines()  # captured: no terminal, so lines
    assert lines[0] == "tokenize chitchat: step 0/3 (0%), reading the corpus"
    # reading, vocabulary, encoding (one read of the corpus each)
    assert [line.split("), ", 1)[1].rsplit(", ", 2)[0] for line in lines[1:-1]] == [
        "building the vocabulary (10 train dialogues)",
        "encoding 10 train, 1 valid, 1 test dialogues: generate, lm",
    ]
    assert lines[-1].startswith("tokenize chitchat: finished step 3/3 (100%) in ")
    assert stage.main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_train_on_valid_trains_on_validation_dialogues_and_tests_on_test(
    tmp_path: Path, shared_data: Path
) -> None:
    """The shared mirror has MultiWOZ's validation and test files only: ``train_on: valid``
    trains on 90% of the validation dialogues, validates on the other 10%, tests on test."""
    raw = shared_data / "multiwoz" / "convlab2"
    params = tokenize_params("multiwoz21", train_on="valid")
    by_split = read_splits("multiwoz21", raw, params, ParseStats())
    ids = {split: {d.id for d in dialogues} for split, dialogues in by_split.items()}
    assert (len(ids["train"]), len(ids["valid"]), len(ids["test"])) == (899, 100, 1000)
    assert not ids["train"] & ids["valid"] and not (ids["train"] | ids["valid"]) & ids["test"]
    again = read_splits("multiwoz21", raw, params, ParseStats())
    assert {d.id for d in again["valid"]} == ids["valid"]  # seeded
    official = read_splits("multiwoz21", raw, tokenize_params("multiwoz21"), ParseStats())
    assert {d.id for d in official["valid"]} == ids["train"] | ids["valid"]
    assert {d.id for d in official["test"]} == ids["test"]


def test_resplit_train_splits_the_training_file_alone_like_the_u_net_authors(
    tmp_path: Path, shared_data: Path
) -> None:
    """The U-Net authors split PersonaChat's training file 90/5/5 by conversation and use
    none of its validation or test files: ``resplit_train`` with ``split`` does that."""
    lines = (shared_data / "personachat" / "valid_self_original_no_cands.txt").read_text()
    dialogues: list[list[str]] = []
    for line in lines.splitlines():
        if line.startswith("1 "):
            dialogues.append([])
        dialogues[-1].append(line)
    for name, chosen in (("train", dialogues[:60]), ("valid", dialogues[60:70])):
        text = "\n".join(line for d in chosen for line in d) + "\n"
        (tmp_path / f"{name}_self_original_no_cands.txt").write_text(text)
    split = {"seed": 13, "valid": 0.05, "test": 0.05}
    params = tokenize_params("personachat", resplit_train=True, split=split)
    by_split = read_splits("personachat", tmp_path, params, ParseStats())
    ids = {part: [d.id for d in found] for part, found in by_split.items()}
    assert (len(ids["train"]), len(ids["valid"]), len(ids["test"])) == (54, 3, 3)
    official = read_splits("personachat", tmp_path, tokenize_params("personachat"), ParseStats())
    assert sorted(ids["train"] + ids["valid"] + ids["test"]) == sorted(
        d.id for d in official["train"]
    )  # the training file's conversations, and none of the validation file's
    again = read_splits("personachat", tmp_path, params, ParseStats())
    assert [d.id for d in again["test"]] == ids["test"]  # seeded
    with pytest.raises(ValueError, match="resplit_train: splits the training dialogues"):
        tokenize_params("personachat", resplit_train=True, train_on="valid")


# --------------------------------------------------------------------------- empty splits


def _chat(path: Path, n: int, turns: int = 5) -> None:
    """``n`` dialogues of ``turns`` turns (``turns - 1`` generate examples each)."""
    roles = ("user", "assistant")
    lines = [
        json.dumps({"messages": [{"role": roles[t % 2], "content": f"turn {t} of chat {i}"}
                                 for t in range(turns)]})
        for i in range(n)
    ]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in lines))


def _declared(project: Path, source: dict, **corpus: object) -> DataError:
    """The error of tokenizing corpus ``mychats`` declared as ``source`` in ``project``."""
    declared = CorpusSource.model_validate({"format": "chat_jsonl", **source})
    folder = download_corpus("mychats", "data/raw", DownloadParams(), False, declared)
    params = tokenize_params("mychats", source=declared.model_dump(), **corpus)
    out = project / "data" / "shards" / "mychats"
    with pytest.raises(DataError) as err:
        tokenize_corpus("mychats", folder, out, params)
    assert not (out / MANIFEST_FILE).exists()  # nothing downstream can read
    return err.value


NEEDS = "a training run needs valid examples to choose its weights and evaluate needs test examples"


def test_a_chat_file_of_one_dialogue_is_refused_naming_the_counts_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: tokenize printed `generate │ 4 │ 0 │ 0`, and the train stage exported the
    untrained step-0 weights of a run that never validated."""
    monkeypatch.chdir(tmp_path)
    _chat(tmp_path / "mine" / "one.jsonl", n=1)
    err = _declared(tmp_path, {"file": "mine/one.jsonl"})
    assert str(err) == (
        f"mine/one.jsonl: generate has 4 train, 0 valid, 0 test examples; {NEEDS}: add "
        "dialogues (the corpus has 1; tokenize.corpora.mychats.split sends 10% to valid and "
        "10% to test, which gives each split one from 6 dialogues on)"
    )
    # 4 dialogues: too few for 10%, enough for a quarter each; the task that lacks a split
    # may be dropped where another task has every split
    _chat(tmp_path / "mine" / "one.jsonl", n=4)
    err = _declared(tmp_path, {"file": "mine/one.jsonl"}, tasks=["generate", "lm"])
    assert str(err).endswith(
        "from 6 dialogues on), or set tokenize.corpora.mychats.split.valid and .test to 0.25"
    )
    _chat(tmp_path / "mine" / "one.jsonl", n=4)
    split = {"valid": 0.25, "test": 0.25}
    record = tokenize_corpus(
        "mychats",
        tmp_path / "data" / "raw" / "mychats",
        tmp_path / "data" / "shards" / "mychats",
        tokenize_params("mychats", source={"format": "chat_jsonl", "file": "mine/one.jsonl"},
                        split=split),
    )  # fmt: skip
    assert record.counts == {"generate": {"train": 8, "valid": 4, "test": 4}}


def test_a_split_file_whose_dialogues_give_no_example_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for split in ("train", "test"):
        _chat(tmp_path / "per" / f"{split}.jsonl", n=3)
    _chat(tmp_path / "per" / "valid.jsonl", n=2, turns=1)  # a question, no answer
    splits = {s: {"file": f"per/{s}.jsonl"} for s in ("train", "valid", "test")}
    err = _declared(tmp_path, {"splits": splits, "targets": "assistant"})
    assert str(err) == (
        "per/valid.jsonl: generate has 6 train, 0 valid, 6 test examples; a training run needs "
        "valid examples to choose its weights: its 2 valid dialogues give no generate "
        "example: add valid dialogues that do"
    )


def test_a_split_fraction_of_0_is_refused_for_a_built_in_corpus(tmp_path: Path) -> None:
    """Chitchat splits its conversations by ``split``: with ``valid: 0`` it has none."""
    raw = broken_chitchat(tmp_path / "raw")
    settings = {"on_error": "skip", "corpora": {"chitchat": {"split": {"valid": 0.0}}}}
    with pytest.raises(DataError) as err:
        tokenize_corpus(
            "chitchat", raw, tmp_path / "out", Params.model_validate({"tokenize": settings})
        )
    assert str(err.value) == (
        f"{raw}: generate has 11 train, 0 valid, 1 test examples; a training run needs valid "
        "examples to choose its weights: tokenize.corpora.chitchat.split.valid is 0: set it "
        "above 0"
    )


def test_the_stage_refuses_a_corpus_with_an_empty_split_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    _chat(tmp_path / "mine" / "one.jsonl", n=1)
    declared = CorpusSource.model_validate({"format": "chat_jsonl", "file": "mine/one.jsonl"})
    download_corpus("mychats", "data/raw", DownloadParams(), False, declared)
    (tmp_path / "params.yaml").write_text(
        "corpora: [mychats]\ntokenize:\n  corpora:\n    mychats:\n"
        "      source: {format: chat_jsonl, file: mine/one.jsonl}\n"
    )
    assert stage.main(["mychats", "--no-progress"]) == 1
    said = capsys.readouterr()
    assert said.err == (
        f"tokenize mychats: mine/one.jsonl: generate has 4 train, 0 valid, 0 test examples; "
        f"{NEEDS}: add dialogues (the corpus has 1; tokenize.corpora.mychats.split sends 10% "
        "to valid and 10% to test, which gives each split one from 6 dialogues on)\n"
    )
    assert "│" not in said.out  # no table of counts, as if it had worked
