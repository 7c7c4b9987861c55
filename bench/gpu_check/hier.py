"""The HIER attention rows: ``bench.bench_hier_attention.hier_attention_rows`` (the
HT-Encoder's attention as a masked flat history, packed token groups and FlexAttention
block masks, and the flex layout compiled with the check's backend as the loop compiles
its step: FlexAttention and ``create_block_mask`` inside a compiled graph) at 300 and
1,200 history tokens, on the device, at HIER's sizes."""

from __future__ import annotations

import torch

from bench.bench_hier_attention import (
    COMPILED,
    CPU_FLEX,
    NO_CPU_BACKWARD,
    hier_attention_rows,
    rows_table,
)
from bench.gpu_check.report import Check, Headline, Part

HISTORIES = (300, 1200)
TOY_HISTORIES = (24,)
# Every layout computes the masked one's outputs on real tokens: the largest difference
# allowed in the encoder's outputs and the loss, in fp32 and under the policy's autocast
# (bf16, which rounds at about 1e-2 relative).
TOLERANCE_FP32, TOLERANCE_AUTOCAST = 1e-4, 5e-2


def hier_rows(check: Check, part: Part) -> None:
    """The rows, one per history length and layout (and the flex layout compiled as the
    loop compiles), speed-ups over the masked layout."""
    setup = check.setup
    histories = TOY_HISTORIES if setup.smoke else HISTORIES
    device = torch.device(setup.device)
    rows = hier_attention_rows(
        device,
        setup.precision,
        histories,
        setup.repeats,
        setup.smoke,
        setup.warmup,
        None,
        setup.backend,
    )
    scale = "toy" if setup.smoke else "HIER's"
    part.text += [
        f"- `bench_hier_attention` at {scale} sizes, "
        f"{setup.precision_note}, {setup.repeats} timed calls each after {setup.warmup} "
        "warm-up, interleaved; speed-ups over the masked layout; the eager layouts' masks "
        f"built once per batch, apart from the timing; `{COMPILED}`: compiled with "
        f"{setup.backend} as the loop compiles its step, its masks built inside the graph"
        + ("" if setup.cuda else CPU_FLEX),
        rows_table(rows),
    ]
    tolerance = TOLERANCE_FP32 if setup.autocast_dtype is None else TOLERANCE_AUTOCAST
    off = [
        f"{r['layout']} at {r['history']} tokens ({r['max_abs_diff']:.1e}, {r['loss_diff']})"
        for r in rows
        if max(float(r["max_abs_diff"]), float(r["loss_diff"] or 0.0)) > tolerance
    ]
    if off:
        part.failed = f"outputs or loss differ from the masked layout by > {tolerance}: {off}"
    longest = max(histories)
    for layout in ("packed", "flex", COMPILED):
        row = next(r for r in rows if r["history"] == longest and r["layout"] == layout)
        speedup = row["step_speedup"]
        part.headlines.append(
            Headline(
                f"HIER {layout} vs masked, a training step at {longest} tokens",
                NO_CPU_BACKWARD if speedup is None else f"{speedup:.2f}x",
                "",
                "did not finish in 50 s",
            )
        )
