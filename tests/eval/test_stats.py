"""Mean +- CI, paired bootstrap and Pearson r against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from pipeline.eval.stats import bootstrap_interval, mean_ci, paired_bootstrap, pearson


def mean_of(scores: np.ndarray, _refs: object = None) -> float:
    return float(np.mean(scores))


def test_mean_ci_hand_values():
    ci = mean_ci([1.0, 2.0, 3.0, 4.0])
    # mean 2.5; s = sqrt(((1.5^2 + 0.5^2) * 2) / 3) = sqrt(5/3); sem = s / 2
    # t_{0.975, 3} = 3.182446305 (t table) -> half-width 3.182446305 * 0.645497224 = 2.054260
    assert ci.mean == 2.5
    assert ci.n == 4
    assert ci.half_width == pytest.approx(3.182446305 * math.sqrt(5 / 3) / 2, rel=1e-8)
    assert ci.half_width == pytest.approx(2.054260, abs=1e-6)
    assert (ci.low, ci.high) == pytest.approx((2.5 - 2.054260, 2.5 + 2.054260), abs=1e-6)
    assert str(ci) == "2.50 ± 2.05"


def test_mean_ci_other_confidence_uses_t_quantile():
    values = [10.0, 12.0, 11.0]
    ci = mean_ci(values, confidence=0.9)
    sem = np.std(values, ddof=1) / math.sqrt(3)
    assert ci.half_width == pytest.approx(sps.t.ppf(0.95, 2) * sem)


def test_mean_ci_single_value_has_no_interval():
    ci = mean_ci([3.0])
    assert ci.mean == 3.0 and math.isnan(ci.half_width)
    assert ci.format(1) == "3.0 ± nan"


@pytest.mark.parametrize(
    ("values", "confidence", "match"),
    [([], 0.95, "at least one"), ([1.0, float("nan")], 0.95, "NaN"), ([1.0], 1.0, "confidence")],
)
def test_mean_ci_rejects_bad_input(values, confidence, match):
    with pytest.raises(ValueError, match=match):
        mean_ci(values, confidence)


def test_bootstrap_identical_systems_is_not_significant():
    scores = np.random.default_rng(0).random(50)
    result = paired_bootstrap(mean_of, scores, scores.copy(), n=200, seed=1)
    # every resample is a tie, and ties count against A: p = 1
    assert result.p_value == 1.0
    assert result.delta == 0.0
    assert not result.significant()


def test_bootstrap_clearly_better_system_is_significant():
    rng = np.random.default_rng(0)
    b = rng.random(100)
    a = b + 0.2 + 0.05 * rng.standard_normal(100)
    result = paired_bootstrap(mean_of, a, b, n=500, seed=0)
    assert result.p_value < 0.05 and result.significant()
    assert result.delta == pytest.approx(float(np.mean(a - b)))
    # the other way round A never wins
    assert paired_bootstrap(mean_of, b, a, n=500, seed=0).p_value == 1.0


def test_bootstrap_p_value_matches_hand_probability():
    # two examples: A = [1, 0], B = [0, 1]. A resample of two draws has A > B only when it
    # draws example 0 twice (prob 1/4); otherwise A ties or loses -> p = 3/4.
    a, b = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    result = paired_bootstrap(mean_of, a, b, n=4000, seed=3)
    assert result.p_value == pytest.approx(0.75, abs=0.03)


def test_bootstrap_resamples_lists_with_their_references():
    # a per-example accuracy over strings: A copies the reference, B never does
    refs = [f"r{i}" for i in range(20)]
    a = list(refs)
    b = [r + "x" for r in refs]

    def accuracy(hyps, refs_):
        return sum(h == r for h, r in zip(hyps, refs_, strict=True)) / len(hyps)

    result = paired_bootstrap(accuracy, a, b, refs, n=100, seed=0)
    assert (result.score_a, result.score_b, result.p_value) == (1.0, 0.0, 0.0)


def test_bootstrap_is_deterministic_by_seed():
    rng = np.random.default_rng(5)
    a, b = rng.random(30), rng.random(30)
    first = paired_bootstrap(mean_of, a, b, n=300, seed=7)
    assert paired_bootstrap(mean_of, a, b, n=300, seed=7) == first
    others = {paired_bootstrap(mean_of, a, b, n=300, seed=s).p_value for s in range(5)}
    assert len(others) > 1  # the seed is actually used


def test_bootstrap_rejects_mismatched_input():
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap(mean_of, np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap(mean_of, [1.0], [1.0], refs=["a", "b"])
    with pytest.raises(ValueError, match="empty"):
        paired_bootstrap(mean_of, [], [])
    with pytest.raises(ValueError, match="at least one"):
        paired_bootstrap(mean_of, [1.0], [1.0], n=0)


def test_pearson_hand_values():
    x, y = [1, 2, 3, 4], [2, 4, 5, 9]
    # dx = (-1.5, -0.5, 0.5, 1.5), dy = (-3, -1, 0, 4): sum dx*dy = 11, sum dx^2 = 5,
    # sum dy^2 = 26 -> r = 11 / sqrt(130)
    r = 11 / math.sqrt(130)
    # t = r sqrt(n - 2) / sqrt(1 - r^2), two-sided with n - 2 = 2 degrees of freedom
    t = r * math.sqrt(2) / math.sqrt(1 - r * r)
    result = pearson(x, y)
    assert result.r == pytest.approx(r)
    assert result.r == pytest.approx(0.9647638, abs=1e-7)
    assert result.p_value == pytest.approx(2 * sps.t.sf(t, 2))
    assert result.n == 4
    assert pearson(x, [-v for v in y]).r == pytest.approx(-r)


def test_pearson_undefined_and_bad_input():
    constant = pearson([1, 2, 3], [5, 5, 5])
    assert math.isnan(constant.r) and math.isnan(constant.p_value)
    with pytest.raises(ValueError, match="3 values, y has 2"):
        pearson([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least 2"):
        pearson([1], [1])
    with pytest.raises(ValueError, match="NaN"):
        pearson([1, float("nan")], [1, 2])


def test_bootstrap_interval_by_hand_and_against_scipy():
    # Two examples, 0 and 1: a resample's mean is 0, 0.5 or 1 with probability 1/4, 1/2,
    # 1/4, so the 2.5% and 97.5% quantiles are 0 and 1; a constant has no spread.
    assert bootstrap_interval([0.0, 1.0], n=4000) == (0.0, 1.0)
    assert bootstrap_interval([0.3] * 7) == pytest.approx((0.3, 0.3))
    rng = np.random.default_rng(5)
    values = (rng.random(300) < 0.17).astype(float)
    low, high = bootstrap_interval(values, n=4000, seed=2)
    reference = sps.bootstrap(
        (values,), np.mean, n_resamples=4000, method="percentile", random_state=3
    ).confidence_interval
    assert low == pytest.approx(reference.low, abs=0.006)
    assert high == pytest.approx(reference.high, abs=0.006)
    assert bootstrap_interval(values, n=500, seed=1) == bootstrap_interval(values, n=500, seed=1)
    with pytest.raises(ValueError, match="no values"):
        bootstrap_interval([])
