"""Paired bootstrap of one run against its baseline, from ``per_example.jsonl``.

Both runs must have been evaluated on the same test examples (matched by ``id``). With
several seeds, each example carries every seed's result: a bootstrap sample draws test
examples, and each drawn example brings all its seeds (seed variation stays inside the
statistic, the resampling unit is the test example, as in Koehn 2004). Per metric:

- ``test_ppl``: per example the summed ``nll_sum`` and ``n_tokens`` over seeds; a sample's
  perplexity is ``exp(sum nll / sum tokens)`` (lower is better);
- ``bleu`` / ``bleu_beam5`` (any decoding): per example the sacrebleu sufficient
  statistics (``text.bleu_stats``) summed over seeds; a sample's score is the corpus BLEU
  of its rows; ``bleu_hier`` (any decoding) the same with the HT-Encoder paper's scorer
  (``text.wrapped_bleu_stats``);
- ``recall_at_k`` / ``mrr``: per example the mean over seeds of ``1[rank <= k]`` /
  ``1/rank`` (rank 0 = no correct candidate: a miss).

``compare`` runs ``stats.paired_bootstrap`` in both directions with the same seed (the same
resampled test sets): ``p_better`` is the p-value of "the run beats the baseline",
``p_worse`` of "the baseline beats the run".

What the bootstrap cannot see is training randomness: it resamples the test set of fixed
trained models. With one seed per run a marker therefore says only "on this test set,
these two trained models differ" (the report's caption says so). With at least two seeds
on both sides, ``compare`` also scores every seed on its own and runs Welch's t-test on the
per-seed scores (``p_seeds``); a difference within seed-to-seed variation (``p_seeds >=
0.05``) gets no marker, however small the bootstrap's p-value.

A p-value says whether a difference is there, not whether it matters: on 300 test examples
a BLEU of 0.11 against 0.00 can be "significant". A marker therefore also needs the
difference of the two means to reach the metric's practical floor (:data:`PRACTICAL_FLOORS`,
printed in the report's caption). Every p-value the report prints goes through
:func:`format_p`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

from pipeline.artifacts import ExampleResult
from pipeline.eval import text
from pipeline.eval.generation import decode_label
from pipeline.eval.perplexity import perplexity_of
from pipeline.eval.stats import paired_bootstrap
from pipeline.report.results import RunResult

ALPHA = 0.05
BLEU_HIER_PREFIX = "bleu_hier"  # the HT-Encoder paper's scorer, any decoding
BETTER, WORSE = "▲", "▼"
P_FLOOR = 0.001  # smaller p-values print as "p < 0.001": the bootstrap resolves no finer


@dataclass(frozen=True)
class Floor:
    """A practical floor: ``value`` in the metric's units, or, ``relative``, as a fraction
    of the baseline's value (perplexity spans 2 to 400 across corpora: one point is a lot
    at 2 and nothing at 400)."""

    name: str
    value: float
    relative: bool = False

    def threshold(self, baseline: float) -> float:
        return self.value * abs(baseline) if self.relative else self.value

    def text(self) -> str:
        return (
            f"{self.name} {self.value:.0%} of the baseline"
            if self.relative
            else (f"{self.name} {self.value:g}")
        )


PRACTICAL_FLOORS: dict[str, Floor] = {
    "test_ppl": Floor("perplexity", 0.01, relative=True),
    "bleu": Floor("BLEU", 1.0),  # points (0-100); every scorer and decoding (bleu_hier_beam5)
    "recall_at_": Floor("R@k", 0.01),  # a fraction: one percentage point
    "mrr": Floor("MRR", 0.01),
}
"""The smallest difference of two means (run minus baseline) that gets a ▲/▼ marker, by
metric key prefix (the longest matching prefix wins). A difference below it is left
unmarked whatever its p-value: too small to matter (BLEU 0.11 vs 0.00, perplexity 167.6
vs 167.5)."""


def practical_floor(metric: str) -> Floor | None:
    """The practical floor of ``metric`` (:data:`PRACTICAL_FLOORS`); None: no floor."""
    matches = [p for p in PRACTICAL_FLOORS if metric == p or metric.startswith(p)]
    return PRACTICAL_FLOORS[max(matches, key=len)] if matches else None


def floors_text() -> str:
    """The floors as the report's caption states them."""
    return ", ".join(f.text() for f in PRACTICAL_FLOORS.values())


