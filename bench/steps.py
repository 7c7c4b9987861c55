"""The training steps the benchmarks time: ours are the loop's own, the peers' are theirs.

- :func:`loop_step`: one of our models trained by the training loop's own step
  (``pipeline.train.loop.loop_step``: the execution policy's autocast and compile, the
  project's ``make_optimizer``, token weighting, clipping, the schedule) on a batch built
  by the data layer, moved and padded as the loop moves and pads its batches;
- :func:`peer_step`: a peer model (HF GPT-2, BART, ``nn.Transformer``) trained through
  its own code (its loss function) with everything else the loop's execution policy
  decides for ours: the same optimizer (``make_optimizer``: fused Adam/AdamW on CUDA),
  autocast, clipping, the batch padded and moved as the loop pads and moves ours, and,
  when compiled, the policy's compile of it (``CompileSettings``: the same backend and
  mode, dynamic shapes without duck sizing), so that the rows differ in the models' code
  and the loop's overhead, nothing else. (A user who calls a bare ``torch.compile`` on a
  peer gets static shapes first, duck sizing, no padding: not what these rows measure.)

Both share :class:`StepSettings`; a step is a callable with no arguments (one optimizer
step on its fixed batch), which ``common.interleaved`` times; :func:`candidate_step` is
``bench.models``' candidate's step, ours or a peer's. :func:`step_flops` counts a step's
model FLOPs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bench.device import place
from bench.models import OURS
from pipeline.config import (
    CompileMode,
    OptimizerKind,
    OptimizerParams,
    Precision,
    RunParams,
    ScheduleParams,
)
from pipeline.data.batch import Batch
from pipeline.execution import ExecutionOverrides, ExecutionPolicy
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

    @property
    def execution(self) -> ExecutionOverrides:
        """The loop's overrides of these settings: the compile backend (when compiled)."""
        return ExecutionOverrides(self.compile_backend or "inductor")

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
        execution=settings.execution,
    )
    step = the_loops_step(job, torch.device(device))
    prepared = step.prepare(batch)
    return lambda: step.step(prepared)


class _LossOf(nn.Module):
    """``forward(batch) = loss_fn(batch)``: a peer's loss as a module, so that the policy
    compiles it as it compiles our loss module (``ExecutionPolicy.compile_module``)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any], Tensor]) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: Batch) -> Tensor:
        return self.loss_fn(batch)


def peer_step(
    model: nn.Module,
    loss_fn: Callable[[Any], Tensor],
    batch: Batch,
    device: torch.device | str,
    settings: StepSettings,
) -> Callable[[], None]:
    """One optimizer step of a peer ``model`` through its own ``loss_fn`` on ``batch``,
    everything else as the loop's execution policy of ``settings`` decides for our rows
    (module docstring): the batch padded and moved, the optimizer, autocast, clipping,
    the compile and the step's shape settings."""
    device = torch.device(device)
    params = settings.run_params()
    policy = ExecutionPolicy.for_training(params, device, overrides=settings.execution)
    place(model, device)
    (batch,) = policy.training_batches([batch])
    optimizer = make_optimizer(model, params.optimizer, policy.fused_optimizer)
    loss_of = _LossOf(model, loss_fn)
    policy.compile_module(loss_of)
    model.train()

    def step() -> None:
        with policy.step(checked=False):
            optimizer.zero_grad(set_to_none=True)
            with policy.autocast():
                loss = loss_of(batch)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            optimizer.step()

    return step


def candidate_step(
    name: str,
    model: nn.Module,
    loss_fn: Callable[[Batch], Tensor],
    batch: Batch,
    device: str,
    precision: Precision,
    compile_backend: str | None = None,
) -> Callable[[], None]:
    """One optimizer step of candidate ``name`` on ``batch`` at ``precision`` (the
    execution policy's): ours (``bench.models.OURS``) the loop's own (:func:`loop_step`),
    a peer's through its own ``loss_fn`` (:func:`peer_step`); compiled with
    ``compile_backend`` unless None."""
    settings = StepSettings(precision=precision, compile_backend=compile_backend)
    if name in OURS:
        return loop_step(model, batch, device, settings)
    return peer_step(model, loss_fn, batch, device, settings)


def step_flops(model: nn.Module, loss_fn: Callable[[Any], Tensor], batch: Batch) -> int:
    """FLOPs of one forward + backward of ``loss_fn`` on ``batch`` (matmuls and attention,
    ``torch.utils.flop_counter``); the gradients are dropped after."""
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    with FlopCounterMode(display=False) as counter:
        loss_fn(batch).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()
