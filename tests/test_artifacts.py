"""The stage contract: records round-trip, stale or foreign files fail naming the file,
the layout is the one dvc.yaml declares, and a checkpoint becomes a model one way."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.artifacts import (
    BEST_FILE,
    MANIFEST_FILE,
    PER_EXAMPLE_FILE,
    SEEDS_FILE,
    SOURCES_FILE,
    DownloadRecord,
    EvalRecord,
    ExampleResult,
    Layout,
    SavedModel,
    SeedMetrics,
    SourceDeclaration,
    TrainedSeed,
    TrainRecord,
    TuneRecord,
    VerifiedFile,
    read_examples,
    read_metrics,
    read_train,
    write_examples,
    write_json,
    write_metrics,
)
from pipeline.config import CorpusSource
from pipeline.errors import DataError
from pipeline.models import registry
from pipeline.models.saved import load_model

REPO = Path(__file__).resolve().parents[1]


def seed_record(seed: int = 0) -> TrainedSeed:
    return TrainedSeed(
        seed=seed,
        run_name="train-gpt-chitchat-abc",
        checkpoint="data/train/gpt-chitchat/model.pt",
        run_checkpoint="runs/ray/x/checkpoint.pt",
        metrics={"best_valid_loss": 4.0, "steps": 20.0, "diverged_at": math.nan},
    )


def test_records_round_trip_and_non_finite_values_are_null(tmp_path):
    train = TrainRecord(model="gpt", corpus="chitchat", task="lm", seeds=[seed_record()])
    path = train.write(tmp_path / MANIFEST_FILE)
    assert json.loads(path.read_text())["seeds"][0]["metrics"]["diverged_at"] is None
    back = TrainRecord.read(path)
    assert back.seeds[0].metric("diverged_at") != back.seeds[0].metric("diverged_at")  # NaN
    assert back.seeds[0].metric("best_valid_loss") == 4.0 and back.model == "gpt"

    tune = TuneRecord(
        model="gpt", corpus="chitchat", search="s", config={"dropout": 0.1},
        optimizer={"lr": 1e-3}, valid_loss=3.5, trial_id="t", trials=2, errored_trials=0,
    )  # fmt: skip
    assert TuneRecord.read(tune.write(tmp_path / BEST_FILE)) == tune
    evals = EvalRecord(
        model="gpt", corpus="chitchat", seeds=[SeedMetrics(seed=0, checkpoint="m", metrics={})]
    )
    assert EvalRecord.read(evals.write(tmp_path / SEEDS_FILE)) == evals
    sources = DownloadRecord(
        corpus="c", files={"a.zip": VerifiedFile(url="u", sha256="0" * 64, bytes=3, pinned=True)}
    )
    assert DownloadRecord.read(sources.write(tmp_path / SOURCES_FILE)) == sources
    declared = CorpusSource(format="chat_jsonl", file="data/mine.jsonl")
    mine = DownloadRecord(corpus="mine", declared=declared, split_files={"train": "mine.jsonl"})
    assert DownloadRecord.read(mine.write(tmp_path / "mine" / SOURCES_FILE)) == mine
    for declaration in (SourceDeclaration(corpus="mine", source=declared),
                        SourceDeclaration(corpus="chitchat")):  # fmt: skip
        path = declaration.write(tmp_path / "sources" / f"{declaration.corpus}.json")
        assert SourceDeclaration.read(path) == declaration


def test_stale_and_foreign_records_name_the_file_and_the_stage_to_rerun(tmp_path):
    path = tmp_path / MANIFEST_FILE
    with pytest.raises(DataError, match=r"manifest\.json: missing: run the train stage"):
        TrainRecord.read(path)
    path.write_text("{oops")
    with pytest.raises(DataError, match=r"manifest\.json:1: not valid JSON"):
        TrainRecord.read(path)
    record = TrainRecord(model="gpt", corpus="chitchat", task="lm", seeds=[seed_record()])
    raw = record.model_dump(mode="json")
    path.write_text(json.dumps({**raw, "schema_version": 1}))  # the old, flat train manifest
    with pytest.raises(DataError, match=r"schema version 1 is not 2.*run the train stage"):
        TrainRecord.read(path)
    path.write_text(json.dumps({k: v for k, v in raw.items() if k != "task"}))
    with pytest.raises(DataError, match=r"not a valid TrainRecord \(task: Field required"):
        TrainRecord.read(path)
    path.write_text(json.dumps({**raw, "seeds": []}))
    with pytest.raises(DataError, match="at least one trained seed"):
        TrainRecord.read(path)
    path.write_text(json.dumps({**raw, "sedes": []}))
    with pytest.raises(DataError, match="sedes: Extra inputs are not permitted"):
        TrainRecord.read(path)


def test_read_train_lists_the_runs_that_exist(tmp_path):
    layout = Layout(tmp_path)
    record = TrainRecord(model="gpt", corpus="chitchat", task="lm", seeds=[seed_record()])
    record.write(layout.train_out("gpt-chitchat") / MANIFEST_FILE)
    assert read_train(layout, "gpt-chitchat").seeds[0].run_name == record.seeds[0].run_name
    with pytest.raises(DataError, match=r"runs trained: gpt-chitchat\); run the train stage"):
        read_train(layout, "hier-chitchat")


def test_per_example_rows_and_metrics(tmp_path):
    rows = [
        ExampleResult(seed=0, id="d#1", nll_sum=3.0, n_tokens=2, history_tokens=5,
                      reference="hi", hypotheses={"greedy": "hello", "beam5": "hi"}),
        ExampleResult(seed=0, id="d#2", nll_sum=0.0, n_tokens=0, history_tokens=5, rank=3),
    ]  # fmt: skip
    path = write_examples(tmp_path / PER_EXAMPLE_FILE, rows)
    assert read_examples(path) == tuple(rows)
    assert rows[0].loss == 1.5 and math.isnan(rows[1].loss)
    path.write_text(path.read_text() + '{"seed": 0, "id": "x", "nll_sum": "lots"}\n')
    with pytest.raises(DataError, match=r"jsonl:3: bad row \(nll_sum: Input should be a valid"):
        read_examples(path)

    metrics = write_metrics(tmp_path / "m.json", {"test_ppl": 9.5, "test_loss": math.inf})
    assert json.loads(metrics.read_text()) == {"test_loss": None, "test_ppl": 9.5}
    got = read_metrics(metrics)
    assert got["test_ppl"] == 9.5 and math.isnan(got["test_loss"])
    metrics.write_text('{"bleu": "high"}')
    with pytest.raises(DataError, match=r"\['bleu'\] are not"):
        read_metrics(metrics)


def test_layout_is_the_one_dvc_yaml_declares():
    """A path changed in one of the two and not the other would break `dvc repro`."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    layout = Layout(Path("."))
    (checked,) = stages["check"]["outs"]
    assert layout.declaration("${item}").parent == Path(next(iter(checked)))
    assert str(layout.declaration("${item}")) in stages["download"]["do"]["deps"]
    outs = {
        "download": (stages["download"]["do"]["outs"][0], layout.raw("${item}")),
        "tokenize": (stages["tokenize"]["do"]["outs"][0], layout.shards("${item}")),
        "train": (stages["train"]["do"]["outs"][0], layout.train_out("${key}")),
        "tune": (stages["tune"]["do"]["outs"][0], layout.tune_out("${key}")),
    }
    for stage, (declared, ours) in outs.items():
        if isinstance(declared, dict):  # {path: {cache: false}}
            (declared,) = declared
        assert Path(declared) == ours, stage
    evaluate = stages["evaluate"]["do"]
    assert [Path(o) for o in evaluate["outs"]] == [
        layout.eval_out("${key}") / name for name in (PER_EXAMPLE_FILE, SEEDS_FILE, "samples.md")
    ]
    assert Path(next(iter(evaluate["metrics"][0]))) == layout.metrics("${key}")


