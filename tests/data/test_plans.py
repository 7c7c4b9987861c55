"""Epoch plans by tokens (``pipeline.data.plans.plan_token_batches``): the budget, every
example once, the same number of batches on every rank, seeded by (seed, epoch)."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.plans import plan_token_batches


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    budget=st.integers(1, 400),
    world_size=st.integers(1, 4),
    shuffle=st.booleans(),
    epoch=st.integers(0, 2),
)
def test_token_batches_keep_the_budget_and_see_every_example_once(
    n, budget, world_size, shuffle, epoch
) -> None:
    sizes = np.random.default_rng(n).integers(1, 90, n)
    plan = plan_token_batches(sizes, budget, shuffle=shuffle, seed=3, epoch=epoch,
                              world_size=world_size)  # fmt: skip
    assert len(plan) % world_size == 0  # every rank the same number of batches
    for batch in plan:  # within the budget, or one example larger than it
        assert len(batch) * sizes[batch].max() <= budget or len(batch) == 1
    seen = Counter(i for batch in plan for i in batch)
    assert sorted(seen) == list(range(n))
    # repeated only where no batch could be split in two to even the ranks out
    assert set(seen.values()) == {1} or all(len(batch) == 1 for batch in plan)


def test_token_batches_are_seeded_group_lengths_and_fill_the_budget() -> None:
    sizes = np.random.default_rng(0).integers(5, 200, 3000)
    plan = lambda **kw: plan_token_batches(sizes, 2048, **kw)  # noqa: E731
    assert plan(seed=1, epoch=0) == plan(seed=1, epoch=0)
    assert plan(seed=1, epoch=0) != plan(seed=1, epoch=1)
    assert plan(seed=1, epoch=0) != plan(seed=2, epoch=0)
    batches = plan(seed=1, epoch=0)
    padded = sum(len(b) * sizes[b].max() for b in batches)
    assert padded <= 2048 * len(batches)
    assert padded / (2048 * len(batches)) > 0.9  # most of each step's budget is used
    assert sizes.sum() / padded > 0.9  # and little of it is padding (length buckets)
    counts = [len(b) for b in batches]
    assert max(counts) > 5 * min(counts)  # short examples come many to a batch


def test_unshuffled_token_batches_keep_order_within_sorted_windows() -> None:
    sizes = np.array([3, 1, 2, 8, 1, 1])
    # one sorting window (50 budgets' worth): sizes 1, 1, 1, 2 | 3 | 8 (5 x 3 > 10)
    assert plan_token_batches(sizes, 10, shuffle=False) == [[1, 4, 5, 2], [0], [3]]
