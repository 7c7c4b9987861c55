"""Equality of example records for tests: the records are ``eq=False`` dataclasses (their
numpy arrays have no single truth value), and only tests compare two of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.data.records import Example


def examples_equal(a: Example, b: Example) -> bool:
    """Field-by-field equality: same record kind, equal arrays, equal sequences of them."""
    if type(a) is not type(b):
        return False
    return all(_value_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))


def _value_equal(x: Any, y: Any) -> bool:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return x is not None and y is not None and np.array_equal(x, y)
    if isinstance(x, Sequence) and not isinstance(x, str):
        return (
            isinstance(y, Sequence)
            and len(x) == len(y)
            and all(_value_equal(p, q) for p, q in zip(x, y, strict=True))
        )
    return x == y
