"""The training steps the benchmarks time: ours are the loop's own, the peers' are theirs.

- :func:`loop_step`: one of our models trained by the training loop's own step
  (``pipeline.train.loop.loop_step``: the execution policy's autocast and compile, the
  project's ``make_optimizer``, token weighting, clipping, the schedule) on a batch built
  by the data layer, moved and padded as the loop moves and pads its batches;
- :func:`peer_step`: a peer model (HF GPT-2, BART, ``nn.Transformer``) trained through
  its own code (its loss function, ``torch.compile``d as a function when compiled), with
  the same optimizer (``make_optimizer``: fused Adam/AdamW on CUDA), autocast and clipping,
  so that the rows differ in the models' code and the loop's overhead, nothing else.

Both share :class:`StepSettings`; a step is a callable with no arguments (one optimizer
step on its fixed batch), which ``common.interleaved`` times.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.config import (
    CompileMode,
    OptimizerKind,
    OptimizerParams,
    Precision,
    RunParams,
    ScheduleParams,
)
from pipeline.data.batch import Batch
from pipeline.execution import ExecutionPolicy
from pipeline.train.loop import TrainJob
from pipeline.train.loop import loop_step as the_loops_step
from pipeline.train.optim import make_optimizer

CLIP_NORM = 1.0  # the U-Net paper's, and the loop's default


@dataclass(frozen=True)
class StepSettings:
    """What every benchmarked step shares: the optimizer (``kind``, lr 1e-4, betas
    0.9/0.98: ``OptimizerParams``' defaults), the precision (``auto``: bf16 autocast on
    CUDA, fp32 elsewhere) and the compile backend (None: eager)."""

    optimizer: OptimizerKind = OptimizerKind.ADAM
    precision: Precision = Precision.AUTO
    compile_backend: str | None = None

    @property
    def compiled(self) -> bool:
        return self.compile_backend is not None

    def run_params(self) -> RunParams:
        """The loop's params of these settings: a constant learning rate, no logging."""
        return RunParams(
            optimizer=OptimizerParams(kind=self.optimizer),
            schedule=ScheduleParams(kind="none"),
            clip_norm=CLIP_NORM,
            precision=self.precision,
            compile=CompileMode.ON if self.compiled else CompileMode.OFF,
            log_every=10**9,
            patience=None,
            checkpoint_every=None,
        )


@dataclass(frozen=True)
class _Built:
    """A model factory that hands out a model built already."""

    model: nn.Module

    def __call__(self) -> nn.Module:
        return self.model


class _Repeated:
    """One rank's data that is one batch, every epoch."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        return 1

    def iter_from(self, start: int) -> Iterator[Batch]:
        if start == 0:
            yield self.batch


@dataclass(frozen=True)
class _OneBatch:
    """A data factory of one batch for training and validation."""

    batch: Batch

    def __call__(self, rank: int, world_size: int) -> tuple[_Repeated, _Repeated]:
        return _Repeated(self.batch), _Repeated(self.batch)

    def valid(self, rank: int, world_size: int, batch_size: int) -> _Repeated:
        return _Repeated(self.batch)


def loop_step(
    model: nn.Module, batch: Batch, device: torch.device | str, settings: StepSettings
) -> Callable[[], None]:
    """One optimizer step of ``model`` on ``batch`` as the training loop takes it (module
    docstring); the model moves to ``device``."""
    job = TrainJob(
        name="bench",
        model_name=type(model).__name__,
        model=_Built(model),
        data=_OneBatch(batch),
        params=settings.run_params(),
        run_dir=tempfile.mkdtemp(prefix="hiertx-bench-step-"),  # nothing is written there
        show_progress=False,
        compile_backend=settings.compile_backend or "inductor",
    )
    step = the_loops_step(job, torch.device(device))
    prepared = step.prepare(batch)
    return lambda: step.step(prepared)


def peer_step(
    model: nn.Module,
    loss_fn: Callable[[Any], Tensor],
    batch: Batch,
    device: torch.device | str,
    settings: StepSettings,
) -> Callable[[], None]:
    """One optimizer step of a peer ``model`` through its own ``loss_fn`` on ``batch``
    (moved to ``device`` with the model), with the loop's optimizer, autocast and
    clipping; ``loss_fn`` compiled as a function with the settings' backend, if any."""
    device = torch.device(device)
    model.to(device)
    batch = batch.to(device)
    params = settings.run_params()
    policy = ExecutionPolicy.for_training(params, device)
    optimizer = make_optimizer(model, params.optimizer, policy.fused_optimizer)
    loss_of = (
        torch.compile(loss_fn, backend=settings.compile_backend) if settings.compiled else loss_fn
    )
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with policy.autocast():
            loss = loss_of(batch)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()

    return step
