"""Ray Train: the loop of ``loop.py`` on N workers (DDP: gloo on CPU, nccl on GPU).

``fit(job, workers, placement, storage)`` runs a :class:`~pipeline.train.loop.TrainJob`
in-process (``workers == 0``, no Ray at all; its checkpoints in a ``run_folder``, a local
folder or under the storage URI) or as a ``TorchTrainer`` whose run is named
after the job (its plan's identity) under an absolute ``storage``: calling ``fit`` again
with the same name resumes from the latest intact checkpoint, and
``FailureConfig(max_failures)`` restarts a failed worker group (a node lost) from it. The
cluster is the one ``pipeline.cluster.ray_cluster`` joins.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.cluster import open_storage, ray_cluster, use_gpu
from pipeline.config import PlacementParams
from pipeline.errors import HiertxError
from pipeline.machine import cpu_threads
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState, summary
from pipeline.train.context import LocalContext, first_intact
from pipeline.train.loop import TrainJob, train_local, train_worker
from pipeline.train.run_folder import run_path

CHECKPOINTS_KEPT = 2  # the newest and the one before: a torn newest falls back to it


class RayContext:
    """The loop's view of a Ray Train worker."""

    def __init__(self, restart: str) -> None:
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.restart = restart

    def wrap_model(self, model: nn.Module) -> nn.Module:
        import ray.train.torch

        # the policy placed the model already: Ray wraps it in DDP (more than one rank)
        return ray.train.torch.prepare_model(model, move_to_device=False)

    def stop_requested(self) -> int | None:
        return None  # Ray stops its workers, and restarts them from Ray's checkpoints

    def all_reduce(self, values: Tensor) -> Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(values)
        return values

    def gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, value)
        return out

    def latest_checkpoint(self) -> TrainingState | None:
        import ray.train

        latest = ray.train.get_checkpoint()
        if latest is None:
            return None
        readers = [lambda c=c: read_checkpoint(c) for c in [latest, *older_checkpoints(latest)]]
        return first_intact(readers, latest.path, self.restart)[0]

    def report(self, metrics: dict[str, float], checkpoint: TrainingState | None) -> None:
        import ray.train

        report_with_checkpoint(ray.train.report, ray.train.Checkpoint, metrics, checkpoint)


def read_checkpoint(checkpoint: Any) -> TrainingState:
    """The training state in a Ray ``Checkpoint`` (a folder, local or remote)."""
    with checkpoint.as_directory() as folder:
        return TrainingState.read(Path(folder) / CHECKPOINT_FILE)


def checkpoint_folders(fs: Any, run: str) -> list[str]:
    """The checkpoint folders of the Ray run folder ``run`` on filesystem ``fs`` (Ray Train
    names them ``checkpoint_<time>``), newest first."""
    import pyarrow.fs

    if fs.get_file_info(run).type != pyarrow.fs.FileType.Directory:
        return []
    entries = fs.get_file_info(pyarrow.fs.FileSelector(run))
    return sorted(
        (
            e.path
            for e in entries
            if e.base_name.startswith("checkpoint_") and e.type == pyarrow.fs.FileType.Directory
        ),
        reverse=True,
    )


def older_checkpoints(latest: Any) -> list[Any]:
    """The run's other checkpoints, newest first: what a torn newest one falls back to."""
    from ray.train import Checkpoint

    newest = latest.path.rstrip("/")
    run = newest.rsplit("/", 1)[0]
    return [
        Checkpoint(path, filesystem=latest.filesystem)
        for path in checkpoint_folders(latest.filesystem, run)
        if path != newest
    ]


def report_with_checkpoint(
    report: Any, checkpoint_cls: Any, metrics: dict[str, float], state: TrainingState | None
) -> None:
    """``report(metrics, checkpoint=...)`` with ``state`` written to a temporary folder
    (Ray copies it into the run's storage before returning)."""
    if state is None:
        report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as folder:
        state.write(Path(folder) / CHECKPOINT_FILE)
        report(metrics, checkpoint=checkpoint_cls.from_directory(folder))


