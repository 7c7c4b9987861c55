"""Evaluation's batch size: the largest that fits the device, every rank at the same one.

:class:`LargestBatch` halves the size on ``torch.cuda.OutOfMemoryError`` and remembers it.
With several ranks each one evaluates every ``world_size``-th batch of a plan made at that
size, so the ranks must agree on it: after every attempt they say whether theirs ran out
of memory (:func:`ranks_agree`: one all-reduce of one number per attempt, not per batch),
and if any did, all of them halve and start over. A rank that halved alone would slice
another plan than the others, and the validation loss and the weights kept would be wrong
with no error.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")
LARGE_EVAL_BATCH = 512  # examples per device an evaluation on CUDA starts from


def batch_limit(limit: int | None, configured: int, size: int) -> int | None:
    """The number of batches of ``size`` examples that evaluates what ``limit`` batches of
    ``configured`` examples did (all of it, and no more where ``size`` divides it)."""
    if limit is None or size == configured:
        return limit
    return math.ceil(limit * configured / size)


def ranks_agree(
    all_reduce: Callable[[Tensor], Tensor], device: torch.device
) -> Callable[[bool], bool]:
    """``any_rank(flag)``: whether any rank passed True (collective: every rank calls it
    at the same point); ``all_reduce`` sums a tensor over ranks."""

    def any_rank(flag: bool) -> bool:
        return bool(all_reduce(torch.tensor([float(flag)], device=device)).item() > 0)

    return any_rank


def release_cached_memory() -> None:
    """The CUDA memory torch caches, back to the device (for the other trainings that may
    share it); nothing without CUDA."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class LargestBatch:
    """The largest batch size that fits the device, found by halving on out-of-memory
    and remembered for the next evaluation (``size``; None until the first). After an
    evaluation on CUDA the memory it cached goes back to the device."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size

    def run(
        self,
        attempt: Callable[[int], T],
        start: int,
        any_rank: Callable[[bool], bool] | None = None,
    ) -> T:
        """``attempt(size)`` from the remembered size (else ``start``), halving the size
        and trying again on ``torch.cuda.OutOfMemoryError`` (said on stderr); a batch of
        one that does not fit raises. With ``any_rank`` (several ranks) every rank
        halves and tries again when any rank ran out of memory, so all stay at one size."""
        if self.size is None:
            self.size = start
        while True:
            failed = False
            try:
                result = attempt(self.size)
            except torch.cuda.OutOfMemoryError:
                if self.size == 1 and any_rank is None:
                    raise
                failed = True
            # outside the handler: the failed attempt's tensors are released by now
            here = failed
            if any_rank is not None:
                failed = any_rank(failed)
            if not failed:
                break
            if self.size == 1:
                where = "" if here else " on another rank"
                raise torch.cuda.OutOfMemoryError(
                    f"evaluation out of memory{where} at a batch of one example"
                )
            smaller = max(1, self.size // 2)
            where = "" if here else " (another rank's)"
            print(
                f"evaluation out of memory at batch {self.size}{where}: trying {smaller}",
                file=sys.stderr,
                flush=True,
            )
            self.size = smaller
            release_cached_memory()
        release_cached_memory()
        return result
