"""Batches onto the device: on CUDA one batch ahead, so the host collates the next batch
while the device runs the step before."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

from pipeline.data.batch import Batch

T = TypeVar("T")
B = TypeVar("B", bound=Batch)


def moved(batch: B, device: torch.device, non_blocking: bool = False) -> B:
    """``batch`` with every tensor on ``device`` (``non_blocking``: a copy from pinned
    memory that does not wait for the device)."""
    return batch.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))


def pinned(batch: B) -> B:
    """``batch`` with every tensor in page-locked host memory (what a ``non_blocking``
    copy to CUDA needs to overlap the device's work)."""
    return batch.map_tensors(lambda t: t.pin_memory())


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
            yield item, moved(batch, device)
        return
    ahead: tuple[T, Batch] | None = None
    for item, batch in pairs:
        copied = item, moved(pinned(batch), device, non_blocking=True)
        if ahead is not None:
            yield ahead
        ahead = copied
    if ahead is not None:
        yield ahead
