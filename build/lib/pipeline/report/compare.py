"""The runs' key metrics side by side in a terminal: ``python -m pipeline compare``
(``make compare``).

``dvc exp show`` gives every metric of every run's file a column of its own (363 columns
for the default run); this reads the same files (``metrics/<run>.json`` of the workspace)
and prints one table per task with that task's key metrics, each table within the
terminal's width (120 columns at most by default; wider column sets wrap onto further
tables). ``--rev REV`` puts each value's change since a git revision beside it (what
``dvc metrics diff REV`` says, in the same narrow form); ``--metrics`` picks the columns.

A run's task is read off its metrics: a ranker writes Recall@k, a generation model the
ChatEval lengths, a language model neither. Values are the greedy decoding's (decoded
metrics of other decodings carry a suffix: ``distinct_2_topp0.9``, give it to
``--metrics``); with several seeds the mean and the half-width of its 95% interval.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import METRICS_DIR, read_metrics
from pipeline.errors import ConfigError
from pipeline.eval import catalogue
from pipeline.eval.catalogue import (
    AVG_LENGTH,
    BLEU,
    CI_SUFFIX,
    COMBINED,
    DISTINCT_1,
    DISTINCT_2,
    EMB_AVERAGE,
    INFORM,
    MRR,
    RECALL,
    SUCCESS,
    TEST_LOSS,
    TEST_PPL,
    Better,
    Metric,
)
from pipeline.names import Task

COMMAND = "compare"
MAX_WIDTH = 120  # a table never gets wider than this, whatever the terminal says
GAP = "  "  # between columns

# What a researcher looks at first for each task; a column no run has is left out.
KEY_METRICS: dict[Task, tuple[Metric, ...]] = {
    Task.GENERATE: (
        *(TEST_PPL, BLEU, DISTINCT_1, DISTINCT_2, AVG_LENGTH, EMB_AVERAGE),
        *(INFORM, SUCCESS, COMBINED),  # MultiWOZ runs only
    ),
    Task.SELECT: (RECALL[1], RECALL[10], RECALL[50], MRR),
    Task.LM: (TEST_PPL, TEST_LOSS),
}

Metrics = dict[str, float]


def task_of(metrics: Metrics) -> Task:
    """The task a run's metrics belong to (see the module's docstring)."""
    if RECALL[10].key in metrics:
        return Task.SELECT
    if AVG_LENGTH.key in metrics:
        return Task.GENERATE
    return Task.LM


def workspace_metrics(root: Path) -> dict[str, Metrics]:
    """``{run: metrics}`` of the workspace's ``metrics/`` folder."""
    folder = root / METRICS_DIR
    return {path.stem: read_metrics(path) for path in sorted(folder.glob("*.json"))}


def revision_metrics(root: Path, rev: str) -> dict[str, Metrics]:
    """``{run: metrics}`` of ``metrics/`` as committed at git revision ``rev``."""
    listing = _git(root, "ls-tree", "--name-only", f"{rev}:{METRICS_DIR}", what=f"--rev {rev}")
    runs: dict[str, Metrics] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(n for n in listing.splitlines() if n.endswith(".json")):
            copy = Path(tmp) / name  # read through the one reader: same checks, same NaN
            copy.write_text(_git(root, "show", f"{rev}:{METRICS_DIR}/{name}", what=rev))
            runs[copy.stem] = read_metrics(copy)
    return runs


