"""Optimizer and learning-rate schedule from ``train`` params."""

from __future__ import annotations

from torch import nn, optim
from torch.optim.lr_scheduler import LambdaLR

from pipeline.config import OptimizerKind, OptimizerParams, ScheduleKind, ScheduleParams


def make_optimizer(model: nn.Module, params: OptimizerParams) -> optim.Optimizer:
    """Adam or AdamW over the model's trainable parameters."""
    cls = optim.AdamW if params.kind == OptimizerKind.ADAMW else optim.Adam
    return cls(
        [p for p in model.parameters() if p.requires_grad],
        lr=params.lr,
        betas=params.betas,
        eps=params.eps,
        weight_decay=params.weight_decay,
    )


def lr_factor(step: int, params: ScheduleParams) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Noam (Vaswani et al., 2017) is ``d^-0.5 * min(s^-0.5, s * w^-1.5)``; the ``d^-0.5``
    factor is replaced by ``w^0.5`` so the peak (at ``s = w``) is exactly ``lr``.
    """
    s, w = step + 1, params.warmup_steps
    if params.kind == ScheduleKind.LINEAR_WARMUP:
        return min(1.0, s / w)
    if params.kind == ScheduleKind.NOAM:
        return min(s**-0.5, s * w**-1.5) * w**0.5
    return 1.0


def make_scheduler(optimizer: optim.Optimizer, params: ScheduleParams) -> LambdaLR:
    """A per-step scheduler (``scheduler.step()`` after every optimizer step)."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, params))
