"""The report's first table: one row per trained run (model, corpus, size, training, the
validation loss it kept and its headline test metric), and the Markdown table writer every
table of the report uses.

The validation loss is not one quantity: generate and lm runs validate on token
cross-entropy (nats per target token), select runs on the ranking loss their training
minimises (their ``model.loss``: ``bce``, ``models.base.candidate_bce``, binary
cross-entropy of each candidate's score against its label averaged over the candidates,
nats per candidate; ``lse``, the smooth max-margin loss per example). Each task has its own
column, so that no number sits under another's unit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.eval.catalogue import HEADLINE, VALID_LOSS, Metric
from pipeline.names import Task
from pipeline.report.results import Estimate, RunResult

VALID_CE_LABEL = "Valid CE (nats/token)"
VALID_RANKING_LABEL = "Valid ranking loss (nats)"


def valid_loss_label(task: Task) -> str:
    """What a run's validation loss is, by task (a column header, an axis label)."""
    return VALID_RANKING_LABEL if task is Task.SELECT else VALID_CE_LABEL


def format_count(n: int) -> str:
    """``1234567`` -> ``1.23M``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


@dataclass(frozen=True)
class OverviewRow:
    key: str
    model: str
    corpus: str
    task: Task
    tuned: bool
    n_parameters: int
    seeds: int
    steps: int | None
    valid_loss: Estimate | None
    headline: Metric
    value: Estimate | None
    flags: tuple[str, ...] = ()


def overview(
    runs: list[RunResult], flags: Mapping[str, Sequence[str]] | None = None
) -> list[OverviewRow]:
    """One row per trained run: what a researcher reads first; ``flags[run]``: the names
    of the run's diagnostics (``diagnostics.Flag.name``)."""
    rows = []
    for run in runs:
        headline = HEADLINE[run.task]
        steps = [t.metric("steps") for t in run.trained if t.metrics.get("steps") is not None]
        rows.append(
            OverviewRow(
                run.key,
                run.label,
                run.corpus,
                run.task,
                run.tuned,
                run.n_parameters,
                len(run.seeds),
                int(max(steps)) if steps else None,
                run.estimate(VALID_LOSS.key),
                headline,
                run.estimate(headline.key),
                tuple((flags or {}).get(run.key, ())),
            )
        )
    return rows


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def overview_markdown(rows: list[OverviewRow]) -> str:
    """The overview as Markdown: a validation-loss column per kind of loss the runs have,
    and a ``Flags`` column when some run is flagged."""
    kinds = [
        label
        for label in (VALID_CE_LABEL, VALID_RANKING_LABEL)
        if any(valid_loss_label(r.task) == label for r in rows)
    ]
    flagged = any(r.flags for r in rows)
    header = ["Run", "Model", "Corpus", "Task", "Params", "Seeds", "Steps", *kinds, "Headline"]
    header += ["Flags"] if flagged else []
    body = []
    for r in rows:
        loss = "-" if r.valid_loss is None else r.valid_loss.format(3)
        line = [
            r.key,
            r.model + (" (tuned)" if r.tuned else ""),
            r.corpus,
            r.task,
            format_count(r.n_parameters),
            str(r.seeds),
            "-" if r.steps is None else str(r.steps),
            *[loss if valid_loss_label(r.task) == k else "-" for k in kinds],
            "-" if r.value is None else f"{r.headline.label} {r.value.format(r.headline.digits)}",
        ]
        body.append(line + (["; ".join(r.flags) or "-"] if flagged else []))
    return markdown_table(header, body)
