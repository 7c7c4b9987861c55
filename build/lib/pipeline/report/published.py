"""The papers' own numbers, printed under the report's tables of the same shape.

Each paper-shaped table gets the rows its paper published (values as printed, with the
corpus and training each was measured at) and, for each comparison the paper draws
(U-Net beats the Transformer on test perplexity, ...), whether ours goes the same way and
whether that is significant. A reader sees at once whether a published effect holds in
this run and how far the two setups are apart: a quick profile on chitchat is no
reproduction of a PersonaChat number, and the lines say so.

Sources (``../shared/seeds`` in the project's papers): Donahue et al., "Injecting
Hierarchy with U-Net Transformers" (Tables 1, 2, 4, 5, 7); Santra et al., "Hierarchical
Transformer for Task Oriented Dialog Systems" (Tables 2, 3, 5: their BLEU is the
GO_/EOS_-wrapped scorer, our ``bleu_hier``; Inform/Success the official evaluator, our
``inform``/``success``; Score = BLEU + (Inform + Success) / 2); Chiang et al., "Learning
Multi-Level Information for Dialogue Response Selection by Highway Recurrent
Transformer" (Table 1, test half of each cell, percentages as fractions as our R@k and
MRR); Roh et al., "Hierarchical GPT with Congruent Transformers" (the 6-layer column of
Tables 1, 2, 4, 5, the configuration our models default to).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pipeline.eval.catalogue import Metric
from pipeline.eval.language import protocol_text
from pipeline.names import Task
from pipeline.report.results import RunResult
from pipeline.report.significance import ALPHA, format_p, practical_floor
from pipeline.report.tables import Cell, Table, table_markdown


@dataclass(frozen=True)
class PaperTable:
    """One published table: ``values[model][metric key]`` as printed."""

    source: str
    corpus: str
    setup: str
    values: dict[str, dict[str, float]]


@dataclass(frozen=True)
class Claim:
    """A comparison the paper draws: ``better`` beats ``worse`` on ``metric``.
    ``paper_metric``: the paper's column when it measured the same thing another way (its
    official-scheme Success for our standardized one)."""

    better: str
    worse: str
    metric: str
    paper_metric: str | None = None


_FULL = "full training set, each model trained to its lowest validation loss"
_UNET_PPL = ("best_valid_loss", "test_ppl")
_CHATEVAL = ("avg_length", "distinct_1", "distinct_2", "embedding_average", "embedding_extrema")
_HIER = ("bleu_hier", "entity_f1", "inform", "success", "combined")


def _rows(keys: tuple[str, ...], rows: dict[str, tuple[float | None, ...]]) -> dict:
    return {
        model: {k: v for k, v in zip(keys, values, strict=True) if v is not None}
        for model, values in rows.items()
    }


def _hrt(corpus: str, rows: dict[str, tuple[float | None, ...]]) -> PaperTable:
    """One corpus of the HRT paper's Table 1: (R@10, MRR) of the test half of each cell."""
    setup = (
        "full training set, trained on 10 candidates per example (9 sampled negatives); "
        "R@k and MRR over the 100 candidates of each test example (one correct)"
    )
    return PaperTable("HRT paper, Table 1", corpus, setup, _rows(("recall_at_10", "mrr"), rows))


# The HGPT paper's layer sweeps (test PPL), keyed by the variant names of the paper
# profile's runs (`gpt-ptb-l4`, `hgpt-ptb-l2_2_2`): Tables 1-2 (GPT by layers), 3 (HGPT by
# sentence encoder / document decoder / sentence decoder layers; its second 9-layer row,
# printed 4/4/2, is left out: it sums to 10) and 5 (congruent HGPT; Table 4 repeats rows
# of Table 3). The 6-layer runs (GPT 6, HGPT 1/1/4) are the table above.
_HGPT_SWEEP = {
    "gpt": {"l4": 54.9, "l8": 52.4, "l10": 52.8, "l12": 52.4, "l15": 54.0},
    "congruent_gpt": {"l4": 50.5, "l8": 50.7, "l10": 51.1, "l12": 51.5, "l15": 53.2},
    "hgpt": {
        "l1_1_1": 58.4, "l1_1_2": 53.0, "l1_1_3": 51.5, "l2_2_1": 56.9, "l2_2_2": 52.6,
        "l2_2_3": 50.8, "l3_3_1": 56.1, "l2_2_4": 50.5, "l3_3_2": 52.7, "l3_3_3": 51.6,
        "l3_3_4": 51.1, "l4_4_2": 53.0, "l4_4_3": 53.3, "l4_4_4": 51.6, "l5_5_3": 53.4,
        "l5_5_4": 53.2, "l5_5_5": 53.4, "l6_6_3": 53.5,
    },
    "congruent_hgpt": {"l1_1_2": 52.8, "l2_2_4": 50.4, "l3_3_4": 50.5, "l4_4_4": 50.9,
                       "l5_5_5": 51.2},
}  # fmt: skip

