"""Paired bootstrap of a run against its baseline, checked against hand-rolled resampling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.artifacts import ExampleResult
from pipeline.eval import text
from pipeline.report.results import RunResult
from pipeline.report.significance import (
    BETTER,
    WORSE,
    NotComparable,
    compare,
    example_stats,
    is_tested,
    seed_scores,
)


def run_of(rows: list[dict], key: str = "m-chitchat") -> RunResult:
    return RunResult(
        key=key,
        model=key.split("-")[0],
        corpus="chitchat",
        task="generate",
        tuned=False,
        metrics={},
        trained=(),
        examples=tuple(ExampleResult(**r) for r in rows),
        n_parameters=0,
        model_config={},
    )


def rows_of(nll: np.ndarray, tokens: np.ndarray) -> list[dict]:
    """``nll``/``tokens`` ``[seeds, examples]``."""
    return [
        {
            "seed": s,
            "id": f"d{i}",
            "nll_sum": float(nll[s, i]),
            "n_tokens": int(tokens[s, i]),
            "history_tokens": 3,
        }
        for s in range(nll.shape[0])
        for i in range(nll.shape[1])
    ]


def test_one_example_decides_every_sample():
    a = run_of(rows_of(np.array([[10.0]]), np.array([[5]])))
    b = run_of(rows_of(np.array([[20.0]]), np.array([[5]])))
    result = compare(a, b, "test_ppl", n_samples=50)
    assert (result.p_better, result.p_worse, result.marker) == (0.0, 1.0, BETTER)
    assert compare(b, a, "test_ppl", n_samples=50).marker == WORSE


def test_identical_systems_are_never_better():
    rng = np.random.default_rng(3)
    rows = rows_of(rng.uniform(5, 30, (2, 12)), rng.integers(3, 9, (2, 12)))
    result = compare(run_of(rows), run_of(rows), "test_ppl", n_samples=100)
    assert (result.p_better, result.p_worse, result.marker) == (1.0, 1.0, "")


def test_perplexity_bootstrap_matches_hand_resampling():
    rng = np.random.default_rng(7)
    seeds, size, n = 2, 9, 300
    tokens = rng.integers(3, 12, (seeds, size))
    nll_a = rng.uniform(1.0, 3.0, (seeds, size)) * tokens
    nll_b = rng.uniform(1.1, 3.1, (seeds, size)) * tokens
    got = compare(run_of(rows_of(nll_a, tokens)), run_of(rows_of(nll_b, tokens)), "test_ppl", n)

    # By hand: resample example indices (same generator as stats.paired_bootstrap), pool
    # every seed of each drawn example, compare exp(total nll / total tokens).
    draw = np.random.default_rng(0)
    not_better = 0
    for _ in range(n):
        idx = draw.integers(0, size, size)
        ppl_a = math.exp(nll_a[:, idx].sum() / tokens[:, idx].sum())
        ppl_b = math.exp(nll_b[:, idx].sum() / tokens[:, idx].sum())
        not_better += ppl_a >= ppl_b
    assert got.p_better == pytest.approx(not_better / n)
    assert 0.0 < got.p_better < 1.0  # the case is not degenerate
    assert got.n_examples == size


def test_recall_and_mrr_from_ranks_match_hand_resampling():
    ranks_a = [[1, 3, 0, 1, 2, 1], [1, 1, 5, 2, 2, 0]]  # 2 seeds x 6 examples
    ranks_b = [[2, 1, 4, 3, 1, 0], [1, 2, 5, 0, 2, 7]]

    def rows(ranks):
        return [
            {
                "seed": s,
                "id": f"d{i}",
                "nll_sum": 0.0,
                "n_tokens": 0,
                "history_tokens": 1,
                "rank": r,
            }
            for s, seed_ranks in enumerate(ranks)
            for i, r in enumerate(seed_ranks)
        ]

    a, b = run_of(rows(ranks_a)), run_of(rows(ranks_b))
    stats = example_stats(a, "recall_at_1", [f"d{i}" for i in range(6)])
    assert stats[:, 0].tolist() == [1.0, 0.5, 0.0, 0.5, 0.0, 0.5]
    mrr = example_stats(a, "mrr", [f"d{i}" for i in range(6)])
    assert mrr[:, 0].tolist() == pytest.approx([1.0, 2 / 3, 0.1, 0.75, 0.5, 0.5])

    n = 200
    got = compare(a, b, "recall_at_1", n)
    hits_a = (np.array(ranks_a) == 1).mean(0)
    hits_b = (np.array(ranks_b) == 1).mean(0)
    draw = np.random.default_rng(0)
    not_better = 0
    for _ in range(n):
        idx = draw.integers(0, 6, 6)
        not_better += hits_a[idx].mean() <= hits_b[idx].mean()
    assert got.p_better == pytest.approx(not_better / n)


def test_bleu_statistics_give_the_corpus_bleu_of_a_resample():
    hyps = ["i like cats a lot", "where are you going", "no", "the weather is nice today"]
    refs = ["i like dogs a lot", "where are you going now", "yes", "the weather is nice"]
    run = run_of(
        [
            {
                "seed": 0,
                "id": f"d{i}",
                "nll_sum": 1.0,
                "n_tokens": 1,
                "history_tokens": 1,
                "hypotheses": {"greedy": h},
                "reference": r,
            }
            for i, (h, r) in enumerate(zip(hyps, refs, strict=True))
        ]
    )
    stats = example_stats(run, "bleu", ["d0", "d1", "d2", "d3"])
    idx = [1, 1, 3, 0]
    assert text.bleu_from_stats(stats[idx]) == pytest.approx(
        text.corpus_bleu([hyps[i] for i in idx], [refs[i] for i in idx])
    )


def test_hier_bleu_statistics_give_the_authors_score_of_a_resample_and_decoding():
    hyps = ["i like cats a lot", "where are you going", "no", "the weather is nice today"]
    beams = ["i like dogs a lot", "where are you", "yes", "the weather is nice"]
    refs = ["i like dogs a lot", "where are you going now", "yes", "the weather is nice"]
    rows = [
        {
            "seed": 0,
            "id": f"d{i}",
            "nll_sum": 1.0,
            "n_tokens": 1,
            "history_tokens": 1,
            "hypotheses": {"greedy": h, "hierbeam5": b},
            "reference": r,
        }
        for i, (h, b, r) in enumerate(zip(hyps, beams, refs, strict=True))
    ]
    run = run_of(rows)
    ids, idx = ["d0", "d1", "d2", "d3"], [2, 0, 0, 3]
    for metric, decoded in (("bleu_hier", hyps), ("bleu_hier_hierbeam5", beams)):
        stats = example_stats(run, metric, ids)
        assert text.wrapped_bleu_from_stats(stats[idx]) == pytest.approx(
            text.wrapped_bleu([decoded[i] for i in idx], [refs[i] for i in idx])
        )
    assert is_tested("bleu_hier_hierbeam5") and is_tested("bleu_topp0.9")
    assert not is_tested("inform") and not is_tested("embedding_extrema")
    # a run that decodes the references beats every resample of one that does not
    perfect = [{**r, "hypotheses": {"greedy": r["reference"]}} for r in rows]
    result = compare(run_of(perfect, "b-chitchat"), run, "bleu_hier", n_samples=50)
    assert result.p_better == 0.0 and result.p_worse == 1.0


def test_runs_on_different_test_sets_are_not_compared():
    a = run_of(rows_of(np.ones((1, 3)), np.ones((1, 3), int)))
    b = run_of(rows_of(np.ones((1, 4)), np.ones((1, 4), int)))
    with pytest.raises(NotComparable, match="1 ids in only one"):
        compare(a, b, "test_ppl", 10)


def test_bleu_without_hypotheses_is_not_comparable():
    a = run_of(rows_of(np.ones((1, 3)), np.ones((1, 3), int)))
    with pytest.raises(NotComparable, match="greedy hypotheses"):
        compare(a, a, "bleu", 10)


def test_a_difference_within_seed_variation_gets_no_marker():
    # Pooled over its two seeds the run beats the baseline on every example (mean NLL
    # 9.75 < 10), so the bootstrap alone calls it better; but one seed is far better and
    # the other far worse: the difference is within seed-to-seed variation.
    tokens = np.full((2, 30), 5)
    run = run_of(rows_of(np.array([[5.0] * 30, [14.5] * 30]), tokens))
    base = run_of(rows_of(np.array([[10.0] * 30, [10.1] * 30]), tokens), "b-chitchat")
    result = compare(run, base, "test_ppl", n_samples=100)
    assert result.p_better == 0.0  # what the bootstrap says
    assert result.p_seeds is not None and result.p_seeds > 0.05
    assert result.marker == ""


def test_seed_scores_and_consistent_seeds_keep_the_marker():
    tokens = np.full((3, 20), 4)
    run = run_of(rows_of(np.array([[8.0] * 20, [8.4] * 20, [8.2] * 20]), tokens))
    base = run_of(rows_of(np.array([[12.0] * 20, [12.4] * 20, [12.2] * 20]), tokens), "b-x")
    ids = [f"d{i}" for i in range(20)]
    assert seed_scores(run, "test_ppl", ids) == pytest.approx(
        [-math.exp(8.0 / 4), -math.exp(8.4 / 4), -math.exp(8.2 / 4)]
    )
    result = compare(run, base, "test_ppl", n_samples=100)
    assert result.p_seeds is not None and result.p_seeds < 0.01
    assert result.marker == BETTER


def test_one_seed_has_no_seed_test():
    one = run_of(rows_of(np.array([[5.0, 6.0]]), np.array([[2, 2]])))
    assert compare(one, one, "test_ppl", n_samples=10).p_seeds is None


@pytest.mark.parametrize(
    ("p", "printed"),
    [(0.0004, "p < 0.001"), (0.0, "p < 0.001"), (0.0123, "p = 0.012"), (0.001, "p = 0.001"),
     (0.45, "p = 0.450"), (1.0, "p = 1.000")],
)  # fmt: skip
def test_every_p_value_prints_one_way(p, printed):
    from pipeline.report.significance import format_p

    assert format_p(p) == printed


def _nll_rows(nll: float, n: int = 40) -> list[dict]:
    return rows_of(np.full((1, n), nll), np.full((1, n), 10))


@pytest.mark.parametrize(
    ("metric", "ours", "theirs", "marked"),
    [
        ("bleu", 0.11, 0.0, False),  # significant, but a tenth of a BLEU point
        ("bleu", 2.0, 0.5, True),
        ("bleu_hier_hierbeam5", 0.5, 0.0, False),  # every BLEU scorer and decoding
        ("test_ppl", 167.5, 167.6, False),  # 0.06% of the baseline
        ("test_ppl", 2.01, 2.46, True),  # 18%: a small perplexity, a large difference
        ("recall_at_10", 0.105, 0.1, False),
        ("mrr", 0.2, 0.1, True),
    ],
)
def test_no_marker_under_the_practical_floor(metric, ours, theirs, marked):
    from pipeline.report.significance import Comparison

    # both bootstrap directions decisive: only the floor can withhold the marker
    c = Comparison(metric, 0.0, 1.0, 40, 100, difference=ours - theirs, baseline_mean=theirs)
    assert c.below_floor is not marked
    assert c.marker == (BETTER if marked else "")


def test_compare_measures_the_difference_against_the_floor():
    """``compare`` takes the two means from metrics.json: a perplexity difference of 0.2%
    gets no marker, however certain the bootstrap is."""
    import dataclasses

    a = dataclasses.replace(run_of(_nll_rows(50.0)), metrics={"test_ppl": 149.7})
    b = dataclasses.replace(run_of(_nll_rows(50.1), "b-chitchat"), metrics={"test_ppl": 150.0})
    result = compare(a, b, "test_ppl", n_samples=50)
    assert result.p_better == 0.0 and result.difference == pytest.approx(-0.3)
    assert result.below_floor and result.marker == ""
    far = dataclasses.replace(a, metrics={"test_ppl": 140.0})
    assert compare(far, b, "test_ppl", n_samples=50).marker == BETTER
