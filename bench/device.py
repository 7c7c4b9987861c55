"""The device a benchmark runs on, and the one place it moves what it builds there.

How a step uses the device (autocast, compile, padding, moving its batches) is the
execution policy's, through the loop's step (``bench.steps``); what is left to a
benchmark is here: whether it runs on CUDA (the parts only a GPU runs, the timing's wait
for the device), placing a model or a fixed batch it builds once, and the evaluation
policy of its ``--precision`` for the forward passes outside a step.
``tests/bench/test_device_guard.py`` holds every other benchmark module to that.
"""

from __future__ import annotations

import argparse
from typing import TypeVar

import torch
from torch import nn

from pipeline.execution import ExecutionPolicy, moved

T = TypeVar("T")


def on_cuda(device: torch.device | str) -> bool:
    """Whether a benchmark runs on a CUDA device: its one test of the device (the parts
    that only a GPU runs, the timing's wait below); how a step uses the device is the
    execution policy's."""
    return torch.device(device).type == "cuda"


def place(value: T, device: torch.device | str) -> T:
    """``value`` (a model, or a fixed batch a benchmark builds once) on ``device``: the
    benchmarks' one move to the device outside the loop's and the policy's own (the
    loop's step moves its model and batch itself); a batch moves as the policy moves
    batches (``execution.transfer.moved``)."""
    if isinstance(value, nn.Module):
        return value.to(device)  # type: ignore[return-value]
    return moved(value, torch.device(device))  # type: ignore[type-var]


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work so wall-clock times cover it (no-op on CPU)."""
    if on_cuda(device):
        torch.cuda.synchronize()


def evaluation_policy(args: argparse.Namespace) -> ExecutionPolicy:
    """The execution policy an evaluation of a model trained at ``--precision`` runs
    under on ``--device`` (its autocast: what a forward outside a training step takes)."""
    return ExecutionPolicy.for_evaluation(args.precision, torch.device(args.device))
