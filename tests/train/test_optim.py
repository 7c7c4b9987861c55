"""Optimizers and learning-rate schedules from ``train`` params."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.config import OptimizerParams, ScheduleKind, ScheduleParams
from pipeline.train.optim import lr_factor, make_optimizer, make_scheduler


def test_noam_and_linear_warmup_schedules():
    noam = ScheduleParams(kind=ScheduleKind.NOAM, warmup_steps=4)
    factors = [lr_factor(s, noam) for s in range(12)]
    assert max(factors) == pytest.approx(1.0) and factors.index(max(factors)) == 3
    assert factors[0] == pytest.approx(0.25) and factors[11] == pytest.approx((4 / 12) ** 0.5)
    linear = ScheduleParams(kind=ScheduleKind.LINEAR_WARMUP, warmup_steps=4)
    assert [lr_factor(s, linear) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_the_optimizer_takes_the_trainable_weights_and_the_schedule_scales_its_rate():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].weight.requires_grad_(False)
    params = OptimizerParams(kind="adamw", lr=0.5, betas=(0.8, 0.9), weight_decay=0.1)
    optimizer = make_optimizer(model, params)
    assert type(optimizer) is torch.optim.AdamW
    (group,) = optimizer.param_groups
    assert [p.shape for p in group["params"]] == [(2,), (1, 2), (1,)]  # not the frozen one
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.9), 0.1)
    assert type(make_optimizer(model, OptimizerParams())) is torch.optim.Adam
    schedule = ScheduleParams(kind=ScheduleKind.LINEAR_WARMUP, warmup_steps=4)
    scheduler = make_scheduler(optimizer, schedule)
    rates = []
    for _ in range(5):
        rates.append(group["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5])
