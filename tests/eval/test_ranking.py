"""Recall@k / MRR against hand-computed rankings and the official DSTC7 scorer's logic."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.eval.ranking import first_correct_ranks, mrr_from_ranks, recall_from_ranks

# Five examples of four candidates, ranks worked out by hand (pessimistic ties):
SCORES = torch.tensor(
    [
        [0.1, 0.9, 0.5, 0.3],  # correct 0.5: only 0.9 is above -> rank 2
        [0.8, 0.2, 0.2, 0.1],  # correct {0.2, 0.1}: best 0.2; 0.8 and the tied 0.2 ahead -> 3
        [0.4, 0.4, 0.4, 0.4],  # all tied: the three incorrect go first -> 4
        [0.3, 0.2, 0.1, 0.0],  # no correct candidate -> 0 (a miss)
        [5.0, 1.0, 2.0, 3.0],  # correct is the best -> 1
    ]
)
LABELS = torch.tensor(
    [
        [0, 0, 1, 0],
        [0, 1, 0, 1],
        [1, 0, 0, 0],
        [0, 0, 0, 0],
        [1, 0, 0, 0],
    ],
    dtype=torch.float,
)


def recall_at_k(scores, labels, k: int) -> float:
    """Recall@k as the evaluate stage computes it: ranks per batch, then the recall."""
    return recall_from_ranks(first_correct_ranks(scores, labels), k)


def mrr(scores, labels) -> float:
    return mrr_from_ranks(first_correct_ranks(scores, labels))


def test_ranks_by_hand():
    assert first_correct_ranks(SCORES, LABELS).tolist() == [2, 3, 4, 0, 1]


def test_recall_by_hand():
    assert recall_at_k(SCORES, LABELS, 1) == pytest.approx(1 / 5)
    assert recall_at_k(SCORES, LABELS, 2) == pytest.approx(2 / 5)
    assert recall_at_k(SCORES, LABELS, 3) == pytest.approx(3 / 5)
    # k beyond N: every example with a correct candidate counts, the answerless one never.
    assert recall_at_k(SCORES, LABELS, 10) == pytest.approx(4 / 5)


def test_mrr_by_hand():
    assert mrr(SCORES, LABELS) == pytest.approx((1 / 2 + 1 / 3 + 1 / 4 + 0 + 1) / 5)


def test_from_ranks_for_bootstrap():
    ranks = torch.tensor([1, 1, 0, 10, 11])
    assert recall_from_ranks(ranks, 10) == pytest.approx(3 / 5)
    assert mrr_from_ranks(ranks) == pytest.approx((1 + 1 + 0 + 0.1 + 1 / 11) / 5)


def test_constant_scorer_is_not_lucky():
    scores = torch.zeros(3, 100)
    labels = torch.zeros(3, 100)
    labels[:, 0] = 1
    assert recall_at_k(scores, labels, 1) == 0.0
    assert recall_at_k(scores, labels, 100) == 1.0
    assert mrr(scores, labels) == pytest.approx(1 / 100)


def _official_rank(scores: list[float], labels: list[int]) -> int:
    """The DSTC7 scorer's ``rank``: first correct in a ranked list (incorrect first on
    ties, our documented tie-break), 1-based, 0 if absent."""
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], labels[j]))
    for position, j in enumerate(order):
        if labels[j]:
            return position + 1
    return 0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda n: st.lists(
            st.tuples(
                st.lists(st.integers(-2, 2), min_size=n, max_size=n),
                st.lists(st.integers(0, 1), min_size=n, max_size=n),
            ),
            min_size=1,
            max_size=4,
        )
    )
)
def test_matches_official_scorer(rows):
    scores = torch.tensor([r[0] for r in rows], dtype=torch.float)
    labels = torch.tensor([r[1] for r in rows], dtype=torch.float)
    expected = [_official_rank(s, lab) for s, lab in rows]
    assert first_correct_ranks(scores, labels).tolist() == expected
    official_mrr = sum(1 / r for r in expected if r) / len(expected)
    assert mrr(scores, labels) == pytest.approx(official_mrr)
    for k in (1, 2, 3):
        assert recall_at_k(scores, labels, k) == pytest.approx(
            sum(1 for r in expected if 1 <= r <= k) / len(expected)
        )


@pytest.mark.parametrize(
    ("scores", "labels", "message"),
    [
        (torch.zeros(4), torch.zeros(4), "scores: expected"),
        (torch.zeros(2, 3), torch.zeros(2, 4), "labels: shape"),
        (torch.tensor([[math.nan, 1.0]]), torch.tensor([[1.0, 0.0]]), "NaN"),
        (torch.zeros(1, 2), torch.tensor([[0.5, 0.0]]), "labels: must be 0/1"),
    ],
)
def test_bad_input(scores, labels, message):
    with pytest.raises(ValueError, match=message):
        first_correct_ranks(scores, labels)


def test_bad_k_and_empty():
    with pytest.raises(ValueError, match="k: must be >= 1"):
        recall_at_k(SCORES, LABELS, 0)
    with pytest.raises(ValueError, match="no examples"):
        mrr_from_ranks(torch.zeros(0, dtype=torch.long))
