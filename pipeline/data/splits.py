"""Train/valid/test: the split names, and a seeded split by dialogue for corpora without one.

The seeded split ranks dialogue ids by ``sha256(seed, id)`` and cuts the ranking at the
requested fractions, so a dialogue's split depends only on the seed and the *set* of ids:
it is stable under reordering of the file, and the sizes are exact up to rounding.
"""

from __future__ import annotations

import enum
import hashlib
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
    n = len(ranked)
    n_test = min(round(n * params.test), n)
    n_valid = min(round(n * params.valid), n - n_test)
    assignment: dict[str, Split] = {}
    for rank, dialogue_id in enumerate(ranked):
        if rank < n_test:
            assignment[dialogue_id] = Split.TEST
        elif rank < n_test + n_valid:
            assignment[dialogue_id] = Split.VALID
        else:
            assignment[dialogue_id] = Split.TRAIN
    return assignment
