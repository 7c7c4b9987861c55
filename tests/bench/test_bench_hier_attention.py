"""``hier_attention_rows``, the HIER attention rows other scripts print (``bench.gpu_check``):
its toy run on a CPU gives every layout's row, each agreeing with the masked one."""

from __future__ import annotations

import torch

from bench import bench_hier_attention
from bench.bench_hier_attention import hier_attention_rows
from pipeline.models import masks

KEYS = {"batch", "history", "layout", "masks_ms", "max_abs_diff", "loss_diff", "max_grad_diff"} | {
    f"{kind}_{what}"
    for kind in ("encoder_fwd", "encoder_train", "step")
    for what in ("ms", "speedup")
}


def test_smoke_rows_cover_every_layout_and_agree_with_the_masked_one():
    rows = hier_attention_rows(torch.device("cpu"), None, [24, 16], repeats=1, smoke=True, warmup=0)
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
    hier_attention_rows(torch.device("cpu"), None, [24], repeats=5, smoke=True, warmup=2)
    # 2 masks (UT, CT) x 3 pass kinds: no grad, gradients in eval mode, training
    assert len(calls) == 2 * 3


def test_every_timed_case_runs_under_the_dtypes_autocast(monkeypatch):
    entered = []
    real = bench_hier_attention.precision

    def spy(device: torch.device, dtype: torch.dtype | None):
        entered.append(dtype)
        return real(device, dtype)

    monkeypatch.setattr(bench_hier_attention, "precision", spy)
    hier_attention_rows(torch.device("cpu"), torch.bfloat16, [24], repeats=2, smoke=True, warmup=0)
    # one eval pass, a gradient per layout, then 3 layouts x 3 cases x 2 repeats
    assert entered == [torch.bfloat16] * (1 + 3 + 3 * 3 * 2)
    with real(torch.device("cpu"), torch.bfloat16):
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
