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


def test_cosine_schedule_warms_up_decays_to_min_lr_and_stays_there():
    cosine = ScheduleParams(kind=ScheduleKind.COSINE, warmup_steps=2, decay_steps=6, min_lr=0.1)
    floor = 0.1 / 0.4  # min_lr / lr
    # s = step + 1: 1/2, 1 (warm-up); then f + (1 - f) (1 + cos(pi (s - 2) / 4)) / 2
    expected = [
        0.5,
        1.0,
        floor + (1 - floor) * (1 + 0.5**0.5) / 2,  # s = 3: cos(pi / 4)
        floor + (1 - floor) * 0.5,  # s = 4: cos(pi / 2) = 0
        floor + (1 - floor) * (1 - 0.5**0.5) / 2,  # s = 5: cos(3 pi / 4)
        floor,  # s = 6 = decay_steps
        floor,
        floor,
    ]
    factors = [lr_factor(s, cosine, floor) for s in range(8)]
    assert factors == pytest.approx(expected, abs=1e-15)
    # decay_steps null: the run's planned steps decide (make_scheduler's planned_steps)
    planned = ScheduleParams(kind=ScheduleKind.COSINE, warmup_steps=2, min_lr=0.1)
    assert [lr_factor(s, planned, floor, 6) for s in range(8)] == factors
    with pytest.raises(ValueError, match="needs its decay steps"):
        lr_factor(3, planned, floor)
    model = nn.Linear(2, 1)
    optimizer = make_optimizer(model, OptimizerParams(lr=0.4))
    scheduler = make_scheduler(optimizer, planned, planned_steps=6)
    rates = []
    for _ in range(8):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.4 * f for f in expected], abs=1e-15)
    assert rates[-1] == pytest.approx(0.1)


@pytest.mark.parametrize("kind, weight_decay", [("adam", 0.0), ("adam", 0.01), ("adamw", 0.1)])
def test_the_cpu_optimizer_step_is_the_for_loop_one_bit_for_bit(kind, weight_decay):
    """On CPU the optimizer is the multi-tensor (foreach) one: it must compute exactly what
    the per-parameter loop (torch's CPU default before) computed, so the default run's
    numbers do not move."""

    def train(optimizer_for) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
        optimizer = optimizer_for(model)
        inputs = torch.Generator().manual_seed(1)
        for _ in range(30):
            loss = model(torch.randn(4, 7, generator=inputs)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
        return [p.detach() for p in model.parameters()]

    params = OptimizerParams(kind=kind, lr=0.01, weight_decay=weight_decay)
    ours = train(lambda m: make_optimizer(m, params))
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    loop = train(
        lambda m: cls(
            m.parameters(), lr=0.01, betas=params.betas, eps=params.eps,
            weight_decay=weight_decay, foreach=False,
        )
    )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(ours, loop, strict=True))
    group = make_optimizer(nn.Linear(2, 1), params).param_groups[0]
    assert group["foreach"] is True and not group["fused"]  # fused only on CUDA


def _tiny_lm(name: str) -> nn.Module:
    from pipeline.artifacts import DataSizes
    from pipeline.models import registry

    sizes = {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1, "d_sentence": 16,
             "sentence_heads": 2, "sentence_d_ff": 32, "decoder_layers": 1}  # fmt: skip
    fields = registry.spec(name).config_cls.model_fields
    config = {k: v for k, v in sizes.items() if k in fields}
    return registry.build(name, DataSizes(vocab_size=50), **config)


@pytest.mark.parametrize("name", ["gpt", "hgpt"])
def test_the_embedding_multiplier_trains_the_tied_embedding_at_its_own_rate(name):
    """``embedding_lr_multiplier: 2`` (the Transformer-XL PTB recipe's ``--emb_mult 2``):
    the tied embedding, input and output alike, is a second group at 2 x lr, every other
    weight in the first; the warm-up takes each group from 0 to its own rate and the cosine
    takes both down to the one ``min_lr``, as the recipe's ``CosineAnnealingLR`` with one
    ``eta_min`` does (computed here by hand). At 1 (the default) there is one group."""
    model = _tiny_lm(name)
    assert model.token_embedding() is model.output.weight  # tied: one tensor
    assert len(make_optimizer(model, OptimizerParams(lr=0.4)).param_groups) == 1
    optimizer = make_optimizer(model, OptimizerParams(lr=0.4, embedding_lr_multiplier=2))
    rest, embedding = optimizer.param_groups
    assert embedding["params"] == [model.output.weight]
    assert {id(p) for p in rest["params"]} == {
        id(p) for p in model.parameters() if p is not model.output.weight
    }
    cosine = ScheduleParams(kind=ScheduleKind.COSINE, warmup_steps=2, decay_steps=6, min_lr=0.1)
    scheduler = make_scheduler(optimizer, cosine)
    rates = []
    for _ in range(8):
        rates.append((rest["lr"], embedding["lr"]))
        optimizer.step()
        scheduler.step()

    def expected(lr: float) -> list[float]:  # s = step + 1; warm-up to s = 2, cosine to s = 6
        cosine_at = [(1 + 0.5**0.5) / 2, 0.5, (1 - 0.5**0.5) / 2, 0.0, 0.0, 0.0]
        return [lr / 2, lr] + [0.1 + (lr - 0.1) * c for c in cosine_at]

    assert [r for r, _ in rates] == pytest.approx(expected(0.4), abs=1e-15)
    assert [e for _, e in rates] == pytest.approx(expected(0.8), abs=1e-15)
    assert rates[-1] == pytest.approx((0.1, 0.1))


def test_the_embedding_multiplier_needs_a_model_with_a_token_embedding():
    with pytest.raises(ValueError, match="no trainable token embedding"):
        make_optimizer(nn.Linear(2, 1), OptimizerParams(embedding_lr_multiplier=2))
