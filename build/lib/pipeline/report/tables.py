"""Paper-shaped result tables: models as rows, metrics as columns, mean ± 95% CI over seeds,
and a paired-bootstrap marker against the paper's baseline (▲ significantly better,
▼ significantly worse, p < 0.05, and a difference at least the metric's practical floor;
see ``significance``).

One ``TableSpec`` per paper table; ``build_tables`` makes one table per spec and corpus
that has at least one of its models, with the columns some row has. A table carries its
paper's title only where the comparison it stands for can be made here (its baseline and
at least one more of its models ran on the corpus); otherwise its neutral topic. Every run
also appears in the ``overview`` table (``overview``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pipeline.config import run_label
from pipeline.eval.catalogue import (
    BLEU,
    BLEU_BEAM5,
    BLEU_HIER,
    CHATEVAL,
    CI_SUFFIX,
    COMBINED,
    DISTINCT_2,
    ENTITY_F1,
    INFORM,
    INFORM_STD,
    MRR,
    PEARSON_P,
    PEARSON_R,
    RECALL,
    SUCCESS,
    SUCCESS_STD,
    TEST_LOSS,
    TEST_PPL,
    TEST_PPL_ELBO,
    VALID_LOSS,
    Metric,
)
from pipeline.eval.text import DEFAULT_TOKENIZE, bleu_signature
from pipeline.names import Task
from pipeline.report.overview import VALID_CE_LABEL, markdown_table
from pipeline.report.results import Estimate, RunResult
from pipeline.report.significance import Comparison, NotComparable, compare, format_p, is_tested


def tested(metric: Metric) -> bool:
    """Whether rows get a significance mark for ``metric`` (``significance.is_tested``)."""
    return is_tested(metric.key)


@dataclass(frozen=True)
class TableSpec:
    """One paper table: which task and models (None: every model of the task), which
    metrics, and the baseline every row is tested against."""

    title: str
    task: Task
    models: tuple[str, ...] | None
    metrics: tuple[Metric, ...]
    baseline: str
    decoding: str = ""  # the metrics' decode suffix (``_hierbeam5``); "" for greedy
    topic: str = ""  # the title on a corpus of one's own, which no paper reported on

    def title_on(self, own_corpus: bool) -> str:
        return (self.topic or self.title) if own_corpus else self.title


# Generate runs' validation and test loss are token cross-entropies: their unit in the
# column (the catalogue's labels are shared with select runs, whose loss is a ranking loss).
VALID_CE = replace(VALID_LOSS, label=VALID_CE_LABEL)
TEST_CE = replace(TEST_LOSS, label="Test CE (nats/token)")
P_VALUE_KEYS = frozenset({PEARSON_P.key})  # columns holding p-values: printed by format_p

CHATEVAL_TITLE = "U-Net Transformer, Tables 4-5: ChatEval metrics ({decoding})"
# ChatEval's columns with their units where a bare number would not say it.
_UNITS = {"avg_length": "Avg len (words)", "embedding_skipped": "Emb skipped (pairs)"}
CHATEVAL_METRICS = tuple(replace(m, label=_UNITS.get(m.key, m.label)) for m in CHATEVAL)
UNET_BASELINES = ("s2sa", "hred", "vhred", "vhcr", "transformer", "adj_transformer")
UNET_MODELS = (*UNET_BASELINES, "unet_linear", "unet_per_layer_att", "unet")
HIER_MODELS = ("hred", "transformer", "set", "mat", "hier")
HIER_ORACLE_ACT_MODELS = ("set_pp", "hier_pp", "hier_cls")
MULTIWOZ_METRICS = (
    BLEU, BLEU_BEAM5, BLEU_HIER, ENTITY_F1, INFORM, SUCCESS, COMBINED, INFORM_STD, SUCCESS_STD,
    TEST_PPL,
)  # fmt: skip

SPECS = (
    TableSpec(
        "U-Net Transformer, Tables 1-2: validation cross-entropy and test perplexity",
        Task.GENERATE,
        UNET_MODELS,
        (VALID_CE, TEST_PPL, TEST_PPL_ELBO),
        "transformer",
        topic="Validation loss and test perplexity",
    ),
    TableSpec(
        "U-Net Transformer, Table 6: ablation",
        Task.GENERATE,
        ("transformer", "transformer_skip", "transformer_skip_conv", "unet"),
        (TEST_PPL,),
        "transformer",
        topic="U-Net ablation: test perplexity",
    ),
    TableSpec(
        CHATEVAL_TITLE.format(decoding="greedy decoding"),
        Task.GENERATE,
        None,
        CHATEVAL_METRICS,
        "transformer",
        topic="ChatEval metrics (greedy decoding)",
    ),
    TableSpec(
        "U-Net Transformer, Table 7: Pearson correlation of history length and test loss",
        Task.GENERATE,
        None,
        (PEARSON_R, replace(PEARSON_P, label="p (of r)")),
        "transformer",
        topic="Pearson correlation of history length and test loss",
    ),
    # One table per setting, as the paper's: what the model sees decides what it is
    # compared with (acts given by an oracle are no fair comparison with none).
    TableSpec(
        "HT-Encoder (HIER), Table 2: context-to-response without annotations",
        Task.GENERATE,
        HIER_MODELS,
        MULTIWOZ_METRICS,
        "transformer",
        topic="HT-Encoder family: BLEU, task success and perplexity",
    ),
    TableSpec(
        "HT-Encoder (HIER), Table 3: context-to-response with oracle dialogue acts",
        Task.GENERATE,
        HIER_ORACLE_ACT_MODELS,
        MULTIWOZ_METRICS,
        "hier_pp",
        topic="HT-Encoder family with dialogue acts: BLEU, task success and perplexity",
    ),
    TableSpec(
        "HT-Encoder (HIER), Table 5: end-to-end (belief state and acts predicted)",
        Task.GENERATE,
        ("hier_joint",),
        MULTIWOZ_METRICS,
        "hier_joint",
        topic="HIER-Joint: BLEU, task success and perplexity",
    ),
    TableSpec(
        "Highway Recurrent Transformer, Table 1: response selection",
        Task.SELECT,
        None,
        (*RECALL.values(), MRR),
        "transformer_ranker",
        topic="Response selection",
    ),
    TableSpec(
        "Hierarchical GPT, Tables 1-5: language-model perplexity",
        Task.LM,
        None,
        (TEST_CE, TEST_PPL),
        "gpt",
        topic="Language-model perplexity",
    ),
)


@dataclass(frozen=True)
class Cell:
    estimate: Estimate | None
    comparison: Comparison | None = None

    def format(self, metric: Metric) -> str:
        if self.estimate is None or math.isnan(self.estimate.mean):
            return "-"
        marker = self.comparison.marker if self.comparison is not None else ""
        if metric.key in P_VALUE_KEYS and math.isnan(self.estimate.ci95):  # "< 0.001"
            return format_p(self.estimate.mean).removeprefix("p ").removeprefix("= ")
        return f"{self.estimate.format(metric.digits)} {marker}".rstrip()


@dataclass(frozen=True)
class Row:
    key: str
    model: str
    cells: tuple[Cell, ...]
    variant: str | None = None  # a further run of the same model (a sweep's row)
    flags: tuple[str, ...] = ()  # names of the run's diagnostics about this table's numbers

    @property
    def label(self) -> str:
        return run_label(self.model, self.variant)


@dataclass(frozen=True)
class Reference:
    """A row that is no trained run (the unigram baseline): its values by metric key,
    for the tables of ``task`` on ``corpus``; ``note`` is printed under each such table."""

    name: str
    corpus: str
    task: Task
    values: dict[str, float]
    note: str | None = None

    def row(self, columns: tuple[Metric, ...]) -> Row | None:
        """Its row in a table of ``columns`` (None if it has none of them)."""
        if not any(m.key in self.values for m in columns):
            return None
        cells = tuple(
            Cell(Estimate(self.values[m.key], math.nan) if m.key in self.values else None)
            for m in columns
        )
        return Row(self.name, self.name, cells)


@dataclass(frozen=True)
class Table:
    title: str
    corpus: str
    baseline: str | None
    columns: tuple[Metric, ...]
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    decoding: str = ""  # TableSpec.decoding


def _ordered(spec: TableSpec, runs: list[RunResult]) -> list[RunResult]:
    if spec.models is None:  # baseline first, then as trained
        return sorted(runs, key=lambda r: r.model != spec.baseline)
    return sorted(runs, key=lambda r: spec.models.index(r.model))  # type: ignore[union-attr]


def bleu_note(bleu_tokenize: str, lowercase: bool | None) -> str:
    """What the BLEU of a table is: sacrebleu's corpus BLEU, case-sensitive (its signature
    says ``case:mixed``) on the text as the corpus vocabulary decodes it; ``lowercase``:
    whether that vocabulary lowercased the corpus (None: not known)."""
    case = {
        True: "the vocabulary lowercased the corpus (`vocab.lowercase: true`), so both "
        "sides are lowercase",
        False: "the vocabulary kept the corpus' case (`vocab.lowercase: false`)",
        None: "on the text as the vocabulary decodes it",
    }[lowercase]
    return (
        f"BLEU: sacrebleu corpus BLEU (0-100), case-sensitive on word-tokenised text; {case}. "
        f"Signature `{bleu_signature(bleu_tokenize)}`."
    )


def paper_title(spec: TableSpec, chosen: list[RunResult]) -> bool:
    """Whether a table of ``chosen`` may carry its paper's title: the comparison the paper
    table makes needs its baseline and at least one more of its models."""
    has_baseline = any(r.model == spec.baseline and r.variant is None for r in chosen)
    return has_baseline and len(chosen) >= 2


def build_table(
    spec: TableSpec,
    corpus: str,
    runs: list[RunResult],
    n_samples: int = 1000,
    seed: int = 0,
    bleu_tokenize: str = DEFAULT_TOKENIZE,
    references: tuple[Reference, ...] = (),
    own: bool = False,
    lowercase: bool | None = None,
) -> Table | None:
    """``spec`` for the runs on ``corpus`` (None if none of its models ran there), with
    the ``references`` of its corpus and task as last rows. ``own``: a corpus of one's own,
    which no paper reported on, or a table without the runs its paper's comparison needs
    (:func:`paper_title`): the table gets its topic as title, and no paper rows.
    ``lowercase``: whether the corpus' vocabulary lowercases (the BLEU note says so)."""
    chosen = [
        r
        for r in runs
        if r.corpus == corpus
        and r.task == spec.task
        and (spec.models is None or r.model in spec.models)
    ]
    if not chosen:
        return None
    chosen = _ordered(spec, chosen)
    columns = tuple(m for m in spec.metrics if any(r.estimate(m.key) for r in chosen))
    if not columns:
        return None
    baseline = next((r for r in chosen if r.model == spec.baseline and r.variant is None), None)
    # a table of one run compares nothing: no row is called its baseline
    baseline_name = spec.baseline if baseline is not None and len(chosen) > 1 else None
    notes: list[str] = []
    if any(m.key.startswith("bleu") and m.key != BLEU_HIER.key for m in columns):
        notes.append(bleu_note(bleu_tokenize, lowercase))
    if n_samples == 0:
        baseline = None  # evaluate.bootstrap_samples: 0 turns the tests off
        notes.append("No significance tests (evaluate.bootstrap_samples is 0).")
    elif baseline is None:
        notes.append(f"No significance test: the baseline {spec.baseline} was not trained.")
    rows = []
    for run in chosen:
        cells = []
        for metric in columns:
            comparison = None
            tested = baseline is not None and run is not baseline and is_tested(metric.key)
            if tested and run.estimate(metric.key) is not None:
                if baseline.estimate(metric.key) is None:  # e.g. only HIER decodes beam 5
                    notes.append(f"{run.key}, {metric.label}: the baseline has none; untested.")
                    cells.append(Cell(run.estimate(metric.key)))
                    continue
                try:
                    comparison = compare(run, baseline, metric.key, n_samples, seed, bleu_tokenize)
                except NotComparable as why:
                    notes.append(f"{run.key} vs {baseline.key}, {metric.label}: {why}.")
            cells.append(Cell(run.estimate(metric.key), comparison))
        rows.append(Row(run.key, run.model, tuple(cells), run.variant))
    for reference in references:
        row = reference.row(columns)
        if reference.corpus == corpus and reference.task == spec.task and row is not None:
            rows.append(row)
            notes += [reference.note] if reference.note else []
    return Table(
        spec.title_on(own or not paper_title(spec, chosen)),
        corpus,
        baseline_name,
        columns,
        tuple(rows),
        tuple(notes),
        spec.decoding,
    )


