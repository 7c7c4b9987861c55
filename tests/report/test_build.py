"""The whole report from hand-made run outputs, a real history and an MLflow store."""

from __future__ import annotations

import csv
import shutil

import pytest
import yaml

from pipeline import tracking
from pipeline.artifacts import MlflowRef
from pipeline.report.build import build_report
from pipeline.tracking import store
from tests.report.conftest import TOKENIZE, lm_rows, params_for, write_run


@pytest.mark.slow
def test_report_end_to_end(shards_project, tmp_path, monkeypatch):
    root = tmp_path / "project"
    shutil.copytree(shards_project / "data" / "shards", root / "data" / "shards")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv(store.TRACKING_URI_ENV, uri)
    # a training run with a validation history, as the train loop logs it
    tracker = tracking.Tracker.start(uri, uri, "hiertx/generate/chitchat", run_name="t")
    for step, loss in ((10, 5.0), (20, 4.5), (30, 4.25)):
        tracker.log_metrics({"valid_loss": loss}, step)
    tracker.end()
    mlflow = MlflowRef(
        tracking_uri=uri, experiment="e", run_id=tracker.run_id, checkpoint_uri="runs:/x"
    )

    rows = [
        {**r, "hypotheses": {"greedy": "hi there"}, "reference": "hi"}
        for r in lm_rows([[2.0, 3.0]])
    ]
    write_run(root, "transformer", rows, {"test_ppl": 1.2, "bleu": 10.0}, mlflow=mlflow)
    write_run(root, "unet", rows, {"test_ppl": 1.2, "bleu": 10.0})
    write_run(
        root,
        "transformer_ranker",
        [{**r, "rank": 1} for r in lm_rows([[0.0]])],
        {"recall_at_10": 1.0},
    )
    write_run(root, "gpt", lm_rows([[1.0]]), {"test_ppl": 2.0})
    params = params_for(
        ["transformer", "unet", "transformer_ranker"],
        ["gpt"],
        evaluate={"bootstrap_samples": 50},
    )
    report = build_report(params, root)

    text = report.path.read_text()
    for key in (
        "transformer-chitchat",
        "unet-chitchat",
        "transformer_ranker-chitchat",
        "gpt-chitchat",
    ):
        assert f"| {key} |" in text
    assert "#### U-Net Transformer, Tables 1-2" in text and "50 samples" in text
    # how every number was computed, the BLEU signature of the corpus included
    assert "## Metric conventions" in text
    assert "chitchat: BLEU: sacrebleu corpus BLEU (0-100), case-sensitive" in text
    assert "Signature `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in text
    # the validation losses by their unit; the degenerate responses named
    assert "| Valid CE (nats/token) | Valid ranking loss (nats) |" in text
    assert '`transformer-chitchat`: greedy decoding collapsed: "hi there" is 100%' in text
    # the samples: the reference and each model's response
    assert "## Samples" in text and "| unet | hi there |" in text
    assert "MultiWOZ" not in text.split("## Results")[0]  # no task-oriented corpus here
    # the paper's rows under the U-Net table, with its corpora
    assert "In the paper (U-Net paper, Table 2; PersonaChat" in text
    out = root / "reports"
    for name in ("learning_curves", "metrics", "length_vs_loss", "attention_masks", "unet_widths"):
        assert f"](figures/{name}.png)" in text
        assert (out / "figures" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    # one long table for `dvc plots show`; unet has no MLflow run, so no curve
    with (root / "plots" / "valid_loss.csv").open() as f:
        assert list(csv.reader(f)) == [
            ["step", "valid_loss", "run"],
            ["10", "5.0", "transformer-chitchat"],
            ["20", "4.5", "transformer-chitchat"],
            ["30", "4.25", "transformer-chitchat"],
        ]
    # the rankers' loss has a file (and a y label) of its own: no select run here
    assert (root / "plots" / "valid_ranking_loss.csv").read_text().split() == [
        "step,valid_ranking_loss,run"
    ]
    assert (out / "tables.json").is_file()

    # the same tables and figures are in MLflow
    client = store.mlflow_client(uri)
    run = client.get_run(report.mlflow_run_id)
    assert run.data.tags["hiertx.covers.transformer-chitchat"] == tracker.run_id
    names = {a.path for a in client.list_artifacts(report.mlflow_run_id)}
    assert {"report.md", "tables.json", "figures"} <= names


def test_the_conventions_state_the_decodings_the_stage_reads():
    """The report stage's slice of params (``select_params``) carries each generate run's
    decodings, and the conventions print them with their options."""
    from types import SimpleNamespace

    from pipeline.names import Task
    from pipeline.report.build import decode_lines
    from stages.report import select_params

    greedy = {"strategy": "greedy", "min_length": 3, "anti_lm": 0.75, "anti_lm_tokens": 10}
    params = params_for(
        ["transformer", "unet", "hier"],
        evaluate={
            "decodes": [greedy, {"strategy": "nucleus", "top_p": 0.9, "temperature": 0.7}],
            "models": {"hier": [greedy, {"strategy": "beam", "length_penalty": 1.0}]},
        },
    )
    runs = [
        SimpleNamespace(task=Task.GENERATE, corpus="chitchat", model=m)
        for m in ("transformer", "unet", "hier")
    ]
    greedy_said = "greedy (min length 3, MMI-antiLM 0.75 over first 10 tokens)"
    assert decode_lines(runs, select_params(params).evaluate) == [
        f"Decodings of transformer, unet on chitchat (`evaluate.decodes`): {greedy_said}; "
        "topp0.9 (T 0.7, seed 0); max length the corpus' `generate.max_response`.",
        f"Decodings of hier on chitchat (`evaluate.decodes`): {greedy_said}; "
        "beam5 (length penalty 1); max length the corpus' `generate.max_response`.",
    ]


def test_stage_says_what_is_missing(tmp_path, monkeypatch, capsys):
    from stages import report as stage

    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump(
            {
                "tokenize": TOKENIZE,
                "train": {"runs": {"gpt-chitchat": {"model": "gpt", "corpus": "chitchat"}}},
            }
        )
    )
    monkeypatch.chdir(tmp_path)
    assert stage.main([]) == 1
    assert "metrics/gpt-chitchat.json: missing" in capsys.readouterr().err


def test_curves_table_names_every_run(tmp_path):
    from pipeline.report.build import write_curves_csv
    from pipeline.report.plots import Curve

    path = tmp_path / "plots" / "valid_loss.csv"
    curves = [
        Curve("gpt-chitchat-seed0", "lm", (2, 4), (3.5, 3.25)),
        Curve("unet-chitchat", "generate", (2,), (5.0,)),
    ]
    with write_curves_csv(curves, path).open() as f:
        assert list(csv.reader(f)) == [
            ["step", "valid_loss", "run"],
            ["2", "3.5", "gpt-chitchat-seed0"],
            ["4", "3.25", "gpt-chitchat-seed0"],
            ["2", "5.0", "unet-chitchat"],
        ]
    # no history anywhere: still the file DVC expects, with its header
    assert write_curves_csv([], path).read_text().splitlines() == ["step,valid_loss,run"]


def test_significance_caption_says_what_the_markers_test():
    from pipeline.report.build import significance_scope

    assert "test-set sampling only, not training randomness" in significance_scope([1])
    assert "seed-to-seed variation" in significance_scope([1, 3])