# Keyed by the start of the report table's title.
PAPERS: dict[str, tuple[PaperTable, ...]] = {
    "U-Net Transformer, Tables 1-2": (
        PaperTable("U-Net paper, Table 1", "Cornell Movie-Dialogs", _FULL, _rows(_UNET_PPL, {
            "s2sa": (3.983, 53.43), "hred": (3.945, 51.21), "vhred": (3.940, 51.05),
            "vhcr": (3.937, 50.73), "transformer": (3.883, 48.30),
            "adj_transformer": (3.860, 47.16), "unet_linear": (3.857, 47.07),
            "unet": (3.853, 46.87),
        })),
        PaperTable("U-Net paper, Table 2", "PersonaChat", _FULL, _rows(_UNET_PPL, {
            "s2sa": (3.736, 42.75), "hred": (3.684, 40.48), "vhcr": (3.685, 40.45),
            "vhred": (3.679, 40.11), "transformer": (3.639, 39.06),
            "unet_per_layer_att": (3.610, 37.72), "unet": (3.581, 36.86),
        })),
    ),
    "U-Net Transformer, Table 6": (
        PaperTable("U-Net paper, Table 6", "Cornell Movie-Dialogs", _FULL, {
            "transformer": {"test_ppl": 48.30}, "transformer_skip": {"test_ppl": 48.92},
            "transformer_skip_conv": {"test_ppl": 47.09}, "unet": {"test_ppl": 46.87},
        }),
    ),
    "U-Net Transformer, Tables 4-5": (
        PaperTable("U-Net paper, Table 4", "Cornell Movie-Dialogs", f"{_FULL}; greedy",
                   _rows(_CHATEVAL, {
            "hred": (4.18, 0.00361, 0.00838, 0.425, 0.320),
            "vhred": (4.06, 0.00442, 0.0103, 0.423, 0.313),
            "vhcr": (3.61, 0.005, 0.0122, 0.428, 0.315),
            "s2sa": (8.29, 0.230, 0.146, 0.577, 0.356),
            "transformer": (9.49, 0.0242, 0.163, 0.583, 0.354),
            "unet": (9.14, 0.0239, 0.154, 0.594, 0.366),
        })),
        PaperTable("U-Net paper, Table 5", "PersonaChat", f"{_FULL}; greedy", _rows(_CHATEVAL, {
            "hred": (10.1, 0.00597, 0.0118, 0.823, 0.466),
            "vhred": (10.3, 0.00675, 0.0139, 0.822, 0.463),
            "vhcr": (10.3, 0.00675, 0.0139, 0.822, 0.463),
            "s2sa": (10.0, 0.00675, 0.0139, 0.822, 0.463),
            "transformer": (11.4, 0.00932, 0.0243, 0.825, 0.453),
            "unet": (10.8, 0.00916, 0.0238, 0.818, 0.473),
        })),
    ),
    "U-Net Transformer, Table 7": (
        PaperTable("U-Net paper, Table 7", "corpus not stated", _FULL, {
            "transformer": {"length_loss_pearson_r": 0.0358},
            "unet": {"length_loss_pearson_r": 0.0308},
        }),
    ),
    "HT-Encoder (HIER), Table 2": (
        PaperTable("HIER paper, Table 2", "MultiWOZ 2.0", f"{_FULL}; beam 5", _rows(_HIER, {
            "hred": (17.50, None, 70.7, 60.9, 83.3),
            "transformer": (19.1, 55.1, 71.1, 59.9, 84.60),
            "set": (18.67, 51.61, 76.80, 57.69, 85.92),
            "mat": (18.86, 54.89, 71.9, 52.5, 81.06),
            "hier": (20.91, 54.45, 73.60, 60.10, 87.76),
        })),
    ),
    "HT-Encoder (HIER), Table 3": (
        PaperTable("HIER paper, Table 3", "MultiWOZ 2.0", f"{_FULL}; beam 5", _rows(_HIER, {
            "set_pp": (25.56, 82.27, 85.7, 74.3, 105.56),
            "hier_pp": (29.54, 85.01, 88.3, 85.4, 116.39),
            "hier_cls": (29.29, 84.23, 88.3, 85.9, 116.39),
        })),
    ),
    "HT-Encoder (HIER), Table 5": (
        PaperTable("HIER paper, Table 5", "MultiWOZ 2.0", f"{_FULL}; beam 5", _rows(_HIER, {
            "hier_joint": (19.74, 53.94, 80.5, 71.7, 95.84),
        })),
    ),
    "Highway Recurrent Transformer, Table 1": (
        _hrt("DSTC7 Ubuntu, subtask 1 (test)", {
            "dual_lstm": (0.587, 0.3537), "hier_lstm": (0.575, 0.3454),
            "transformer_ranker": (0.606, 0.3606), "transformer_last_ranker": (0.491, 0.2808),
            "hrt_all": (0.662, 0.4040), "hrt_last": (0.670, 0.4019),
            "ensemble": (0.679, 0.4352),
        }),
        _hrt("DSTC7 Advising, subtask 1 (test)", {
            "dual_lstm": (0.398, 0.1571), "hier_lstm": (0.478, 0.2384),
            "transformer_ranker": (0.524, 0.2530), "transformer_last_ranker": (0.526, 0.2512),
            "hrt_all": (0.484, 0.2143), "hrt_last": (0.516, 0.2536),
            "ensemble": (0.548, 0.2789),
        }),
    ),
    "Hierarchical GPT, Tables 1-5": (
        PaperTable("HGPT paper, Tables 1, 2, 4, 5 (6 layers)", "Penn Treebank (Mikolov)",
                   "8 heads x 512, 6 Transformer layers (HGPT 1/1/4)", {
            "gpt": {"test_ppl": 52.9}, "congruent_gpt": {"test_ppl": 50.3},
            "hgpt": {"test_ppl": 50.5}, "congruent_hgpt": {"test_ppl": 50.4},
        }),
        PaperTable("HGPT paper, Tables 1-5 (layer sweeps)", "Penn Treebank (Mikolov)",
                   "8 heads x 512; rows by total layers (GPT) or split (HGPT)", {
            f"{model} ({variant})": {"test_ppl": ppl} for model, rows in _HGPT_SWEEP.items()
            for variant, ppl in rows.items()
        }),
    ),
}  # fmt: skip

