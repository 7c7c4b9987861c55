"""What the training loop needs from where it runs, and where the data and model come from.

The loop (``loop.py``) sees its environment through a :class:`WorkerContext` (rank,
device, collectives, checkpoint hand-off): :class:`LocalContext` here runs in-process;
``distributed.RayContext`` and ``search.TuneContext`` run under Ray Train / Ray Tune.

Checkpoints are kept two deep (the newest and the one before), here and under Ray Train
(``CheckpointConfig(num_to_keep=2)``): a newest checkpoint that does not read (a disk
filled up, a copy cut short) is passed over for the one before, with a warning, and a run
with no intact checkpoint stops with the command that starts it over. An in-process run
keeps them in its ``run_folder.RunFolder``: on this machine's disk, or under a storage URI
(``s3://``, ``gs://``) through pyarrow, as Ray Train keeps its runs'.
"""

from __future__ import annotations

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
from pipeline.signals import StopRequest
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.run_folder import DiskFolder, run_folder

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
        """``model`` (on the device already: the policy placed it) as the loop runs it,
        wrapped for data parallelism where there is more than one rank."""
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

    def stop_requested(self) -> int | None:
        """The signal that asked this run to stop (the loop checkpoints the step it reached
        and raises), or None."""
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
    before, ``<run_dir>/checkpoint.prev.pt``, ``run_dir`` a local folder or a storage URI
    (``run_folder``)."""

    rank = 0
    world_size = 1

    def __init__(
        self, run_dir: str | Path, device: torch.device | None = None, restart: str = ""
    ) -> None:
        self.folder = run_folder(run_dir)
        self.device = device or default_device()
        remove = "rm -r" if isinstance(self.folder, DiskFolder) else "delete"
        self.restart = restart or f"{remove} {self.folder.where} and run the stage again"
        self._newest_intact = True  # False once the newest checkpoint was passed over
        self.stop = StopRequest()  # a signal, recorded while ``train_local`` defers it

    @property
    def checkpoint_path(self) -> str:
        """The newest checkpoint's path or URI."""
        return self.folder.location(CHECKPOINT_FILE)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def all_reduce(self, values: Tensor) -> Tensor:
        return values

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def latest_checkpoint(self) -> TrainingState | None:
        names = [n for n in (CHECKPOINT_FILE, PREVIOUS_FILE) if self.folder.has(n)]
        if not names:
            return None
        readers = [lambda n=n: self.folder.read(n) for n in names]
        state, index = first_intact(readers, self.folder.where, self.restart)
        self._newest_intact = names[index] == CHECKPOINT_FILE
        return state

    def report(self, metrics: dict[str, float], checkpoint: TrainingState | None) -> None:
        if checkpoint is None:
            return
        # the newest becomes the one before, unless it was torn: then the intact one before
        # it stays, and the newest is overwritten
        if self._newest_intact and self.folder.has(CHECKPOINT_FILE):
            self.folder.replace(CHECKPOINT_FILE, PREVIOUS_FILE)
        self.folder.write(CHECKPOINT_FILE, checkpoint)
        self._newest_intact = True

    def stop_requested(self) -> int | None:
        return self.stop.signum
