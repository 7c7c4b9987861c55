"""Optimizer and learning-rate schedule from ``train`` params."""

from __future__ import annotations

import math

from torch import nn, optim
from torch.optim.lr_scheduler import LambdaLR

from pipeline.config import OptimizerKind, OptimizerParams, ScheduleKind, ScheduleParams


def make_optimizer(
    model: nn.Module, params: OptimizerParams, fused: bool = False
) -> optim.Optimizer:
    """Adam or AdamW over the model's trainable parameters: the ``fused`` implementation
    (one kernel for the whole update; the execution policy's choice, on CUDA), else the
    multi-tensor (``foreach``) one, which on CPU computes exactly what the per-parameter
    loop computed (``tests/train/test_optim.py``)."""
    cls = optim.AdamW if params.kind == OptimizerKind.ADAMW else optim.Adam
    weights = [p for p in model.parameters() if p.requires_grad]
    kernel = {"fused": True} if fused else {"foreach": True}
    return cls(
        weights, lr=params.lr, betas=params.betas, eps=params.eps,
        weight_decay=params.weight_decay, **kernel,
    )  # fmt: skip


def lr_factor(
    step: int, params: ScheduleParams, floor: float = 0.0, decay_steps: int | None = None
) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Noam (Vaswani et al., 2017) is ``d^-0.5 * min(s^-0.5, s * w^-1.5)``; the ``d^-0.5``
    factor is replaced by ``w^0.5`` so the peak (at ``s = w``) is exactly ``lr``.
    Cosine, with ``s = step + 1``, ``w`` the warm-up and ``D`` the decay steps: ``s / w``
    up to ``w``, then ``f + (1 - f) (1 + cos(pi (s - w) / (D - w))) / 2`` down to ``f`` at
    ``D`` (``floor``: ``min_lr / lr``), then ``f``; ``decay_steps`` is ``D`` when the params
    leave it to the run (``ScheduleParams.decay_steps`` null).
    """
    s, w = step + 1, params.warmup_steps
    if params.kind == ScheduleKind.LINEAR_WARMUP:
        return min(1.0, s / w)
    if params.kind == ScheduleKind.NOAM:
        return min(s**-0.5, s * w**-1.5) * w**0.5
    if params.kind == ScheduleKind.COSINE:
        end = params.decay_steps or decay_steps
        if end is None:
            raise ValueError("a cosine schedule needs its decay steps")
        if s <= w:
            return s / w
        if s >= end:
            return floor
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * (s - w) / (end - w)))
    return 1.0


def make_scheduler(
    optimizer: optim.Optimizer, params: ScheduleParams, planned_steps: int | None = None
) -> LambdaLR:
    """A per-step scheduler (``scheduler.step()`` after every optimizer step).
    ``planned_steps``: the cosine's decay steps when ``params.decay_steps`` is null."""
    floor = params.min_lr / optimizer.defaults["lr"]
    # a function, not a callable object: LambdaLR would store an object's fields in the
    # checkpoint, which loads with weights_only
    return LambdaLR(optimizer, lambda step: lr_factor(step, params, floor, planned_steps))