def decode_specs(runs: list[RunResult]) -> tuple[TableSpec, ...]:
    """A ChatEval table for each further decoding the runs were evaluated with
    (``evaluate.decodes``: metrics ``distinct_2_topp0.9``, ``distinct_2_beam5``, ...)."""
    prefix = DISTINCT_2.key
    suffixes = sorted(
        {
            k.removeprefix(prefix)
            for r in runs
            for k in r.metrics
            if k.startswith(f"{prefix}_") and not k.endswith(CI_SUFFIX)
        }
    )
    specs = []
    for suffix in suffixes:
        models = tuple(dict.fromkeys(r.model for r in runs if f"{prefix}{suffix}" in r.metrics))
        metrics = tuple(
            Metric(f"{m.key}{suffix}", m.label, m.digits, m.better) for m in CHATEVAL_METRICS
        )
        title = CHATEVAL_TITLE.format(decoding=f"decoding {suffix.lstrip('_')}")
        baseline = "transformer" if "transformer" in models else models[0]
        topic = f"ChatEval metrics (decoding {suffix.lstrip('_')})"
        specs.append(TableSpec(title, Task.GENERATE, models, metrics, baseline, topic=topic))
    return tuple(specs)


def multiwoz_decode_specs(runs: list[RunResult]) -> tuple[TableSpec, ...]:
    """The HT-Encoder tables again for each further decoding of a MultiWOZ run (the paper
    reports beam search: ``evaluate.models.hier: [{strategy: hier_beam}]`` gives
    ``bleu_hier_hierbeam5``, ``inform_hierbeam5``, ...)."""
    prefix = f"{BLEU_HIER.key}_"
    suffixes = sorted(
        {
            k.removeprefix(BLEU_HIER.key)
            for r in runs
            for k in r.metrics
            if k.startswith(prefix) and not k.endswith(CI_SUFFIX)
        }
    )
    decoded = tuple(m for m in MULTIWOZ_METRICS if m not in (BLEU_BEAM5, TEST_PPL))
    return tuple(
        replace(
            spec,
            title=f"{spec.title} (decoding {suffix.lstrip('_')})",
            topic=f"{spec.topic.split(':')[0]}: BLEU and task success "
            f"(decoding {suffix.lstrip('_')})",
            metrics=tuple(m.decoded(suffix) for m in decoded),
            decoding=suffix,
        )
        for suffix in suffixes
        for spec in SPECS
        if spec.metrics == MULTIWOZ_METRICS
    )


