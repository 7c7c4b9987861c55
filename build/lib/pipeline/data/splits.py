"""Train/valid/test: the split names, and a seeded split by dialogue for corpora without one.

The seeded split ranks dialogue ids by ``sha256(seed, id)`` and cuts the ranking at the
requested fractions, so a dialogue's split depends only on the seed and the *set* of ids:
it is stable under reordering of the file, and the sizes are exact up to rounding.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable

from pipeline.config import SplitParams
from pipeline.errors import ConfigError


class Split(enum.StrEnum):
    TRAIN = "train"
    VALID = "valid"
    TEST = "test"

    @classmethod
    def parse(cls, name: str) -> Split:
        """The split a user or a corpus file name calls ``name`` (``val``/``dev`` mean valid)."""
        key = name.strip().lower()
        if key in _VALID_ALIASES:
            return cls.VALID
        try:
            return cls(key)
        except ValueError:
            choices = ", ".join(s.value for s in cls)
            raise ConfigError("split", f"unknown split {name!r}; choose one of {choices}") from None


# Corpora name their validation split differently (MultiWOZ "val", DSTC7 "dev").
_VALID_ALIASES = frozenset({"val", "dev", "validation"})


def _rank_key(seed: int, dialogue_id: str) -> bytes:
    return hashlib.sha256(f"{seed}\x00{dialogue_id}".encode()).digest()


def assign_splits(ids: Iterable[str], params: SplitParams) -> dict[str, Split]:
    """Map each dialogue id to its split: ``round(n * test)`` ids go to test,
    ``round(n * valid)`` to valid, the rest to train.

    Raises ``ValueError`` on a duplicate id (the split would be ambiguous).
    """
    unique: set[str] = set()
    for dialogue_id in ids:
        if dialogue_id in unique:
            raise ValueError(f"duplicate dialogue id {dialogue_id!r}: ids must be unique to split")
        unique.add(dialogue_id)
    ranked = sorted(unique, key=lambda i: (_rank_key(params.seed, i), i))
    _, n_valid, n_test = split_sizes(len(ranked), params)
    assignment: dict[str, Split] = {}
    for rank, dialogue_id in enumerate(ranked):
        if rank < n_test:
            assignment[dialogue_id] = Split.TEST
        elif rank < n_test + n_valid:
            assignment[dialogue_id] = Split.VALID
        else:
            assignment[dialogue_id] = Split.TRAIN
    return assignment


def split_sizes(n: int, params: SplitParams) -> tuple[int, int, int]:
    """How many of ``n`` dialogues the seeded split gives train, valid and test (Python's
    ``round``: 0.5 rounds to 0, so 5 dialogues at 10% give valid none)."""
    n_test = min(round(n * params.test), n)
    n_valid = min(round(n * params.valid), n - n_test)
    return n - n_test - n_valid, n_valid, n_test


def fewest_dialogues(params: SplitParams) -> int:
    """The fewest dialogues whose seeded split gives every split one or more; a split with
    a fraction of 0 is left out (it never gets one)."""
    fractions = (1.0, params.valid, params.test)  # train takes what the others leave
    wanted = [i for i, fraction in enumerate(fractions) if fraction > 0]
    # below 0.5 / fraction dialogues a split rounds to none: start the search there
    n = max(len(wanted), math.floor(0.5 / min(fractions[i] for i in wanted)))
    while any(split_sizes(n, params)[i] < 1 for i in wanted):
        n += 1
    return n


def held_out_split(split: SplitParams) -> SplitParams:
    """``train_on: valid``'s seeded split of a corpus's validation dialogues into train and
    valid: ``split`` without its test share (the test dialogues stay the corpus's own)."""
    return SplitParams(seed=split.seed, valid=split.valid, test=0.0)