CLAIMS: dict[str, tuple[Claim, ...]] = {
    "U-Net Transformer, Tables 1-2": (
        Claim("unet", "transformer", "test_ppl"),
        Claim("transformer", "s2sa", "test_ppl"),
        Claim("vhred", "hred", "test_ppl"),
    ),
    "U-Net Transformer, Table 6": (
        Claim("transformer_skip_conv", "transformer_skip", "test_ppl"),
        Claim("unet", "transformer_skip_conv", "test_ppl"),
    ),
    "U-Net Transformer, Tables 4-5": (
        Claim("unet", "transformer", "embedding_extrema"),
        Claim("transformer", "unet", "avg_length"),
    ),
    "U-Net Transformer, Table 7": (Claim("unet", "transformer", "length_loss_pearson_r"),),
    "HT-Encoder (HIER), Table 2": (
        Claim("hier", "transformer", "bleu_hier"),
        Claim("hier", "transformer", "success"),
        Claim("hier", "transformer", "combined"),
        Claim("hier", "transformer", "inform_standardized", paper_metric="inform"),
        Claim("hier", "transformer", "success_standardized", paper_metric="success"),
    ),
    "HT-Encoder (HIER), Table 3": (Claim("hier_pp", "set_pp", "combined"),),
    "Highway Recurrent Transformer, Table 1": (
        Claim("hrt_all", "transformer_ranker", "recall_at_10"),
        Claim("hrt_all", "transformer_ranker", "mrr"),
    ),
    "Hierarchical GPT, Tables 1-5": (
        Claim("congruent_gpt", "gpt", "test_ppl"),
        Claim("hgpt", "gpt", "test_ppl"),
        Claim("congruent_hgpt", "hgpt", "test_ppl"),
    ),
}


