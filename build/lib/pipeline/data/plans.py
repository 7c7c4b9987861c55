"""An epoch's batches as lists of example indices, the same on every rank: by a number of
examples (``plan_batches``) or by a budget of padded tokens (``plan_token_batches``).

Both are functions of (seed, epoch) only, so every rank builds the same plan and a run
resumed mid-epoch skips exactly the batches it already trained on; both give a batch count
that divides by the number of ranks (a DDP rank with one batch fewer would wait forever
for the others' gradients).
"""

from __future__ import annotations

import numpy as np

BUCKET_BATCHES = 50  # batches per sorting window: long enough to group lengths, short
# enough that an epoch's batches still mix lengths.


def plan_batches(
    lengths: np.ndarray,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    bucket: bool = True,
    drop_last: bool = False,
    world_size: int = 1,
) -> list[list[int]]:
    """Every batch of one epoch, as lists of example indices; rank r takes ``[r::world_size]``.

    Order: a seeded permutation (``shuffle``), sorted by length within windows of
    ``BUCKET_BATCHES`` batches (``bucket``), cut into batches, batch order shuffled. The
    count is then made a multiple of ``world_size``: ``drop_last`` drops the partial batch
    and the remainder; otherwise the largest batches are split (or, with fewer examples
    than ranks, batches repeated from the start).
    """
    n = len(lengths)
    rng = np.random.default_rng([seed, epoch])
    order = _sorted_windows(lengths, BUCKET_BATCHES * batch_size if bucket else None, rng, shuffle)
    batches = [order[i : i + batch_size].tolist() for i in range(0, n, batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    if drop_last:
        return batches[: len(batches) - len(batches) % world_size]
    return _even_out(batches, world_size)


def _sorted_windows(
    keys: np.ndarray, window: int | None, rng: np.random.Generator, shuffle: bool
) -> np.ndarray:
    """The examples' order: a permutation drawn from ``rng`` (``shuffle``; else as
    stored), then sorted by ``keys`` within consecutive windows of ``window`` examples
    (None: not sorted)."""
    n = len(keys)
    order = rng.permutation(n) if shuffle else np.arange(n)
    if window is not None:
        for start in range(0, n, window):
            chunk = order[start : start + window]
            order[start : start + window] = chunk[np.argsort(keys[chunk], kind="stable")]
    return order


def _even_out(batches: list[list[int]], world_size: int) -> list[list[int]]:
    """Split the largest batches in two until the count divides by ``world_size``."""
    batches = list(batches)
    while batches and len(batches) % world_size:
        i = max(range(len(batches)), key=lambda k: (len(batches[k]), -k))
        if len(batches[i]) < 2:
            # Fewer examples than ranks: repeat batches (the only way to keep ranks in step).
            need = world_size - len(batches) % world_size
            batches.extend(batches[k % len(batches)] for k in range(need))
            break
        half = (len(batches[i]) + 1) // 2
        batches[i : i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


def plan_token_batches(
    sizes: np.ndarray,
    budget: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    world_size: int = 1,
) -> list[list[int]]:
    """Every batch of one epoch by tokens; rank r takes ``[r::world_size]``.

    ``sizes``: each example's tokens (``ExampleDataset.token_counts``; a compiled step's
    static shapes, ``execution.Padding``, add at most 7 tokens an example, or a quarter
    with CUDA graphs' buckets, on top of the budget). Order: a seeded permutation
    (``shuffle``), sorted by size within windows of about ``BUCKET_BATCHES`` batches'
    worth of tokens; examples are then taken in that order into a batch while its padded
    size (its count times its largest size) stays within ``budget``, the batch order is
    shuffled and the count made a multiple of ``world_size`` (:func:`_even_out`). An
    example larger than the budget is a batch of its own.
    """
    if budget < 1:
        raise ValueError(f"the token budget must be >= 1, got {budget}")
    n = len(sizes)
    sized = np.maximum(sizes.astype(np.int64), 1)
    rng = np.random.default_rng([seed, epoch])
    window = max(1, int(BUCKET_BATCHES * budget / max(float(sized.mean()) if n else 1.0, 1.0)))
    order = _sorted_windows(sized, window, rng, shuffle)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, size in zip(order.tolist(), sized[order].tolist(), strict=True):
        if current and (len(current) + 1) * max(longest, size) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, size)
    if current:
        batches.append(current)
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return _even_out(batches, world_size)
