"""The committed results document: provenance, one verdict per paper comparison, the
tables and the figures beside it."""

from __future__ import annotations

import shutil

from pipeline.artifacts import MANIFEST_FILE, SEEDS_FILE, EvalRecord, Layout, TrainRecord
from pipeline.report.build import build_report
from pipeline.report.study import figures_folder
from tests.report.conftest import lm_rows, params_for, write_run

# unet beats the transformer on every example of every seed; the intervals are apart
TRANSFORMER = [[3.0, 3.2, 3.1, 3.3], [3.1, 3.3, 3.0, 3.2], [3.2, 3.1, 3.3, 3.0]]
UNET = [[2.0, 2.2, 2.1, 2.3], [2.1, 2.3, 2.0, 2.2], [2.2, 2.1, 2.3, 2.0]]


def _stamp(root, key: str, machine: str, commit: str, wall: float, eval_wall: float) -> None:
    """What the train and evaluate stages record besides metrics."""
    layout = Layout(root)
    path = layout.train_out(key) / MANIFEST_FILE
    record = TrainRecord.read(path)
    seeds = [s.model_copy(update={"metrics": {**s.metrics, "wall_s": wall}}) for s in record.seeds]
    record.model_copy(update={"machine": machine, "commit": commit, "seeds": seeds}).write(path)
    EvalRecord(model=record.model, corpus="chitchat", seeds=[], wall_s=eval_wall).write(
        layout.eval_out(key) / SEEDS_FILE
    )


def test_results_document_has_provenance_verdicts_tables_and_figures(shards_project, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(shards_project / "data" / "shards", root / "data" / "shards")
    steps = {"best_valid_loss": 4.0, "steps": 600}
    for model, nll, ppl in (("transformer", TRANSFORMER, 24.0), ("unet", UNET, 8.5)):
        rows = [{**r, "hypotheses": {"greedy": "hi"}, "reference": "hi"} for r in lm_rows(nll)]
        metrics = {"test_ppl": ppl, "test_ppl_ci95": 0.4}
        key = write_run(root, model, rows, metrics, train_metrics=steps)
        _stamp(root, key, "Xeon, 2 cores; no GPU", "abc123", wall=120.0, eval_wall=30.0)
    stale = root / "results" / "study" / "old.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"")
    params = params_for(
        ["transformer", "unet"],
        evaluate={"bootstrap_samples": 50},
        tracking={"enabled": False},
        report={"results": "results/STUDY.md"},
    )

    report = build_report(params, root)

    assert report.results == root / "results" / "STUDY.md"
    text = report.results.read_text()
    assert "commit `abc123`" in text and "Machine: `Xeon, 2 cores; no GPU`" in text
    assert "took 0.08 h of wall time" in text  # 2 runs x (120 + 30) s
    # the verdict table: unet < transformer is the paper's direction, intervals apart
    assert (
        "| unet < transformer on Test PPL (U-Net Transformer, Tables 1-2) | 46.87 vs 48.30 "
        "(Cornell Movie-Dialogs); 36.86 vs 39.06 (PersonaChat) | 8.50 ± 0.40 vs 24.00 ± 0.40 "
        "| **reproduced** |"
    ) in text
    assert "In all: 1 reproduced." in text
    assert "| transformer-chitchat | " in text and "| 600 | 32 | 1 | 2.0 | 0.5 |" in text
    assert "#### U-Net Transformer, Tables 1-2" in text and "In the paper (U-Net paper" in text
    folder = figures_folder(report.results)
    assert not stale.exists() and (folder / "learning_curves.png").is_file()
    assert "![learning_curves](study/learning_curves.png)" in text


def test_no_document_unless_the_params_name_one(shards_project, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(shards_project / "data" / "shards", root / "data" / "shards")
    write_run(root, "gpt", lm_rows([[1.0]]), {"test_ppl": 2.0})
    params = params_for(["gpt"], evaluate={"bootstrap_samples": 0}, tracking={"enabled": False})
    assert build_report(params, root).results is None
    assert not (root / "results").exists()