# A folder of the layout, as a path literal: "data", "data/raw/x", "metrics" ...
_LAYOUT_PATH = re.compile(r"^(data|metrics)(/(sources|raw|shards|tune|train|eval)(/.*)?)?/?$")


def spelled_paths(source: str) -> list[tuple[int, str]]:
    """(line, literal) of each layout path ``source`` builds itself: an operand of ``/``,
    the argument of ``Path(...)`` or an option's ``default=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = [node.left, node.right]
        elif isinstance(node, ast.Call):
            by_path = getattr(node.func, "id", None) == "Path"
            parts = [
                *(node.args if by_path else []),
                *(k.value for k in node.keywords if k.arg == "default"),
            ]
        else:
            continue
        found += [
            (part.lineno, part.value)
            for part in parts
            if isinstance(part, ast.Constant)
            and isinstance(part.value, str)
            and _LAYOUT_PATH.match(part.value)
        ]
    return sorted(found)


def test_layout_is_the_only_code_that_spells_the_paths():
    """docs/DESIGN.md's promise: a stage or library module asks ``Layout`` (its options'
    defaults included), so moving a folder is one edit in ``pipeline/artifacts/layout.py``."""
    assert spelled_paths(
        'root / "data" / "raw"\nPath("data/shards")\nadd("--out", default="metrics")\n'
        'd["data"]\nprint("data/raw")\nroot / "dataset"\n'
    ) == [(1, "data"), (2, "data/shards"), (3, "metrics")]  # fmt: skip
    layout = REPO / "pipeline" / "artifacts" / "layout.py"
    assert spelled_paths(layout.read_text())  # where they are spelled
    sources = [*(REPO / "pipeline").rglob("*.py"), *(REPO / "stages").glob("*.py")]
    spelled = [
        f"{path.relative_to(REPO)}:{line}: {literal!r}"
        for path in sorted(sources)
        if path != layout
        for line, literal in spelled_paths(path.read_text())
    ]
    assert spelled == []


def test_load_model_is_the_exported_model_and_names_bad_files(tmp_path):
    torch.manual_seed(0)
    model = registry.build("gpt", 40, d_model=16, n_heads=2, n_layers=1, d_ff=32)
    config = model.config.model_dump(mode="json")
    path = SavedModel("gpt", config, "lm", model.state_dict()).write(tmp_path / "model.pt")
    loaded = load_model(path)
    assert not loaded.training and type(loaded) is type(model)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    wrong = registry.build("gpt", 41, d_model=16, n_heads=2, n_layers=1, d_ff=32)
    SavedModel("gpt", config, "lm", wrong.state_dict()).write(path)
    with pytest.raises(DataError, match=r"model\.pt: weights do not fit gpt"):
        load_model(path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match=r"model\.pt: unreadable \(.*an exported model") as err:
        load_model(path)
    assert "weights_only" not in str(err.value)


def test_json_outputs_are_written_atomically(tmp_path):
    path = write_json(tmp_path / "out" / "best.json", {"b": 1, "a": [1, 2]})
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    assert [p.name for p in path.parent.iterdir()] == ["best.json"]  # no temp file left
