"""Statistics for the report: mean +- CI over seeds, paired bootstrap, Pearson correlation.

- ``mean_ci``: mean of per-seed results with a Student-t confidence interval,
  ``mean +- t_{(1+c)/2, n-1} * s / sqrt(n)`` (``s`` the sample standard deviation, ddof=1).
  A single value has no spread estimate: its half-width is NaN (printed as such), never 0,
  so a one-seed result cannot pass for a certain one.
- ``paired_bootstrap``: Koehn (2004), "Statistical significance tests for machine
  translation evaluation". Draw ``n`` test sets of the same size with replacement (the SAME
  indices for both systems and the references), score both systems on each, and count how
  often A does not beat B. ``p_value = (#samples with metric(A) <= metric(B)) / n`` is the
  one-sided p-value of "A is better than B" (ties count against A, so identical systems give
  p = 1). Works for corpus metrics (BLEU of the resampled corpus: pass
  ``text.bleu_stats`` rows and ``text.bleu_from_stats``, or plain ``text.corpus_bleu``) and
  per-example ones (pass score arrays and a mean). Deterministic for a given ``seed``.
- ``bootstrap_interval``: the percentile bootstrap interval of a mean of per-example values
  (Efron & Tibshirani 1993, ch. 13): the ``(1 - c)/2`` and ``(1 + c)/2`` quantiles of the
  means of ``n`` resampled test sets (numpy's default linear quantile). Deterministic for a
  given ``seed``.
- ``pearson``: Pearson r with its two-sided p-value (``scipy.stats.pearsonr``), e.g. history
  length vs per-example loss (U-Net paper, Table 7).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

H = TypeVar("H")
R = TypeVar("R")


def _finite_1d(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a flat sequence of numbers, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name}: contains NaN or infinite values")
    return array


@dataclass(frozen=True)
class MeanCI:
    """A mean with the half-width of its confidence interval (NaN for a single value)."""

    mean: float
    half_width: float
    n: int
    confidence: float

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def format(self, digits: int = 2) -> str:
        """``"12.34 ± 0.56"`` (``"12.34 ± nan"`` for one value)."""
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"

    def __str__(self) -> str:
        return self.format()


def mean_ci(values: Sequence[float] | np.ndarray, confidence: float = 0.95) -> MeanCI:
    """Mean of ``values`` (e.g. one metric over seeds) with a Student-t confidence interval.

    Half-width = ``t.ppf((1 + confidence) / 2, n - 1) * std(values, ddof=1) / sqrt(n)``;
    NaN when ``n == 1`` (no variance estimate).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    array = _finite_1d(values, "values")
    n = int(array.size)
    if n == 0:
        raise ValueError("values: need at least one value")
    mean = float(array.mean())
    if n == 1:
        return MeanCI(mean, math.nan, 1, confidence)
    sem = float(array.std(ddof=1)) / math.sqrt(n)
    from scipy import stats as sps  # here: the training loop imports this module

    half = float(sps.t.ppf((1.0 + confidence) / 2.0, n - 1)) * sem
    return MeanCI(mean, half, n, confidence)


@dataclass(frozen=True)
class BootstrapResult:
    """Outcome of a paired bootstrap test of "system A is better than system B".

    ``score_a``/``score_b``: the metric on the full test set; ``p_value``: share of the
    ``n_samples`` resampled test sets on which A did not beat B.
    """

    score_a: float
    score_b: float
    p_value: float
    n_samples: int

    @property
    def delta(self) -> float:
        return self.score_a - self.score_b

    def significant(self, alpha: float = 0.05) -> bool:
        return self.p_value < alpha


def _take(items: Any, index: np.ndarray) -> Any:
    # numpy arrays (per-example scores, BLEU statistics) are fancy-indexed; anything else
    # (lists of strings) is gathered element by element.
    if isinstance(items, np.ndarray):
        return items[index]
    return [items[i] for i in index]


def paired_bootstrap(
    metric_fn: Callable[[Sequence[H], Sequence[R] | None], float],
    sys_a: Sequence[H] | np.ndarray,
    sys_b: Sequence[H] | np.ndarray,
    refs: Sequence[R] | np.ndarray | None = None,
    n: int = 1000,
    seed: int = 0,
) -> BootstrapResult:
    """Koehn's paired bootstrap; higher ``metric_fn`` = better.

    ``metric_fn(outputs, refs)`` scores one system's outputs (a resampled list, or array
    rows) against the matching references (``None`` if ``refs`` is None, for inputs that
    already carry everything: per-example scores, BLEU statistics). Examples:
    ``paired_bootstrap(corpus_bleu, hyps_a, hyps_b, refs)``;
    ``paired_bootstrap(lambda s, _: float(s.mean()), scores_a, scores_b)``.
    """
    size = len(sys_a)
    if len(sys_b) != size or (refs is not None and len(refs) != size):
        lengths = f"A {size}, B {len(sys_b)}" + (f", refs {len(refs)}" if refs is not None else "")
        raise ValueError(f"paired_bootstrap: systems and references differ in length ({lengths})")
    if size == 0:
        raise ValueError("paired_bootstrap: empty test set")
    if n < 1:
        raise ValueError(f"n: need at least one bootstrap sample, got {n}")
    rng = np.random.default_rng(seed)
    not_better = 0
    for _ in range(n):
        index = rng.integers(0, size, size)
        sample_refs = None if refs is None else _take(refs, index)
        a = metric_fn(_take(sys_a, index), sample_refs)
        b = metric_fn(_take(sys_b, index), sample_refs)
        not_better += int(a <= b)
    return BootstrapResult(
        score_a=float(metric_fn(sys_a, refs)),
        score_b=float(metric_fn(sys_b, refs)),
        p_value=not_better / n,
        n_samples=n,
    )


def bootstrap_interval(
    values: Sequence[float] | np.ndarray, confidence: float = 0.95, n: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of ``values`` (one per test example):
    ``confidence`` of the means of ``n`` same-size resamples lie inside it."""
    x = _finite_1d(values, "values")
    if x.size == 0:
        raise ValueError("bootstrap_interval: no values")
    if n < 1:
        raise ValueError(f"n: need at least one bootstrap sample, got {n}")
    means = x[np.random.default_rng(seed).integers(0, x.size, (n, x.size))].mean(1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Correlation:
    """Pearson ``r`` with its two-sided ``p_value`` over ``n`` pairs (NaN if undefined)."""

    r: float
    p_value: float
    n: int


def pearson(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> Correlation:
    """Pearson correlation of ``x`` and ``y`` (e.g. history length vs per-example loss).

    ``r = cov(x, y) / (std(x) std(y))``; the p-value tests r = 0 (t-test, n - 2 degrees of
    freedom, via ``scipy.stats.pearsonr``). If either side is constant r is undefined and
    both values are NaN.
    """
    xs, ys = _finite_1d(x, "x"), _finite_1d(y, "y")
    if xs.size != ys.size:
        raise ValueError(f"pearson: x has {xs.size} values, y has {ys.size}")
    if xs.size < 2:
        raise ValueError(f"pearson: need at least 2 pairs, got {xs.size}")
    if np.ptp(xs) == 0 or np.ptp(ys) == 0:
        return Correlation(math.nan, math.nan, int(xs.size))
    with warnings.catch_warnings():
        # n == 2 gives r = +-1 exactly; scipy warns about it, the result is still right.
        warnings.simplefilter("ignore", RuntimeWarning)
        from scipy import stats as sps

        result = sps.pearsonr(xs, ys)
    return Correlation(float(result.statistic), float(result.pvalue), int(xs.size))