def _worker_main(config: dict[str, Any]) -> None:
    job: TrainJob = config["job"]
    with cpu_threads(config["cpus"]):
        train_worker(job, RayContext(job.restart))


@dataclass(frozen=True)
class FitResult:
    """The final checkpoint of a run (local path or storage URI) and its metrics."""

    checkpoint: str
    metrics: dict[str, float]
    state: TrainingState


def trainer(
    job: TrainJob,
    workers: int,
    placement: PlacementParams,
    storage: str,
    callbacks: list | None = None,
) -> Any:
    """The ``TorchTrainer`` of ``job`` on ``workers`` workers placed as ``placement`` says
    (not started)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    gpu = use_gpu(placement)
    resources = {"CPU": placement.cpus_per_worker}
    if gpu:
        resources["GPU"] = placement.gpus_per_worker
    return TorchTrainer(
        _worker_main,
        train_loop_config={"job": job, "cpus": placement.cpus_per_worker},
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=gpu,
            resources_per_worker=resources,
            placement_strategy=placement.strategy.value,
        ),
        run_config=RunConfig(
            name=job.name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=placement.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=CHECKPOINTS_KEPT),
            callbacks=callbacks,
        ),
    )


def resume_step(name: str, workers: int, storage: str, restart: str = "") -> int | None:
    """The step :func:`fit` of the job ``name`` will resume from (the newest intact
    checkpoint's), or None when it starts from step 0; with no intact checkpoint, a
    ``DataError`` says ``restart``, the command that starts the run over."""
    if workers == 0:
        state = LocalContext(run_path(storage, name), restart=restart).latest_checkpoint()
        return None if state is None else state.position.step
    from ray.train import Checkpoint

    fs, root = open_storage(storage)
    folders = checkpoint_folders(fs, f"{root.rstrip('/')}/{name}")
    if not folders:
        return None
    readers = [lambda f=f: read_checkpoint(Checkpoint(f, filesystem=fs)) for f in folders]
    state, _ = first_intact(readers, f"{storage.rstrip('/')}/{name}", restart)
    return state.position.step


def fit(job: TrainJob, workers: int, placement: PlacementParams, storage: str) -> FitResult:
    """Train ``job`` to the end (resuming if its run already has a checkpoint)."""
    if workers == 0:
        train_local(job)
        context = LocalContext(run_path(storage, job.name), restart=job.restart)
        state = context.latest_checkpoint()
        assert state is not None, "a finished local run has a checkpoint"
        return FitResult(context.checkpoint_path, summary(state), state)
    with ray_cluster():
        try:
            result = trainer(job, workers, placement, storage).fit()
        except Exception as err:  # Ray wraps what a worker raised (WorkerGroupError)
            raise project_error(err) or err from None
    if result.error is not None:
        raise project_error(result.error) or result.error
    if result.checkpoint is None:
        raise RuntimeError(f"Ray run {job.name} finished without a checkpoint")
    state = read_checkpoint(result.checkpoint)
    uri = f"{result.checkpoint.path.rstrip('/')}/{CHECKPOINT_FILE}"
    if result.checkpoint.filesystem.type_name != "local":
        uri = f"{result.checkpoint.filesystem.type_name}://{uri}"
    return FitResult(uri, summary(state), state)


def project_error(error: BaseException) -> HiertxError | None:
    """The project's own error inside what Ray raised for a failed worker (a diverged
    run, a checkpoint that does not read), so the stage says it in one line."""
    seen: set[int] = set()
    todo: list[Any] = [error]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, HiertxError):
            return err
        todo += [err.__cause__, err.__context__, getattr(err, "cause", None)]
        todo += list(getattr(err, "worker_failures", {}).values())
        todo += list(getattr(err, "errors", None) or [])
    return None
