"""What the training loop needs from where it runs, and where the data and model come from.

The loop (``loop.py``) sees its environment through a :class:`WorkerContext` (rank,
device, collectives, checkpoint hand-off): :class:`LocalContext` here runs in-process;
``distributed.RayContext`` and ``search.TuneContext`` run under Ray Train / Ray Tune.

Checkpoints are kept two deep (the newest and the one before), here and under Ray Train
(``CheckpointConfig(num_to_keep=2)``): a newest checkpoint that does not read (a disk
filled up, a copy cut short) is passed over for the one before, with a warning, and a run
with no intact checkpoint stops with the command that starts it over.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from pipeline.data.batch import Batch
from pipeline.errors import DataError
from pipeline.execution import Evaluation
from pipeline.machine import default_device
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState

PREVIOUS_FILE = "checkpoint.prev.pt"  # the checkpoint before the newest, in a local run


class EpochData(Protocol):
    """One rank's batches of one split (``job.ShardBatches`` wraps a ``BatchLoader``)."""

    def set_epoch(self, epoch: int) -> None: ...

    def __len__(self) -> int: ...

    def iter_from(self, start: int) -> Iterator[Batch]:
        """This epoch's batches, skipping the first ``start`` (resuming mid-epoch)."""
        ...


class ModelFactory(Protocol):
    def __call__(self) -> nn.Module: ...


class DataFactory(Protocol):
    def __call__(self, rank: int, world_size: int) -> tuple[EpochData, EpochData]:
        """(train, valid) batches for ``rank`` of ``world_size``, at the params' sizes."""
        ...

    def valid(self, rank: int, world_size: int, batch_size: int) -> EpochData:
        """The valid batches for ``rank`` at ``batch_size`` (global) examples a batch (the
        loop's evaluation at another size than the params': the largest that fits)."""
        ...


class MetricSink(Protocol):
    """Where rank 0's metrics go (``tracking.Tracker``; ``tracking.NullTracker`` where
    nothing is recorded)."""

    recording: bool

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


@runtime_checkable
class StepHook(Protocol):
    """Implemented by models whose training changes with progress (KL annealing, staged
    training): called before every training forward pass."""

    def on_train_step(self, step: int, epoch: int) -> None: ...


class WorkerContext(Protocol):
    """What the loop needs from where it runs."""

    rank: int
    world_size: int
    device: torch.device

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device (and wrap it for data parallelism)."""
        ...

    def all_reduce(self, values: Tensor) -> Tensor:
        """Sum of ``values`` over ranks (returned, every rank gets it)."""
        ...

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (every rank gets the list)."""
        ...

    def latest_checkpoint(self) -> TrainingState | None:
        """The newest intact checkpoint of this run (an older one when the newest does
        not read), or None for a fresh run."""
        ...

    def report(self, metrics: dict[str, float], checkpoint: TrainingState | None) -> None:
        """Publish metrics; persist ``checkpoint`` (rank 0's; other ranks pass ``None``)."""
        ...


class ValidationScore(Protocol):
    """A score of the model's outputs on the validation split (higher is better) that a
    run may select its weights on instead of the loss, reported under the key its
    ``select_by`` reads (``Selection.metric``; ``eval.validation_score``)."""

    def decode(
        self, model: nn.Module, rank: int, world_size: int, evaluation: Evaluation
    ) -> list[Any]:
        """This rank's share of the outputs (the loop gathers every rank's), decoded on
        ``evaluation``'s policy (device, autocast) at its batch sizes (the same on every
        rank)."""
        ...

    def score(self, outputs: list[Any]) -> dict[str, float]:
        """The score and its parts from every rank's outputs."""
        ...


def first_intact(
    candidates: Sequence[Callable[[], TrainingState]], where: str, restart: str
) -> tuple[TrainingState, int]:
    """The first of ``candidates`` (newest first) that reads, and its index; a warning for
    each that does not; a ``DataError`` naming ``where`` and the ``restart`` command when
    none does."""
    errors = []
    for index, read in enumerate(candidates):
        try:
            state = read()
        except DataError as err:
            errors.append(err)
            warnings.warn(f"passing over a checkpoint that does not read: {err}", stacklevel=2)
            continue
        return state, index
    reasons = "; ".join(str(e) for e in errors)
    raise DataError(
        where, f"no intact checkpoint to resume from ({reasons}); start the run over: {restart}"
    )


class LocalContext:
    """In-process, single worker; checkpoints in ``<run_dir>/checkpoint.pt`` and, the one
    before, ``<run_dir>/checkpoint.prev.pt``."""

    rank = 0
    world_size = 1

    def __init__(
        self, run_dir: str | Path, device: torch.device | None = None, restart: str = ""
    ) -> None:
        self.run_dir = Path(run_dir)
        self.device = device or default_device()
        self.restart = restart or f"rm -r {self.run_dir} and run the stage again"
        self._newest_intact = True  # False once the newest checkpoint was passed over

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT_FILE

    @property
    def previous_path(self) -> Path:
        return self.run_dir / PREVIOUS_FILE

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def all_reduce(self, values: Tensor) -> Tensor:
        return values

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def latest_checkpoint(self) -> TrainingState | None:
        paths = [p for p in (self.checkpoint_path, self.previous_path) if p.is_file()]
        if not paths:
            return None
        readers = [lambda p=p: TrainingState.read(p) for p in paths]
        state, index = first_intact(readers, str(self.run_dir), self.restart)
        self._newest_intact = paths[index] == self.checkpoint_path
        return state

    def report(self, metrics: dict[str, float], checkpoint: TrainingState | None) -> None:
        if checkpoint is None:
            return
        # the newest becomes the one before, unless it was torn: then the intact one before
        # it stays, and the newest is overwritten
        if self.checkpoint_path.is_file() and self._newest_intact:
            os.replace(self.checkpoint_path, self.previous_path)
        checkpoint.write(self.checkpoint_path)
        self._newest_intact = True