def lm_protocol_lines(runs: list[RunResult]) -> list[str]:
    """The "Metric conventions" lines that say how each corpus' language-model perplexities
    were measured (``evaluate.lm``, read from the runs' metrics): per document or streamed,
    with each protocol's models where a corpus has several. The papers' numbers come with
    no stated protocol (the HGPT paper's included), so a verdict compares our runs under
    these, never with the paper's."""
    by_corpus: dict[str, dict[str, list[str]]] = {}
    for run in runs:
        if run.task is Task.LM:
            texts = by_corpus.setdefault(run.corpus, {})
            texts.setdefault(protocol_text(run.metrics), []).append(run.label)
    lines = []
    for corpus, texts in by_corpus.items():
        if len(texts) == 1:
            lines.append(f"- Language-model perplexity, {corpus}: {next(iter(texts))}.")
            continue
        parts = [f"{text} ({', '.join(labels)})" for text, labels in texts.items()]
        lines.append(f"- Language-model perplexity, {corpus}: {'; '.join(parts)}.")
    return lines


def _key(title: str) -> str | None:
    return next((k for k in PAPERS if title.startswith(k)), None)


def _value(value: float, metric: Metric) -> str:
    return f"{value:.{metric.digits}f}"


def paper_markdown(table: Table) -> str:
    """The paper's rows for ``table``'s models and metrics, and each of the paper's
    comparisons set against ours; empty when the table has no paper counterpart. A paper
    table is shown only where at least two of its models ran here: one row alone (the
    Transformer of a MultiWOZ run under the U-Net paper's Cornell table) compares nothing."""
    key = _key(table.title)
    if key is None:
        return ""
    models = [row.label for row in table.rows]  # a sweep's rows: ``gpt (l4)``
    lines = []

    def paper_key(metric: Metric) -> str:  # the paper's column of a decoded metric
        return metric.key.removesuffix(table.decoding) if table.decoding else metric.key

    for paper in PAPERS[key]:
        shown = [
            m for m in table.columns if any(paper_key(m) in paper.values.get(x, {}) for x in models)
        ]
        rows = [x for x in models if x in paper.values]
        if not shown or len(rows) < 2:
            continue
        lines += [
            f"In the paper ({paper.source}; {paper.corpus}, {paper.setup}):",
            "",
            "| Model | " + " | ".join(m.label for m in shown) + " |",
            "|---" * (len(shown) + 1) + "|",
        ]
        for model in rows:
            cells = [paper.values[model].get(paper_key(m)) for m in shown]
            text = ["-" if v is None else _value(v, m) for v, m in zip(cells, shown, strict=True)]
            lines.append(f"| {model} | " + " | ".join(text) + " |")
        lines.append("")
    found = verdicts(table)
    if found:
        lines += [f"The paper's comparisons, and ours ({table.corpus}, this run's scale):", ""]
        lines += [f"- {v.line()}" for v in found] + [""]
    return "\n".join(lines)


class Outcome(enum.StrEnum):
    """What a paper's comparison came to here, by the 95% intervals over seeds of the two
    models (:data:`VERDICT_RULES`); the paired test over test examples never changes it."""

    REPRODUCED = "reproduced"
    NOT_REPRODUCED = "not reproduced"
    INCONCLUSIVE = "inconclusive"
    NO_NUMBER = "no number"


VERDICT_RULES = (
    "**reproduced**: our two models differ in the paper's direction and their 95% intervals "
    "over seeds are apart; **not reproduced**: apart in the opposite direction; "
    "**inconclusive**: the intervals overlap, or a model has one seed (no interval over "
    "training randomness). A verdict is about this run's scale and corpus, never the "
    "paper's. The paired bootstrap beside a verdict resamples the test examples of these "
    "trained models only: it says whether the difference holds on this test set and never "
    "changes the verdict."
)
"""The verdict vocabulary, defined once: the report and the results document print it."""


@dataclass(frozen=True)
class Verdict:
    """One of the paper's comparisons set against this run's numbers."""

    table: str
    claim: Claim
    metric: Metric
    paper: str  # "46.87 vs 48.30 (Cornell Movie-Dialogs); ..." or "" (no paper number)
    ours: tuple[Cell, Cell]  # better, worse as the paper has them
    outcome: Outcome
    reason: str  # why this outcome: "95% intervals overlap", "one seed: no interval", ...
    test: str  # the paired test of the table, where it made one

    @property
    def claim_text(self) -> str:
        sign = "<" if self.metric.better.value == "lower" else ">"
        return f"{self.claim.better} {sign} {self.claim.worse} on {self.metric.label}"

    @property
    def ours_text(self) -> str:
        return " vs ".join(
            "-" if c.estimate is None else c.estimate.format(self.metric.digits) for c in self.ours
        )

    def line(self) -> str:
        paper = f"paper {self.paper}" if self.paper else "no paper number"
        return (
            f"{self.claim_text}: {paper}. Ours {self.ours_text}: **{self.outcome.value}** "
            f"({self.reason}){self.test}."
        )


