"""The HIER attention rows: ``bench.bench_hier_attention.hier_attention_rows`` (the
HT-Encoder's attention as a masked flat history, packed token groups and FlexAttention
block masks) at 300 and 1,200 history tokens, on the device, at HIER's sizes."""

from __future__ import annotations

import torch

from bench.bench_hier_attention import hier_attention_rows
from bench.common import DTYPES, number, table
from bench.gpu_check.report import Check, Headline, Part

HISTORIES = (300, 1200)
TOY_HISTORIES = (24,)
COLUMNS = {"encoder_fwd": "encoder fwd", "encoder_train": "encoder fwd+bwd", "step": "step"}


def hier_rows(check: Check, part: Part) -> None:
    """The rows, one per history length and layout, speed-ups over the masked layout."""
    setup = check.setup
    histories = TOY_HISTORIES if setup.smoke else HISTORIES
    dtype = None if setup.dtype == "fp32" else DTYPES[setup.dtype]
    rows = hier_attention_rows(
        torch.device(setup.device), dtype, histories, setup.repeats, setup.smoke, setup.warmup
    )
    cells = []
    for row in rows:
        timings = [f"{number(row[f'{key}_ms'])} ({row[f'{key}_speedup']:.2f}x)" for key in COLUMNS]
        cells.append(
            [
                row["batch"],
                row["layout"],
                *timings,
                f"{row['max_abs_diff']:.1e}",
                f"{row['loss_diff']:.1e}",
            ]
        )
    headers = ["B x L", "layout", *(f"{name} ms (speed-up)" for name in COLUMNS.values())]
    scale = "toy" if setup.smoke else "HIER's"
    part.text += [
        f"- `bench_hier_attention` at {scale} sizes, "
        f"{setup.precision}, {setup.repeats} timed calls each after {setup.warmup} "
        "warm-up, interleaved; speed-ups over the masked layout",
        table([*headers, "max abs diff vs masked", "loss diff"], cells),
    ]
    longest = max(histories)
    for layout in ("packed", "flex"):
        row = next(r for r in rows if r["history"] == longest and r["layout"] == layout)
        part.headlines.append(
            Headline(
                f"HIER {layout} vs masked, a training step at {longest} tokens",
                f"{row['step_speedup']:.2f}x",
                "",
                "did not finish in 50 s",
            )
        )
