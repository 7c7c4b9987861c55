"""Batches onto the device: on CUDA one batch ahead, so the host collates the next batch
while the device runs the step before."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pipeline.data.batch import Batch


def to_device(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """``batches`` moved to ``device``, in order.

    On CUDA the copy runs one batch ahead: batch k+1 is collated, pinned and its
    ``non_blocking`` copy queued before batch k is handed out, so the host prepares the next
    batch while the device is still busy with the step before. The copy goes on the current
    stream, so the kernels that later read the batch wait for it. At most one batch past the
    last one handed out is pulled from ``batches``. On other devices each batch is moved
    when it is handed out.
    """
    if device.type != "cuda":
        for batch in batches:
            yield batch.to(device)
        return
    ahead: Batch | None = None
    for batch in batches:
        moved = batch.pin_memory().to(device, non_blocking=True)
        if ahead is not None:
            yield ahead
        ahead = moved
    if ahead is not None:
        yield ahead
