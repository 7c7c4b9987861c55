"""``python -m pipeline compare``: the runs' key metrics within a terminal's width."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.artifacts import METRICS_DIR, read_metrics, write_metrics
from pipeline.cli import main
from pipeline.errors import ConfigError
from pipeline.names import Task
from pipeline.report import compare

PROJECT = Path(__file__).resolve().parents[2]

GENERATE = {
    "test_ppl": 167.642,
    "bleu": 0.0,
    "avg_length": 3.0,
    "distinct_2": 0.0021,
    "distinct_2_topp0.9": 0.0588,
    "bleu_topp0.9": 1.4,
}
SELECT = {"recall_at_1": 0.0281, "recall_at_10": 0.1406, "recall_at_50": 0.59, "mrr": 0.0777}
LM = {"test_ppl": 147.56, "test_loss": 4.994}


def project(root: Path, runs: dict[str, dict[str, float]]) -> Path:
    for key, metrics in runs.items():
        write_metrics(root / METRICS_DIR / f"{key}.json", metrics)
    return root


def test_the_committed_default_run_fits_120_columns_with_every_run_once(capsys):
    assert main(["compare", "--root", str(PROJECT), "--width", "120"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120
    runs = sorted(p.stem for p in (PROJECT / METRICS_DIR).glob("*.json"))
    rows = [
        line.split()[0] for line in out.splitlines() if line.split()[:1] and line.split()[0] in runs
    ]
    assert sorted(rows) == runs
    # The values are the files' own, at the catalogue's digits.
    ranker = read_metrics(PROJECT / METRICS_DIR / "transformer_ranker-chitchat.json")
    row = next(line for line in out.splitlines() if line.startswith("transformer_ranker-chitchat"))
    assert f"{ranker['recall_at_10']:.4f}" in row.split()


def test_a_table_per_task_with_that_tasks_metrics(tmp_path):
    runs = compare.workspace_metrics(project(tmp_path, {"a-c": GENERATE, "b-c": SELECT, "g-c": LM}))
    assert {k: compare.task_of(v) for k, v in runs.items()} == {
        "a-c": Task.GENERATE,
        "b-c": Task.SELECT,
        "g-c": Task.LM,
    }
    tables = compare.tables(runs)
    assert [t.title for t in tables] == ["generate (1 run)", "select (1 run)", "lm (1 run)"]
    generate, select, lm = tables
    # Lower-is-better and higher-is-better say so; columns no run has are left out.
    assert generate.header == ["run", "Test PPL ↓", "BLEU ↑", "Distinct-2 ↑", "Avg len ↑"]
    assert generate.rows == [["a-c", "167.64", "0.00", "0.0021", "3.00"]]
    assert "topp0.9" in generate.note and "--metrics bleu_topp0.9" in generate.note
    assert select.header == ["run", "R@1 ↑", "R@10 ↑", "R@50 ↑", "MRR ↑"]
    assert lm.rows == [["g-c", "147.56", "4.994"]]


def test_a_narrow_terminal_wraps_columns_instead_of_overflowing(tmp_path):
    runs = compare.workspace_metrics(project(tmp_path, {"transformer-chitchat": GENERATE}))
    tables = compare.tables(runs, width=44)
    assert len(tables) > 1 and all(t.width <= 44 for t in tables)
    shown = [h for t in tables for h in t.header[1:]]
    assert shown == ["Test PPL ↓", "BLEU ↑", "Distinct-2 ↑", "Avg len ↑"]
    assert tables[1].title.endswith("continued")


def test_seeds_show_their_interval_and_a_nan_stays_visible():
    runs = {"a-c": {"test_ppl": 137.8, "test_ppl_ci95": 1.214, "avg_length": float("nan")}}
    (table,) = compare.tables(runs)
    assert table.rows[0][1:3] == ["137.80±1.21", "nan"]


def test_changes_since_a_revision(tmp_path):
    root = project(tmp_path, {"a-c": GENERATE, "old-c": LM})
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "."], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=root, check=True)
    write_metrics(root / METRICS_DIR / "a-c.json", {**GENERATE, "test_ppl": 160.0, "bleu": 0.5})
    (root / METRICS_DIR / "old-c.json").unlink()
    write_metrics(root / METRICS_DIR / "new-c.json", SELECT)
    tables = compare.tables(compare.workspace_metrics(root), compare.revision_metrics(root, "HEAD"))
    generate, select, lm = tables
    assert generate.rows[0][:4] == ["a-c", "160.00 (-7.64)", "0.50 (+0.50)", "0.0021 (=)"]
    assert select.rows[0][1] == "0.0281 (new)"
    assert lm.rows == [["old-c (gone)", "-", "-"]]
    with pytest.raises(ConfigError, match=r"--rev.*no-such-rev"):
        compare.revision_metrics(root, "no-such-rev")


def test_chosen_metrics_of_another_decoding_and_an_unknown_key(tmp_path):
    runs = compare.workspace_metrics(project(tmp_path, {"a-c": GENERATE}))
    (table,) = compare.tables(runs, metrics=["bleu_topp0.9", "test_ppl"])
    assert table.header == ["run", "BLEU topp0.9 ↑", "Test PPL ↓"]
    assert table.rows == [["a-c", "1.40", "167.64"]]
    with pytest.raises(
        ConfigError, match="--metrics: no run has bleu_tpp; the runs have: avg_length"
    ):
        compare.tables(runs, metrics=["bleu_tpp"])


def test_nothing_to_compare_says_what_to_run(tmp_path, capsys):
    assert main(["compare", "--root", str(tmp_path)]) == 1
    assert "make repro" in capsys.readouterr().out
