"""The committed results of the default profile (``make repro`` on ``params.yaml``): every
run's ``metrics/<run>.json`` and ``reports/report.md``/``tables.json`` are of the runs the
params name, and the report's diagnostics flag no run but those :data:`KNOWN_FLAGS` names.

A regeneration of ``dvc.lock`` whose models collapse, rank at chance or keep their first
validation's weights fails here, not only in a report nobody reads; so does a generation or
language model that is not clearly below its corpus' unigram row, or a ranker whose R@10 or
MRR is not above its chance row (the rules: ``pipeline.report.diagnostics``). A flag that
goes away fails too, until it leaves :data:`KNOWN_FLAGS`: the list only shrinks on purpose.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from pipeline.report.diagnostics import AT_CHANCE, COLLAPSED, FIRST_VALIDATION, NEVER_AVERAGED
from pipeline.report.references import CHANCE, UNIGRAM

REPO = Path(__file__).resolve().parents[1]
PARAMS = yaml.safe_load((REPO / "params.yaml").read_text())
RUNS = [*PARAMS["train"]["runs"], *PARAMS["tune"]["runs"]]
REPORT = REPO / "reports" / "report.md"
TABLES = json.loads((REPO / "reports" / "tables.json").read_text())["tables"]
CLEARLY_BELOW_UNIGRAM = 0.8
"""A generation or LM run's test perplexity is at most this share of its unigram row's."""
KNOWN_FLAGS: set[tuple[str, str]] = set()
"""The flags of the committed report, each with why it stands: nothing else may be flagged."""


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of ``text``."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"report.md has no '## {heading}' section"
    return match.group(1)


def _rows(key: str) -> list[tuple[dict, dict]]:
    """Every (table, row) of the run or reference row ``key`` in ``tables.json``."""
    return [(t, r) for t in TABLES for r in t["rows"] if r["run"] == key]


def _reference(table: dict, name: str, metric: str) -> float:
    (row,) = [r for r in table["rows"] if r["run"] == name]
    return row[metric]["mean"]


def test_the_committed_results_are_of_the_default_runs() -> None:
    report = REPORT.read_text()
    for key in RUNS:
        metrics = json.loads((REPO / "metrics" / f"{key}.json").read_text())
        assert metrics["n_examples"] > 0, key
        assert f"| {key} |" in _section(report, "Runs"), key
        assert _rows(key), f"{key}: in no table of reports/tables.json"
    assert sorted(p.stem for p in (REPO / "metrics").glob("*.json")) == sorted(RUNS)


def test_the_report_flags_only_the_known_flags() -> None:
    report = REPORT.read_text()
    diagnostics = _section(report, "Diagnostics")
    for rule in (COLLAPSED, AT_CHANCE, FIRST_VALIDATION, NEVER_AVERAGED):
        assert f"- **{rule}**" in diagnostics  # the rules the report applied
    in_tables = {(r["run"], f) for t in TABLES for r in t["rows"] for f in r["flags"]}
    assert in_tables == KNOWN_FLAGS
    # the overview's Flags column, run by run
    header, _, *rows = (line for line in _section(report, "Runs").splitlines() if line)
    columns = [c.strip() for c in header.strip("|").split("|")]
    in_overview = set()
    for line in rows:
        if not line.startswith("|"):
            break
        cells = dict(zip(columns, (c.strip() for c in line.strip("|").split("|")), strict=True))
        flags = cells.get("Flags", "-")
        in_overview |= {(cells["Run"], f) for f in flags.split("; ") if f != "-"}
    assert in_overview == KNOWN_FLAGS
    if not KNOWN_FLAGS:
        assert diagnostics.strip().endswith("No run is flagged.")


@pytest.mark.parametrize("key", RUNS)
def test_every_run_beats_its_baseline_row(key: str) -> None:
    """Perplexity runs clearly below the unigram row, rankers above the chance row on R@10
    and MRR, in every table that shows both."""
    compared = 0
    for table, row in _rows(key):
        references = {r["run"] for r in table["rows"]}
        if "test_ppl" in table["columns"] and UNIGRAM in references and row["test_ppl"]:
            unigram = _reference(table, UNIGRAM, "test_ppl")
            assert row["test_ppl"]["mean"] <= CLEARLY_BELOW_UNIGRAM * unigram, (key, unigram)
            compared += 1
        for metric in ("recall_at_10", "mrr"):
            if metric in table["columns"] and CHANCE in references and row[metric]:
                assert row[metric]["mean"] > _reference(table, CHANCE, metric), (key, metric)
                compared += 1
    assert compared, f"{key}: no table shows it beside a unigram or chance row"
