"""Seeded split by dialogue id: exact sizes, determinism, order invariance, disjointness."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import SplitParams
from pipeline.data.splits import Split, assign_splits
from pipeline.errors import ConfigError


def _sizes(assignment: dict[str, Split]) -> dict[Split, int]:
    return {s: sum(1 for v in assignment.values() if v is s) for s in Split}


def test_sizes_are_exact_up_to_rounding() -> None:
    ids = [f"d{i}" for i in range(1000)]
    assignment = assign_splits(ids, SplitParams(seed=1, valid=0.1, test=0.15))
    assert _sizes(assignment) == {Split.TRAIN: 750, Split.VALID: 100, Split.TEST: 150}
    assert set(assignment) == set(ids)


def test_deterministic_and_seed_dependent() -> None:
    ids = [f"conv-{i}" for i in range(200)]
    first = assign_splits(ids, SplitParams(seed=13))
    assert assign_splits(list(ids), SplitParams(seed=13)) == first
    other = assign_splits(ids, SplitParams(seed=14))
    assert other != first
    assert _sizes(other) == _sizes(first)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=60, unique=True), st.randoms()
)
def test_stable_under_reordering(ids: list[str], rnd: random.Random) -> None:
    shuffled = list(ids)
    rnd.shuffle(shuffled)
    params = SplitParams(seed=5)
    assert assign_splits(shuffled, params) == assign_splits(ids, params)


def test_adding_a_dialogue_moves_at_most_one_other() -> None:
    # Rank-based cuts: one new id shifts each boundary by at most one position.
    ids = [f"x{i}" for i in range(100)]
    before = assign_splits(ids, SplitParams())
    after = assign_splits([*ids, "new"], SplitParams())
    moved = [i for i in ids if before[i] is not after[i]]
    assert len(moved) <= 2


def test_duplicate_ids_are_an_error() -> None:
    with pytest.raises(ValueError, match="duplicate dialogue id 'a'"):
        assign_splits(["a", "b", "a"], SplitParams())


def test_zero_fractions_put_everything_in_train() -> None:
    assignment = assign_splits(["a", "b", "c"], SplitParams(valid=0, test=0))
    assert set(assignment.values()) == {Split.TRAIN}


@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("train", Split.TRAIN),
        ("val", Split.VALID),
        ("dev", Split.VALID),
        ("Valid", Split.VALID),
        ("test", Split.TEST),
    ],
)
def test_parse_names(name: str, split: Split) -> None:
    assert Split.parse(name) is split


def test_parse_rejects_unknown_name() -> None:
    with pytest.raises(ConfigError, match="unknown split 'training'"):
        Split.parse("training")