def format_p(p: float) -> str:
    """A p-value as the report prints it everywhere: ``p < 0.001`` below :data:`P_FLOOR`,
    else ``p = 0.012`` (three decimals)."""
    if p != p:  # NaN: no test
        return "p = n/a"
    return f"p < {P_FLOOR:g}" if p < P_FLOOR else f"p = {p:.3f}"


class NotComparable(ValueError):
    """The two runs cannot be compared on this metric (say why in the report)."""


@dataclass(frozen=True)
class Comparison:
    """A run against its baseline on one metric."""

    metric: str
    p_better: float
    p_worse: float
    n_examples: int
    n_samples: int
    p_seeds: float | None = None  # Welch's t over per-seed scores; None: < 2 seeds a side
    difference: float | None = None  # mean of the run minus the baseline's (metric units)
    baseline_mean: float | None = None  # the baseline's mean (a relative floor's scale)

    @property
    def within_seed_variation(self) -> bool:
        return self.p_seeds is not None and not self.p_seeds < ALPHA

    @property
    def below_floor(self) -> bool:
        """The difference of the means is under the metric's practical floor."""
        floor = practical_floor(self.metric)
        if floor is None or self.difference is None or self.baseline_mean is None:
            return False
        return abs(self.difference) < floor.threshold(self.baseline_mean)

    @property
    def marker(self) -> str:
        if self.within_seed_variation or self.below_floor:
            return ""
        if self.p_better < ALPHA:
            return BETTER
        if self.p_worse < ALPHA:
            return WORSE
        return ""


def _by_id(rows: tuple[ExampleResult, ...]) -> dict[str, list[ExampleResult]]:
    grouped: dict[str, list[ExampleResult]] = {}
    for row in rows:
        grouped.setdefault(row.id, []).append(row)
    return grouped


Statistic = Callable[[list[ExampleResult]], np.ndarray]  # one example's seeds -> a stats row
Score = Callable[[np.ndarray, object], float]  # stats rows of a sample -> higher is better


def _ppl_rows(rows: list[ExampleResult]) -> np.ndarray:
    return np.array([sum(r.nll_sum for r in rows), sum(r.n_tokens for r in rows)], float)


def _neg_ppl(stats: np.ndarray, _refs: object = None) -> float:
    return -perplexity_of(stats[:, 0].sum() / stats[:, 1].sum())


def _mean(stats: np.ndarray, _refs: object = None) -> float:
    return float(stats[:, 0].mean())


def _recall_rows(k: int) -> Statistic:
    def rows_fn(rows: list[ExampleResult]) -> np.ndarray:
        hits = [r.rank is not None and 1 <= r.rank <= k for r in rows]
        return np.array([float(np.mean(hits))])

    return rows_fn


def _mrr_rows(rows: list[ExampleResult]) -> np.ndarray:
    return np.array([float(np.mean([1.0 / r.rank if r.rank else 0.0 for r in rows]))])


def _hypothesis_rows(
    decoding: str, stats: Callable[[list[str], list[str]], np.ndarray]
) -> Statistic:
    """An example's BLEU sufficient statistics of its ``decoding`` (``stats`` of its seeds'
    hypotheses against the reference), summed over seeds."""

    def rows_fn(rows: list[ExampleResult]) -> np.ndarray:
        hyps = [r.hypotheses.get(decoding) for r in rows]
        refs = [r.reference for r in rows]
        if any(h is None for h in hyps) or any(r is None for r in refs):
            raise NotComparable(f"per_example.jsonl lacks {decoding} hypotheses/references")
        return stats(hyps, refs).sum(0)  # type: ignore[arg-type]

    return rows_fn


def _statistic(metric: str, bleu_tokenize: str) -> tuple[Statistic, Score]:
    if metric == "test_ppl":
        return _ppl_rows, _neg_ppl
    hier = BLEU_HIER_PREFIX
    if metric == hier or metric.startswith(f"{hier}_"):  # ``bleu_hier``, ``bleu_hier_<decoding>``
        decoding = decode_label(metric.removeprefix(hier))
        return _hypothesis_rows(decoding, text.wrapped_bleu_stats), text.wrapped_bleu_from_stats
    if metric == "bleu" or metric.startswith("bleu_"):  # ``bleu``, ``bleu_beam5``, ...
        decoding = decode_label(metric.removeprefix("bleu"))

        def sacrebleu_stats(hyps: list[str], refs: list[str]) -> np.ndarray:
            return text.bleu_stats(hyps, refs, bleu_tokenize)

        return _hypothesis_rows(decoding, sacrebleu_stats), text.bleu_from_stats
    if metric.startswith("recall_at_"):
        return _recall_rows(int(metric.removeprefix("recall_at_"))), _mean
    if metric == "mrr":
        return _mrr_rows, _mean
    raise NotComparable(f"no bootstrap defined for {metric}")


