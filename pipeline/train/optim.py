"""Optimizer and learning-rate schedule from ``train`` params."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn, optim
from torch.optim.lr_scheduler import LambdaLR

from pipeline.config import OptimizerKind, OptimizerParams, ScheduleKind, ScheduleParams


def make_optimizer(
    model: nn.Module, params: OptimizerParams, fused: bool = False
) -> optim.Optimizer:
    """Adam or AdamW over the model's trainable parameters: the ``fused`` implementation
    (one kernel for the whole update; the execution policy's choice, on CUDA), else the
    multi-tensor (``foreach``) one, which on CPU computes exactly what the per-parameter
    loop computed (``tests/train/test_optim.py``).

    With ``embedding_lr_multiplier`` m != 1 the token embedding (``token_embedding``; the
    output projection too where it is tied) is a second parameter group at m x ``lr``,
    after the group of every other weight, as the Transformer-XL PTB recipe builds its
    optimizer (train.py l. 245-263: ``lr_list = [lr, lr * emb_mult]``); the schedule
    scales each group from its own learning rate (:func:`make_scheduler`)."""
    cls = optim.AdamW if params.kind == OptimizerKind.ADAMW else optim.Adam
    weights = [p for p in model.parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [{"params": weights}]
    if params.embedding_lr_multiplier != 1.0:
        embedding = token_embedding(model)
        groups = [
            {"params": [p for p in weights if p is not embedding]},
            {"params": [embedding], "lr": params.lr * params.embedding_lr_multiplier},
        ]
    kernel = {"fused": True} if fused else {"foreach": True}
    return cls(
        groups, lr=params.lr, betas=params.betas, eps=params.eps,
        weight_decay=params.weight_decay, **kernel,
    )  # fmt: skip


def token_embedding(model: nn.Module) -> nn.Parameter:
    """The trainable weight of ``model``'s one token embedding (``TaskModel``'s
    ``token_embedding``); an error for a model without one, which the params check
    refuses the multiplier for before any run (``pipeline.plan.check``)."""
    found = getattr(model, "token_embedding", lambda: None)()
    if found is None or not found.requires_grad:
        raise ValueError(
            f"{type(model).__name__} has no trainable token embedding to give "
            "optimizer.embedding_lr_multiplier"
        )
    return found


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
    ``planned_steps``: the cosine's decay steps when ``params.decay_steps`` is null. Each
    parameter group is scaled from its own learning rate and the cosine takes every group
    down to the one ``min_lr``, as the Transformer-XL PTB recipe's ``CosineAnnealingLR``
    with one ``eta_min`` does, after a warm-up of each group from its own rate (train.py
    l. 272-273, 347-352)."""

    def factor(lr: float) -> Callable[[int], float]:
        floor = params.min_lr / lr
        return lambda step: lr_factor(step, params, floor, planned_steps)

    # functions, not callable objects: LambdaLR would store an object's fields in the
    # checkpoint, which loads with weights_only
    return LambdaLR(optimizer, [factor(group["lr"]) for group in optimizer.param_groups])