def verdicts(table: Table) -> list[Verdict]:
    """The paper's comparisons that ``table`` has both models and the metric of."""
    key = _key(table.title)
    found = [_verdict(table, claim) for claim in CLAIMS.get(key or "", ())]
    return [v for v in found if v is not None]


def _paper_numbers(table: Table, claim: Claim, metric: Metric) -> str:
    source = claim.paper_metric or claim.metric
    scheme = f" ({source})" if source != claim.metric else ""
    return "; ".join(
        f"{_value(p.values[claim.better][source], metric)} vs "
        f"{_value(p.values[claim.worse][source], metric)} ({p.corpus}){scheme}"
        for p in PAPERS[_key(table.title) or ""]
        if source in p.values.get(claim.better, {}) and source in p.values.get(claim.worse, {})
    )


def _verdict(table: Table, claim: Claim) -> Verdict | None:
    columns = {m.key: i for i, m in enumerate(table.columns)}
    rows = {row.model: row for row in table.rows if row.variant is None}
    key = f"{claim.metric}{table.decoding}"
    if key not in columns or claim.better not in rows or claim.worse not in rows:
        return None
    metric = table.columns[columns[key]]
    better, worse = (rows[m].cells[columns[key]] for m in (claim.better, claim.worse))
    if better.estimate is None or worse.estimate is None:
        return None
    b, w = better.estimate, worse.estimate
    lower = metric.better.value == "lower"
    if math.isnan(b.mean) or math.isnan(w.mean):
        outcome, reason = Outcome.NO_NUMBER, "a run has no value"
    elif math.isnan(b.ci95) or math.isnan(w.ci95):
        direction = "same" if (b.mean < w.mean) == lower and b.mean != w.mean else "other"
        outcome, reason = Outcome.INCONCLUSIVE, f"one seed, no interval; the {direction} way"
    elif abs(b.mean - w.mean) <= b.ci95 + w.ci95:
        outcome, reason = Outcome.INCONCLUSIVE, "the 95% intervals overlap"
    elif (b.mean < w.mean) == lower:
        outcome, reason = Outcome.REPRODUCED, "the paper's direction, intervals apart"
    else:
        outcome, reason = Outcome.NOT_REPRODUCED, "the opposite direction, intervals apart"
    paper = _paper_numbers(table, claim, metric)
    test = _significance(table, claim, better, worse)
    return Verdict(table.title, claim, metric, paper, (better, worse), outcome, reason, test)


def _significance(table: Table, claim: Claim, better: Cell, worse: Cell) -> str:
    """The paired test of the table, where it compared the two (one is the baseline), in
    the claim's terms: which way the test points and how strongly; the words never repeat
    a verdict's (``VERDICT_RULES``): this is a statement about the test set."""
    if table.baseline not in (claim.better, claim.worse):
        return "; no paired test: neither is the table's baseline"
    versus_baseline = better if table.baseline == claim.worse else worse
    c = versus_baseline.comparison
    if c is None:
        return "; no paired test of this metric here"
    # p of "the claimed-better model beats the other" and of the reverse
    p_paper, p_other = (
        (c.p_better, c.p_worse) if versus_baseline is better else (c.p_worse, c.p_better)
    )
    way, p = ("the paper's way", p_paper) if p_paper <= p_other else ("the other way", p_other)
    bootstrap = f"test-set bootstrap {way}, {format_p(p)}"
    if c.within_seed_variation:
        welch = format_p(c.p_seeds)  # type: ignore[arg-type]
        return f"; within the seeds' variation (Welch over seeds {welch}; {bootstrap})"
    if p >= ALPHA:
        return f"; {bootstrap}: no difference on this test set at p < {ALPHA:g}"
    if c.below_floor:
        floor = practical_floor(c.metric)
        return (
            f"; {bootstrap}, but the difference ({abs(c.difference or 0):.3g}) is under "
            f"the practical floor ({floor.text() if floor else '-'})"
        )
    return f"; {bootstrap}: a difference on this test set"


def tables_markdown(tables: list[Table]) -> str:
    """Each table under a heading per corpus, the paper's rows and verdicts under it."""
    parts: list[str] = []
    corpus = None
    for table in tables:
        if table.corpus != corpus:
            corpus = table.corpus
            parts += [f"### Corpus: {corpus}", ""]
        parts += [f"#### {table.title}", "", table_markdown(table), ""]
        if paper := paper_markdown(table):
            parts += [paper]
    return "\n".join(parts)
