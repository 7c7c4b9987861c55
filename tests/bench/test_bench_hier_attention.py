"""``hier_attention_rows``, the HIER attention rows other scripts print (``bench.gpu_check``):
its toy run on a CPU gives every layout's row, each agreeing with the masked one."""

from __future__ import annotations

import torch

from bench.bench_hier_attention import hier_attention_rows
from pipeline.config import Precision
from pipeline.execution import ExecutionPolicy
from pipeline.models import masks
from pipeline.train import loop

KEYS = {"batch", "history", "layout", "masks_ms", "max_abs_diff", "loss_diff", "max_grad_diff"} | {
    f"{kind}_{what}"
    for kind in ("encoder_fwd", "encoder_train", "step")
    for what in ("ms", "speedup")
}


def test_smoke_rows_cover_every_layout_and_agree_with_the_masked_one():
    rows = hier_attention_rows(
        torch.device("cpu"), Precision.FP32, [24, 16], repeats=1, smoke=True, warmup=0
    )
    assert [(r["history"], r["layout"]) for r in rows] == [
        (length, layout) for length in (24, 16) for layout in ("masked", "packed", "flex")
    ]
    assert rows[0]["batch"] == "2 x 24" and rows[3]["batch"] == "3 x 16"
    for row in rows:
        assert set(row) == KEYS
        assert max(row["max_abs_diff"], row["loss_diff"], row["max_grad_diff"]) < 1e-5, row
        assert all(row[f"{kind}_ms"] > 0 for kind in ("encoder_fwd", "encoder_train", "step"))
        if row["layout"] == "masked":
            assert row["step_speedup"] == row["encoder_fwd_speedup"] == 1.0
        assert row["masks_ms"] > 0


def test_masks_are_built_once_per_batch_outside_the_timed_calls(monkeypatch):
    """Issue 40: ``create_block_mask`` ran in every timed flex call and was counted in its
    time. Now each layout builds a history's masks once per pass kind (eval; gradients in
    eval mode and in training mode) and every timed call reuses them."""
    calls = []
    real = masks.history_flex_mask

    def spy(history, mod):
        calls.append(tuple(history.input_ids.shape))
        return real(history, mod)

    monkeypatch.setattr(masks, "history_flex_mask", spy)
    hier_attention_rows(torch.device("cpu"), Precision.FP32, [24], repeats=5, smoke=True, warmup=2)
    # 2 masks (UT, CT) x 3 pass kinds: no grad, gradients in eval mode, training
    assert len(calls) == 2 * 3


def test_every_pass_takes_the_policys_autocast_and_the_step_is_the_loops(monkeypatch):
    """One precision path: every pass runs under an execution policy's autocast of the
    precision asked (the encoder passes the evaluation policy's, the step the loop's), and
    the timed training step is the loop's own (its ``update``)."""
    entered, updates = [], []
    real_autocast, real_update = ExecutionPolicy.autocast, loop._Run.update

    def autocast(policy: ExecutionPolicy):
        entered.append(policy.autocast_dtype)
        return real_autocast(policy)

    def update(run: loop._Run, batch):
        updates.append(batch.batch_size)
        return real_update(run, batch)

    monkeypatch.setattr(ExecutionPolicy, "autocast", autocast)
    monkeypatch.setattr(loop._Run, "update", update)
    hier_attention_rows(torch.device("cpu"), Precision.BF16, [24], repeats=2, smoke=True, warmup=0)
    # one eval pass, a gradient per layout, then 3 layouts x 3 cases x 2 repeats
    assert entered == [torch.bfloat16] * (1 + 3 + 3 * 3 * 2)
    assert updates == [2] * (3 * 2)  # the step of each layout, each repeat: the loop's
