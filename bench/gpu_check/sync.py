"""Sync checks: the loop's steps with ``torch.cuda.set_sync_debug_mode("error")``.

A job's ``ExecutionOverrides.sync_debug`` (the loop's hook) sets the mode around the part
of every step that must not wait for the device (forward to the optimizer step), from the
second step on: any host synchronisation there raises, and the part fails naming where. ``gpt-ptb``
and ``hgpt-ptb`` (the flat and the hierarchical family) train a few logged windows each,
one after the other in this process (the earlier parts compiled their steps already),
with an evaluation at the end. On CPU the mode does not exist: the steps run through the
same hook unchecked, and the part says so.
"""

from __future__ import annotations

import torch

from bench.gpu_check.processes import loop_job
from bench.gpu_check.report import Check, Headline, Part, where
from pipeline.execution import ExecutionOverrides
from pipeline.train.loop import train_local

RUNS = ("gpt-ptb", "hgpt-ptb")


def sync_checks(check: Check, part: Part) -> None:
    """Train ``RUNS`` a few steps each with the sync debug mode "error" (module docstring)."""
    setup, ptb = check.setup, check.ptb()
    steps, log_every = (4, 2) if setup.smoke else (40, 10)
    knobs = {
        "epochs": 10**6,
        "max_steps": steps,
        "log_every": log_every,
        "patience": None,
        "checkpoint_every": None,
        "max_eval_batches": 2,
    }
    cuda = setup.cuda
    rows, failed = [], []
    for key in RUNS:
        job = loop_job(
            ptb.plan(key, **knobs),
            setup.scratch / f"sync-{key}",
            execution=ExecutionOverrides(setup.loop_backend, sync_debug="error"),
        )
        try:
            train_local(job, torch.device(setup.device))
        except RuntimeError as err:  # what the sync debug mode raises
            failed.append(f"{key}: {type(err).__name__} ({where(err)}): {str(err).splitlines()[0]}")
            rows.append(f"- {key}: FAILED: {failed[-1]}")
            continue
        rows.append(f"- {key}: {steps} steps, no host sync")
    part.text.append(
        "\n".join(
            [
                f"- {steps} steps each (logged every {log_every}), then an evaluation; the "
                "mode is on from the second step"
                + ("" if cuda else "; on CPU the mode does not exist: unchecked"),
                *rows,
            ]
        )
    )
    if failed:
        part.failed = "; ".join(failed)
    verdict = "none" if cuda else "n/a on CPU (unchecked)"
    part.headlines.append(
        Headline("host syncs inside a step (gpt, hgpt)", "FOUND" if failed else verdict, "none", "")
    )
