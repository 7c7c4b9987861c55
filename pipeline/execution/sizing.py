"""Evaluation's batch size: the largest that fits the device, every rank at the same one.

:class:`LargestBatch` halves the size when an attempt runs out of device memory
(:func:`out_of_memory` says which errors are that) and remembers it. With several ranks
each one evaluates every ``world_size``-th batch of a plan made at that size, so the ranks
must agree on it: after every attempt each rank says how its attempt ended, a
:class:`Status` (:func:`ranks_agree`: one all-reduce of ``world_size`` numbers per attempt,
not per batch; a gather of the messages only when an attempt raised another error). If
any rank ran out of memory, all of them halve and start over; if any rank's attempt raised
another error, every rank raises (the failing rank its own error, the others a
:class:`RankFailed` naming it). A rank that halved alone would slice another plan than the
others, and the validation loss and the weights kept would be wrong with no error; a rank
that raised alone would leave the others waiting in the agreement until the process
group's timeout.

The invariant this rests on: **an attempt contains no collective.** Every rank reaches the
agreement after its attempt, whatever happened in it; a collective inside an attempt
would wait for a rank whose attempt already failed. So an attempt runs the plain model,
never one wrapped in ``DistributedDataParallel`` (its forward may broadcast buffers):
:func:`require_no_collectives` refuses one.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

T = TypeVar("T")
LARGE_EVAL_BATCH = 512  # examples per device an evaluation on CUDA starts from

# A RuntimeError that is the device running out of memory outside torch's caching
# allocator: a cuBLAS or cuDNN handle or workspace that could not be allocated, or a raw
# CUDA allocation. Each names its cause in the message, and nothing else does.
OUT_OF_MEMORY_MARKERS = (
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDA error: out of memory",
)


class Status(enum.IntEnum):
    """How one rank's attempt ended; the ranks' worst decides what all of them do."""

    OK = 0
    OUT_OF_MEMORY = 1  # every rank halves the batch and tries again
    ERROR = 2  # every rank raises


# ``agree(status, message)``: every rank's (status, message) in rank order (collective:
# every rank calls it after every attempt); a message is empty unless its status is ERROR.
Agree = Callable[[Status, str], list[tuple[Status, str]]]


class RankFailed(RuntimeError):
    """Raised on every other rank when one rank's evaluation attempt raised an error that
    is not out-of-memory (that rank raises its own)."""


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory: torch's
    ``torch.cuda.OutOfMemoryError``, or a ``RuntimeError`` naming one of
    :data:`OUT_OF_MEMORY_MARKERS` (cuBLAS's ``CUBLAS_STATUS_ALLOC_FAILED`` surfaces as a
    plain ``RuntimeError``, and a smaller batch needs a smaller workspace)."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in OUT_OF_MEMORY_MARKERS)


def batch_limit(limit: int | None, configured: int, size: int) -> int | None:
    """The number of batches of ``size`` examples that evaluates what ``limit`` batches of
    ``configured`` examples did (all of it, and no more where ``size`` divides it)."""
    if limit is None or size == configured:
        return limit
    return math.ceil(limit * configured / size)


class Ranks(Protocol):
    """The collectives of one rank among ``world_size`` (a training worker's context)."""

    rank: int
    world_size: int

    def all_reduce(self, values: Tensor) -> Tensor:
        """Sum of ``values`` over ranks (returned, every rank gets it)."""
        ...

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (every rank gets the list)."""
        ...


def ranks_agree(ranks: Ranks, device: torch.device) -> Agree:
    """The agreement of ``ranks.rank`` (:data:`Agree`): one all-reduce on ``device`` of
    every rank's status (each at its own index), then, only when some rank's status is
    ERROR (which every rank then knows), a gather of the messages."""

    def agree(status: Status, message: str) -> list[tuple[Status, str]]:
        mine = torch.zeros(ranks.world_size, device=device)
        mine[ranks.rank] = float(status)
        statuses = [Status(int(s)) for s in ranks.all_reduce(mine).tolist()]
        messages = [""] * ranks.world_size
        if Status.ERROR in statuses:
            messages = [str(m) for m in ranks.gather(message if status is Status.ERROR else "")]
        return list(zip(statuses, messages, strict=True))

    return agree


def require_no_collectives(module: nn.Module) -> None:
    """Refuse ``module`` for an evaluation attempt when it, or a part of it, is wrapped in
    ``DistributedDataParallel``: an attempt contains no collective (module docstring)."""
    wrapped = next(
        (name for name, m in module.named_modules()
         if isinstance(m, nn.parallel.DistributedDataParallel)),
        None,
    )  # fmt: skip
    if wrapped is not None:
        where = "the model" if wrapped == "" else f"its part {wrapped!r}"
        raise ValueError(
            f"an evaluation attempt got a model whose {where} is wrapped in "
            "DistributedDataParallel, whose forward may run collectives that wait forever "
            "for a rank whose attempt failed: evaluate the plain module (DDP's .module)"
        )


class LargestBatch:
    """The largest batch size that fits the device, found by halving on out-of-memory
    and remembered for the next evaluation (``size``; None until the first). After every
    attempt the memory it cached goes back to the device (``release``: the policy's)."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size

    def run(
        self,
        attempt: Callable[[int], T],
        start: int,
        agree: Agree | None = None,
        release: Callable[[], None] = lambda: None,
    ) -> T:
        """``attempt(size)`` from the remembered size (else ``start``), halving the size
        and trying again when it runs out of memory (:func:`out_of_memory`; said on
        stderr); a batch of one that does not fit raises, and so does any other error.
        With ``agree`` (several ranks) every rank halves and tries again when any rank
        ran out of memory, and every rank raises when any rank's attempt raised another
        error, so all stay at one size and none waits for a rank that stopped."""
        if self.size is None:
            self.size = start
        while True:
            status, error = Status.OK, None
            try:
                result = attempt(self.size)
            except Exception as err:
                if not out_of_memory(err):
                    if agree is None:
                        raise
                    status, error = Status.ERROR, err
                elif self.size == 1 and agree is None:
                    raise
                else:
                    # the error is dropped with the handler: its frames hold the failed
                    # attempt's tensors, which the next attempt needs the memory of
                    status = Status.OUT_OF_MEMORY
            outcomes = [(status, "")] if agree is None else agree(status, _describe(error))
            failed = [(r, m) for r, (s, m) in enumerate(outcomes) if s is Status.ERROR]
            if error is not None:
                raise error
            if failed:
                rank, message = failed[0]
                raise RankFailed(
                    f"evaluation stopped: rank {rank}'s attempt at a batch of {self.size} "
                    f"raised {message}; that rank's log has the traceback"
                )
            here = status is Status.OUT_OF_MEMORY
            if not here and all(s is Status.OK for s, _ in outcomes):
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
            release()
        release()
        return result


def _describe(error: BaseException | None) -> str:
    """What the other ranks say of this rank's error: its type and message."""
    return "" if error is None else f"{type(error).__name__}: {error}"