def build_tables(
    runs: list[RunResult],
    n_samples: int = 1000,
    seed: int = 0,
    bleu_tokenize: dict[str, str] | None = None,
    references: tuple[Reference, ...] = (),
    own_corpora: frozenset[str] = frozenset(),
    lowercase: dict[str, bool] | None = None,
) -> list[Table]:
    """Every paper table that has runs, per corpus (corpora in order of first run).
    ``bleu_tokenize`` maps a corpus to its sacrebleu tokenizer (default ``13a``),
    ``lowercase`` to whether its vocabulary lowercases;
    ``references`` are appended to the tables of their corpus and task; the corpora of
    ``own_corpora`` (declared in params) get tables of their own (``build_table``)."""
    corpora = list(dict.fromkeys(r.corpus for r in runs))
    chateval = next(i for i, spec in enumerate(SPECS) if spec.metrics == CHATEVAL_METRICS)
    specs = (
        *SPECS[: chateval + 1],
        *decode_specs(runs),
        *SPECS[chateval + 1 :],
        *multiwoz_decode_specs(runs),
    )
    tables = []
    for corpus in corpora:
        tokenize = (bleu_tokenize or {}).get(corpus, DEFAULT_TOKENIZE)
        for spec in specs:
            own = corpus in own_corpora
            case = (lowercase or {}).get(corpus)
            table = build_table(
                spec, corpus, runs, n_samples, seed, tokenize, references, own, case
            )
            if table is not None:
                tables.append(table)
    return tables


