"""Several ranks of a ``torch.distributed`` gloo group as forked processes on CPU, for the
tests of what ranks agree on (no Ray)."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

TIMEOUT = datetime.timedelta(seconds=20)  # a rank left waiting fails its test, not hangs it


class GlooRanks:
    """The collectives of one rank of the gloo group this process joined
    (``execution.Ranks``, as a training worker's context has them)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(values)
        return values

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, value)
        return out


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, folder: Path) -> Iterator[GlooRanks]:
    """Rank ``rank`` of a gloo group of ``world_size`` meeting in ``folder``, its
    collectives timing out after :data:`TIMEOUT`; left when the block ends."""
    torch.set_num_threads(1)  # forked: no OpenMP pool from the parent
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{folder}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=TIMEOUT,
    )
    try:
        yield GlooRanks(rank, world_size)
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(target: Any, args: tuple[Any, ...], world_size: int = 2) -> None:
    """``target(rank, *args)`` in ``world_size`` forked processes; raises what one raised."""
    torch.multiprocessing.start_processes(target, args, nprocs=world_size, start_method="fork")