def _git(root: Path, *args: str, what: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "git failed"
        raise ConfigError("--rev", f"cannot read {METRICS_DIR}/ at {what}: {reason}")
    return done.stdout


@dataclass(frozen=True)
class Table:
    """One task's rows (runs) and columns (metrics), ready to print."""

    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""

    def lines(self) -> list[str]:
        widths = [
            max(len(r[i]) for r in [self.header, *self.rows]) for i in range(len(self.header))
        ]
        cells = [
            GAP.join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in [self.header, *self.rows]
        ]
        rule = GAP.join("-" * w for w in widths)
        note = textwrap.wrap(self.note, max(len(rule), 40))
        return [self.title, cells[0], rule, *cells[1:], *note]

    @property
    def width(self) -> int:
        return max(len(line) for line in self.lines())


def cell(metric: Metric, metrics: Metrics | None, before: Metrics | None) -> str:
    """``167.64``, ``137.80±1.21`` with seeds, ``167.64 (-0.12)`` against a revision,
    ``-`` where the run has no such metric."""
    if metrics is None or metric.key not in metrics:
        return "-"
    value = metrics[metric.key]
    text = "nan" if math.isnan(value) else f"{value:.{metric.digits}f}"
    half = metrics.get(metric.key + CI_SUFFIX)
    if half is not None and not math.isnan(half):
        text += f"±{half:.{metric.digits}f}"
    if before is not None:
        if metric.key not in before:
            text += " (new)"
        else:
            change = value - before[metric.key]
            text += f" ({change:+.{metric.digits}f})" if change else " (=)"
    return text


def metric_for(key: str) -> Metric | None:
    """The catalogue's metric of ``key``, also of another decoding (``bleu_topp0.9``:
    labelled ``BLEU topp0.9``); ``None`` for a key the catalogue does not know."""
    known = [m for m in vars(catalogue).values() if isinstance(m, Metric)]
    known += RECALL.values()
    for metric in sorted(known, key=lambda m: -len(m.key)):  # bleu_beam5 before bleu
        if key == metric.key:
            return metric
        if key.startswith(metric.key + "_"):
            suffix = key[len(metric.key) + 1 :]
            return Metric(key, f"{metric.label} {suffix}", metric.digits, metric.better)
    return None


def heading(metric: Metric) -> str:
    """A column's heading: its label and which way is better (the bare key for a metric
    the catalogue does not know)."""
    if metric_for(metric.key) is None:
        return metric.key
    return f"{metric.label} {'↓' if metric.better is Better.LOWER else '↑'}"


def tables(
    runs: dict[str, Metrics],
    before: dict[str, Metrics] | None = None,
    metrics: Sequence[str] = (),
    width: int = MAX_WIDTH,
) -> list[Table]:
    """The comparison of ``runs`` (against ``before``, a revision's runs), a table per task
    split so each fits ``width`` columns. ``metrics`` (keys) replace the task's key
    metrics."""
    everywhere = [*runs.values(), *(before or {}).values()]
    missing = [k for k in metrics if not any(k in m for m in everywhere)]
    if missing:
        some = sorted({k for m in everywhere for k in m if not k.endswith(CI_SUFFIX)})
        raise ConfigError(
            "--metrics", f"no run has {', '.join(missing)}; the runs have: {', '.join(some)}"
        )
    out: list[Table] = []
    for task in Task:
        names = sorted(run for run, values in runs.items() if task_of(values) == task)
        if before is not None:
            names += sorted(r for r, v in before.items() if task_of(v) == task and r not in runs)
        if not names:
            continue
        wanted = [metric_for(k) or Metric(k, k) for k in metrics] or list(KEY_METRICS[task])
        had = before or {}
        columns = [m for m in wanted if any(m.key in runs.get(n, had.get(n, {})) for n in names)]
        for part, cols in enumerate(_fit(names, columns, runs, before, width)):
            count = f"{len(names)} run{'s' if len(names) > 1 else ''}"
            title = f"{task.value} ({count})" + (" continued" if part else "")
            if before is not None and not part:
                title += ": change since the revision in brackets"
            rows = [
                [_row_name(name, runs)]
                + [
                    cell(m, runs.get(name), None if before is None else before.get(name, {}))
                    for m in cols
                ]
                for name in names
            ]
            note = ""
            if task == Task.GENERATE and not metrics and (decodings := other_decodings(runs)):
                note = (
                    f"greedy decoding; also in metrics/: {', '.join(decodings)} "
                    f"(--metrics {BLEU.key}_{decodings[0]} {DISTINCT_2.key}_{decodings[0]})"
                )
            out.append(Table(title, ["run", *map(heading, cols)], rows, note))
    return out


def _row_name(name: str, runs: dict[str, Metrics]) -> str:
    return name if name in runs else f"{name} (gone)"


def other_decodings(runs: dict[str, Metrics]) -> list[str]:
    """Suffixes of the decodings besides greedy that the runs' metrics hold (``topp0.9``)."""
    prefix = DISTINCT_2.key + "_"
    return sorted(
        {
            key[len(prefix) :]
            for metrics in runs.values()
            for key in metrics
            if key.startswith(prefix) and not key.endswith(CI_SUFFIX)
        }
    )


def _fit(
    names: list[str],
    columns: list[Metric],
    runs: dict[str, Metrics],
    before: dict[str, Metrics] | None,
    width: int,
) -> list[list[Metric]]:
    """``columns`` in consecutive groups, each as wide as ``width`` allows (at least one
    column a group, however narrow the terminal)."""
    first = max(len("run"), *(len(_row_name(n, runs)) for n in names))
    groups: list[list[Metric]] = [[]]
    used = first
    for metric in columns:
        cells = [
            cell(metric, runs.get(n), None if before is None else before.get(n, {})) for n in names
        ]
        need = len(GAP) + max(len(heading(metric)), *map(len, cells))
        if groups[-1] and used + need > width:
            groups.append([])
            used = first
        groups[-1].append(metric)
        used += need
    return [g for g in groups if g]


def render(tables_: list[Table]) -> str:
    """The tables, a blank line between them."""
    return "\n\n".join("\n".join(t.lines()) for t in tables_)


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``compare`` subcommand of ``python -m pipeline``."""
    sub = commands.add_parser(
        COMMAND,
        help="the runs' key metrics side by side, a table per task (metrics/*.json)",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub.add_argument("--root", default=".", help="project folder (holds metrics/).")
    sub.add_argument(
        "--rev", help="a git revision (main, HEAD~1, a tag): show each value's change since it."
    )
    sub.add_argument(
        "--metrics",
        nargs="+",
        default=[],
        metavar="KEY",
        help="metric keys of metrics/<run>.json to show instead of each task's key metrics "
        "(test_ppl bleu_topp0.9 ...).",
    )
    sub.add_argument(
        "--width",
        type=int,
        default=None,
        help=f"columns a table may take (default: the terminal's, at most {MAX_WIDTH}).",
    )


def run_command(args: argparse.Namespace) -> int:
    """Print the comparison; 1 when there is nothing to compare."""
    root = Path(args.root).resolve()
    runs = workspace_metrics(root)
    before = revision_metrics(root, args.rev) if args.rev else None
    if not runs and not before:
        print(f"{COMMAND}: no {root / METRICS_DIR}/*.json yet: run the pipeline (make repro)")
        return 1
    width = args.width or min(MAX_WIDTH, shutil.get_terminal_size((MAX_WIDTH, 24)).columns)
    print(render(tables(runs, before, args.metrics, width)))
    return 0
