"""Batches onto the device: on CUDA one batch ahead, so the host collates the next batch
while the device runs the step before."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

from pipeline.data.batch import Batch

T = TypeVar("T")


def to_device(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """``batches`` moved to ``device``, in order (:func:`pairs_to_device`)."""
    for _, batch in pairs_to_device(((None, b) for b in batches), device):
        yield batch


def pairs_to_device(
    pairs: Iterable[tuple[T, Batch]], device: torch.device
) -> Iterator[tuple[T, Batch]]:
    """Each ``(what goes with it, batch)`` of ``pairs`` with the batch moved to
    ``device``, in order.

    On CUDA the copy runs one batch ahead: batch k+1 is collated, pinned and its
    ``non_blocking`` copy queued before batch k is handed out, so the host prepares the next
    batch while the device is still busy with the step before. The copy goes on the current
    stream, so the kernels that later read the batch wait for it. At most one batch past the
    last one handed out is pulled from ``batches``. On other devices each batch is moved
    when it is handed out.
    """
    if device.type != "cuda":
        for item, batch in pairs:
            yield item, batch.to(device)
        return
    ahead: tuple[T, Batch] | None = None
    for item, batch in pairs:
        moved = item, batch.pin_memory().to(device, non_blocking=True)
        if ahead is not None:
            yield ahead
        ahead = moved
    if ahead is not None:
        yield ahead
