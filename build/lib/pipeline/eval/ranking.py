"""Response-selection metrics: Recall@k of N candidates and mean reciprocal rank.

Definitions follow the official DSTC7 track 1 scorer (``IBM/dstc-noesis``,
``evaluations/metrics.py``): an example's rank is the 1-based position of its FIRST
correct candidate in the ranking (0 when it has none, which counts as a miss);
Recall@k is the fraction of examples with ``1 <= rank <= k``; MRR averages ``1/rank``
with a miss contributing 0. With several correct candidates (DSTC7 subtask 3) only the
best-placed one counts, as in the scorer.

The scorer reads a ranked list; we rank by score, so ties must be broken somehow. We
break them PESSIMISTICALLY: every incorrect candidate whose score equals the best correct
score is placed before it. A constant scorer therefore gets R@1 = 0 instead of a lucky
1/N (the MiuLab code adds random noise instead, which makes metrics irreproducible).
For DSTC7 subtask 4, score the virtual NONE candidate first (``rankers.append_none`` and
``rankers.none_labels``) so that every example has a correct candidate.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(scores: Tensor, labels: Tensor) -> None:
    if scores.dim() != 2:
        raise ValueError(
            f"scores: expected [examples, candidates], got shape {tuple(scores.shape)}"
        )
    if labels.shape != scores.shape:
        raise ValueError(
            f"labels: shape {tuple(labels.shape)} differs from scores {tuple(scores.shape)}"
        )
    if scores.is_floating_point() and torch.isnan(scores).any():
        raise ValueError("scores: contains NaN; a ranking of NaN scores is undefined")
    if not ((labels == 0) | (labels == 1)).all():
        raise ValueError("labels: must be 0/1 (1 = correct candidate)")


def first_correct_ranks(scores: Tensor, labels: Tensor) -> Tensor:
    """Per-example 1-based rank of the first correct candidate, ``[B]`` long; 0 = none.

    ``scores`` ``[B, N]`` (higher is better), ``labels`` ``[B, N]`` 0/1. Ties with
    incorrect candidates are broken pessimistically (see the module docstring).
    """
    _check(scores, labels)
    correct = labels.bool()
    scores = scores.double()
    best = scores.masked_fill(~correct, float("-inf")).max(-1, keepdim=True).values
    ahead = ((scores >= best) & ~correct).sum(-1)
    return torch.where(correct.any(-1), ahead + 1, torch.zeros_like(ahead))


def _check_k(k: int) -> None:
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")


def recall_from_ranks(ranks: Tensor, k: int) -> float:
    """Fraction of examples whose first correct candidate is within the top ``k``."""
    _check_k(k)
    if ranks.numel() == 0:
        raise ValueError("ranks: no examples")
    return float(((ranks >= 1) & (ranks <= k)).double().mean())


def mrr_from_ranks(ranks: Tensor) -> float:
    """Mean of ``1/rank`` (0 for examples without a correct candidate)."""
    if ranks.numel() == 0:
        raise ValueError("ranks: no examples")
    reciprocal = torch.where(ranks > 0, 1.0 / ranks.clamp(min=1).double(), 0.0)
    return float(reciprocal.mean())