def table_markdown(table: Table) -> str:
    """The table as GitHub markdown, then its notes."""
    header = ["Model", *[m.label for m in table.columns]]
    body = [
        [
            row.label
            + (" (baseline)" if row.label == table.baseline else "")
            + "".join(f" **[{flag}]**" for flag in row.flags)
        ]
        + [cell.format(metric) for cell, metric in zip(row.cells, table.columns, strict=True)]
        for row in table.rows
    ]
    text = markdown_table(header, body)
    if table.notes:
        text += "\n\n" + "\n".join(f"- {note}" for note in table.notes)
    return text


def table_json(table: Table) -> dict[str, object]:
    """Machine-readable form (the MLflow artifact and ``reports/tables.json``)."""

    def cell(c: Cell) -> dict[str, object] | None:
        if c.estimate is None:
            return None
        ci = None if math.isnan(c.estimate.ci95) else c.estimate.ci95  # JSON has no NaN
        out: dict[str, object] = {"mean": c.estimate.mean, "ci95": ci}
        if c.comparison is not None:
            out |= {"p_better": c.comparison.p_better, "p_worse": c.comparison.p_worse}
        return out

    return {
        "title": table.title,
        "corpus": table.corpus,
        "baseline": table.baseline,
        "columns": [m.key for m in table.columns],
        "rows": [
            {
                "run": r.key,
                "model": r.model,
                "variant": r.variant,
                "flags": list(r.flags),
                **{m.key: cell(c) for m, c in zip(table.columns, r.cells, strict=True)},
            }
            for r in table.rows
        ],
        "notes": list(table.notes),
    }