def is_tested(metric: str) -> bool:
    """Whether the paired bootstrap is defined for ``metric``: perplexity, every decoding's
    BLEU (sacrebleu's and the HT-Encoder scorer's), Recall@k and MRR. Not (yet): the
    ChatEval embedding and length metrics, Inform/Success (per dialogue, not per turn)."""
    try:
        _statistic(metric, text.DEFAULT_TOKENIZE)
    except NotComparable:
        return False
    return True


def example_stats(
    run: RunResult, metric: str, ids: list[str], bleu_tokenize: str = text.DEFAULT_TOKENIZE
) -> np.ndarray:
    """``[len(ids), k]`` per-example statistics of ``run`` for ``metric`` (seeds pooled)."""
    rows_fn, _ = _statistic(metric, bleu_tokenize)
    grouped = _by_id(run.examples)
    return np.stack([rows_fn(grouped[i]) for i in ids])


def compare(
    run: RunResult,
    baseline: RunResult,
    metric: str,
    n_samples: int = 1000,
    seed: int = 0,
    bleu_tokenize: str = text.DEFAULT_TOKENIZE,
) -> Comparison:
    """Paired bootstrap of ``run`` against ``baseline`` on ``metric``; raises
    ``NotComparable`` if their test examples differ or the metric has no test."""
    _, score = _statistic(metric, bleu_tokenize)
    ids_a, ids_b = set(_by_id(run.examples)), set(_by_id(baseline.examples))
    if ids_a != ids_b:
        raise NotComparable(
            f"test examples differ ({len(ids_a ^ ids_b)} ids in only one of the two)"
        )
    ids = sorted(ids_a)
    a = example_stats(run, metric, ids, bleu_tokenize)
    b = example_stats(baseline, metric, ids, bleu_tokenize)
    better = paired_bootstrap(score, a, b, n=n_samples, seed=seed)
    worse = paired_bootstrap(score, b, a, n=n_samples, seed=seed)
    p_seeds = seed_test(run, baseline, metric, ids, bleu_tokenize)
    ours, theirs = run.estimate(metric), baseline.estimate(metric)
    difference = None if ours is None or theirs is None else ours.mean - theirs.mean
    return Comparison(
        metric,
        better.p_value,
        worse.p_value,
        len(ids),
        n_samples,
        p_seeds,
        difference,
        None if theirs is None else theirs.mean,
    )


def seed_scores(
    run: RunResult, metric: str, ids: list[str], bleu_tokenize: str = text.DEFAULT_TOKENIZE
) -> list[float]:
    """``metric`` of each seed of ``run`` on its own over ``ids`` (higher is better)."""
    rows_fn, score = _statistic(metric, bleu_tokenize)
    scores = []
    for seed in run.seeds:
        grouped = _by_id(tuple(r for r in run.examples if r.seed == seed))
        scores.append(score(np.stack([rows_fn(grouped[i]) for i in ids]), None))
    return scores


def seed_test(
    run: RunResult,
    baseline: RunResult,
    metric: str,
    ids: list[str],
    bleu_tokenize: str = text.DEFAULT_TOKENIZE,
) -> float | None:
    """Two-sided p-value of Welch's t-test between the per-seed scores of the two runs;
    None unless both have at least two seeds."""
    if len(run.seeds) < 2 or len(baseline.seeds) < 2:
        return None
    a = seed_scores(run, metric, ids, bleu_tokenize)
    b = seed_scores(baseline, metric, ids, bleu_tokenize)
    if np.ptp(a) == 0 and np.ptp(b) == 0:  # no seed variation at all: the t-test is undefined
        return 0.0 if a[0] != b[0] else 1.0
    return float(scipy_stats.ttest_ind(a, b, equal_var=False).pvalue)
