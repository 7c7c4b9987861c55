"""The committed results document (``report.results``: ``results/STUDY.md`` in
``profiles/study.yaml``), written by the report stage beside ``reports/``.

Where ``reports/report.md`` is the working report of whatever ran, this document is what a
researcher cites: where and from which code the numbers came, what each run cost, every
comparison the papers draw with one verdict each (``published.Outcome``: reproduced,
not reproduced, or inconclusive, by ``published.VERDICT_RULES``), then the tables with
the papers' rows and the figures (copied into a folder beside the document, so the two are committed
together). Nothing in it is edited by hand: rerun the report stage.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from pipeline.artifacts import SEEDS_FILE, WALL_SECONDS, EvalRecord, Layout, read_train
from pipeline.config import Params
from pipeline.machine import code_version
from pipeline.report.overview import format_count, markdown_table
from pipeline.report.published import (
    VERDICT_RULES,
    Outcome,
    Verdict,
    tables_markdown,
    verdicts,
)
from pipeline.report.results import RunResult
from pipeline.report.tables import Table


def figures_folder(document: Path) -> Path:
    """Where the document's figures go: ``results/STUDY.md`` -> ``results/study/``."""
    return document.with_name(document.stem.lower())


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f}"


def _provenance(
    params: Params, root: Path, runs: list[RunResult]
) -> tuple[list[str], list[list[str]]]:
    """Lines naming the code and machines, and one row per run: size, budget, time."""
    layout = Layout(root)
    commits: dict[str, list[str]] = {}
    machines: dict[str, list[str]] = {}
    rows: list[list[str]] = []
    total = 0.0
    for run in runs:
        record = read_train(layout, run.key)
        commits.setdefault(record.commit or "unknown", []).append(run.key)
        machines.setdefault(record.machine or "unknown", []).append(run.key)
        train_s = sum(s.metric(WALL_SECONDS) for s in record.seeds)
        eval_path = layout.eval_out(run.key) / SEEDS_FILE
        eval_s = EvalRecord.read(eval_path).wall_s if eval_path.is_file() else None
        total += train_s + (eval_s or 0.0)
        steps = sorted({int(s.metric("steps")) for s in record.seeds})
        rows.append(
            [
                run.key,
                format_count(run.n_parameters),
                "/".join(map(str, steps)),
                str(_batch_size(params, run)),
                str(len(record.seeds)),
                _minutes(train_s),
                _minutes(eval_s),
            ]
        )

    def grouped(values: dict[str, list[str]]) -> str:
        if len(values) == 1:
            return f"`{next(iter(values))}`"
        return "; ".join(f"`{v}` ({', '.join(keys)})" for v, keys in values.items())

    lines = [
        f"- Trained and evaluated by the code at commit {grouped(commits)}; this document "
        f"written at `{code_version(root) or 'unknown'}` on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        f"- Machine: {grouped(machines)}.",
        f"- Training and evaluation of the {len(runs)} runs took {total / 3600:.2f} h of wall "
        "time (per run below; download, tokenize and report stages not included).",
    ]
    return lines, rows


def _batch_size(params: Params, run: RunResult) -> int:
    """The run's batch size as trained (a tuned run: before its search's choice)."""
    return params.train.run(run.model, run.corpus).batch_size


def _verdict_table(found: Iterable[Verdict]) -> str:
    header = ["Comparison (paper)", "Paper", "Ours (mean ± 95% CI)", "Verdict", "Why; test"]
    body = [
        [
            f"{v.claim_text} ({v.table.split(':')[0]})",
            v.paper or "-",
            v.ours_text,
            f"**{v.outcome.value}**",
            v.reason + v.test,
        ]
        for v in found
    ]
    return markdown_table(header, body)


def _tally(found: list[Verdict]) -> str:
    counts = {o: sum(v.outcome is o for v in found) for o in Outcome}
    return ", ".join(f"{n} {o.value}" for o, n in counts.items() if n)


def studymarkdown_table(
    params: Params, root: Path, runs: list[RunResult], tables: list[Table], figures: list[Path]
) -> str:
    """The document's text; ``figures`` are paths relative to the document."""
    lines, rows = _provenance(params, root, runs)
    found = [v for table in tables for v in verdicts(table)]
    notes = [
        f"- {corpus}: trains on its validation dialogues (a seeded {c.split.valid:.0%} of "
        "them held out for validation) and tests on its own test split: the machine "
        "has no training file (`train_on: valid`); the papers train on the full training set."
        for corpus, c in params.tokenize.corpora.items()
        if c.train_on == "valid" and corpus in params.corpora
    ]
    seeds = sorted({len(r.seeds) for r in runs})
    parts = [
        "# hiertx study: the papers' comparisons at this machine's scale",
        "",
        "Written by the report stage (`report.results`) from the runs of the params it was "
        "given; never edited by hand. Reproduce: `cp profiles/study.yaml params.yaml && make "
        "repro` (README).",
        "",
        *lines,
        "",
        "## Verdicts",
        "",
        f"Each comparison a paper draws, where this study trained both models "
        f"({'/'.join(map(str, seeds))} seeds each). {VERDICT_RULES} "
        f"In all: {_tally(found) or 'no comparison'}.",
        "",
        _verdict_table(found),
        "",
        "The papers' numbers come from their full corpora and model sizes (the tables "
        "below say which); ours from reduced models and budgets, so only directions are "
        "compared, never values.",
        "",
        *([*notes, ""] if notes else []),
        "## Runs",
        "",
        "Every model of a comparison trains the same steps on batches of the same size "
        "(`train` of the params); wall time is summed over seeds.",
        "",
        markdown_table(["Run", "Params", "Steps", "Batch", "Seeds", "Train min", "Eval min"], rows),
        "",
        "## Tables",
        "",
        tables_markdown(tables),
        "## Figures",
        "",
        *[f"![{p.stem}]({p.as_posix()})\n" for p in figures],
    ]
    return "\n".join(parts).rstrip() + "\n"


def write_study(
    params: Params,
    root: Path,
    runs: list[RunResult],
    tables: list[Table],
    report_figures: Iterable[Path],
) -> Path | None:
    """Write ``params.report.results`` (relative to ``root``) and copy the report's
    figures beside it; None when the params name no document."""
    if params.report.results is None:
        return None
    document = root / params.report.results
    folder = figures_folder(document)
    if folder.exists():
        shutil.rmtree(folder)  # figures of an earlier run must not linger
    folder.mkdir(parents=True)
    copied = []
    for figure in report_figures:
        shutil.copy2(figure, folder / figure.name)
        copied.append((folder / figure.name).relative_to(document.parent))
    document.write_text(studymarkdown_table(params, root, runs, tables, copied))
    return document
