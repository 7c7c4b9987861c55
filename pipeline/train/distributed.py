"""Ray Train: the loop of ``loop.py`` on N workers (DDP: gloo on CPU, nccl on GPU).

``fit(job, scale)`` runs a :class:`~pipeline.train.loop.TrainJob` in-process
(``num_workers: 0``, no Ray at all) or as a ``TorchTrainer`` whose run is named after the
job (``<stage>-<model>-<corpus>-<params hash>``) under an absolute ``storage_path``: calling
``fit`` again with the same name resumes from the latest reported checkpoint, and
``FailureConfig(max_failures)`` restarts a failed worker group from it.

Cluster: with ``$RAY_ADDRESS`` set, the driver joins that cluster. Otherwise it starts a
private single-node cluster on 127.0.0.1 with a GCS port it picks, and exports that address
to every Ray process it starts: Ray's own helpers (Train's placement-group cleaner, Tune's
trial clean-up) otherwise auto-detect "the" cluster and fail when another one runs on the
same machine.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.config import ScaleParams
from pipeline.train.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from pipeline.train.loop import TrainJob, summary, train_local, train_worker

STORAGE_ENV = "HIERTX_STORAGE_PATH"
DEFAULT_STORAGE = Path("runs") / "ray"


def storage_path(scale: ScaleParams, root: str | Path) -> str:
    """Where runs and checkpoints live: params, ``$HIERTX_STORAGE_PATH``, or
    ``<root>/runs/ray``; local paths are made absolute (Ray workers run elsewhere)."""
    path = scale.storage_path or os.environ.get(STORAGE_ENV) or str(Path(root) / DEFAULT_STORAGE)
    if "://" in path:
        return path
    return str(Path(path).expanduser().resolve())


def use_gpu(scale: ScaleParams) -> bool:
    return torch.cuda.is_available() if scale.use_gpu is None else scale.use_gpu


# --------------------------------------------------------------------------- cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def ray_cluster(num_cpus: int | None = None) -> Iterator[None]:
    """Connect to ``$RAY_ADDRESS``, or start a private loopback cluster for the block.

    Reuses an already initialised Ray. Token authentication: Ray turns it on for a
    cluster it starts (creating ``~/.ray/auth_token``); to join a cluster started with it,
    export ``RAY_AUTH_MODE=token`` (and the token) before running.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        try:
            yield
        finally:
            ray.shutdown()
        return

    from ray._private import ray_constants

    port = _free_port()
    env = {
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "RAY_GCS_SERVER_PORT": str(port),
        # read by every Ray process: bind to 127.0.0.1 only
        ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR: "0",
    }
    saved_env = {k: os.environ.get(k) for k in env}
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(env)
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported Ray before the env var
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=True,  # Tune/Train clean-up uses the state API it serves
            dashboard_host="127.0.0.1",
            dashboard_port=_free_port(),
            log_to_driver=True,
        )
        yield
    finally:
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --------------------------------------------------------------------------- workers


class RayContext:
    """The loop's view of a Ray Train worker."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.device = ray.train.torch.get_device()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        import ray.train.torch

        return ray.train.torch.prepare_model(model)

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

    def latest_checkpoint(self) -> dict[str, Any] | None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as folder:
            return load_checkpoint(Path(folder) / CHECKPOINT_FILE)

    def report(self, metrics: dict[str, float], checkpoint: dict[str, Any] | None) -> None:
        import ray.train

        report_with_checkpoint(ray.train.report, ray.train.Checkpoint, metrics, checkpoint)


def report_with_checkpoint(
    report: Any, checkpoint_cls: Any, metrics: dict[str, float], state: dict[str, Any] | None
) -> None:
    """``report(metrics, checkpoint=...)`` with ``state`` written to a temporary folder
    (Ray copies it into the run's storage before returning)."""
    if state is None:
        report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(state, Path(folder) / CHECKPOINT_FILE)
        report(metrics, checkpoint=checkpoint_cls.from_directory(folder))


def _worker_main(config: dict[str, Any]) -> None:
    train_worker(config["job"], RayContext())


# --------------------------------------------------------------------------- fit


@dataclass(frozen=True)
class FitResult:
    """The final checkpoint of a run (local path or storage URI) and its metrics."""

    checkpoint: str
    metrics: dict[str, float]

    def load(self) -> dict[str, Any]:
        return load_checkpoint_uri(self.checkpoint)


def load_checkpoint_uri(uri: str) -> dict[str, Any]:
    """A checkpoint file from a local path or a Ray storage URI (``s3://.../checkpoint.pt``)."""
    if "://" not in uri:
        return load_checkpoint(uri)
    from ray.train import Checkpoint

    folder, _, name = uri.rpartition("/")
    with Checkpoint(folder).as_directory() as local:
        return load_checkpoint(Path(local) / name)


def trainer(job: TrainJob, scale: ScaleParams, storage: str, callbacks: list | None = None) -> Any:
    """The ``TorchTrainer`` of ``job`` (not started)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    gpu = use_gpu(scale)
    resources = {"CPU": scale.cpus_per_worker, **({"GPU": scale.gpus_per_worker} if gpu else {})}
    return TorchTrainer(
        _worker_main,
        train_loop_config={"job": job},
        scaling_config=ScalingConfig(
            num_workers=scale.num_workers,
            use_gpu=gpu,
            resources_per_worker=resources,
            placement_strategy=scale.placement_strategy.value,
        ),
        run_config=RunConfig(
            name=job.name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=scale.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=callbacks,
        ),
    )


def has_checkpoint(name: str, scale: ScaleParams, storage: str) -> bool:
    """Whether :func:`fit` of the job ``name`` will resume from a checkpoint (and so
    continue an earlier run's history) rather than start from step 0."""
    if scale.num_workers == 0:
        return (Path(storage) / name / CHECKPOINT_FILE).is_file()
    import pyarrow.fs

    fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    run = f"{root.rstrip('/')}/{name}"
    if fs.get_file_info(run).type != pyarrow.fs.FileType.Directory:
        return False
    # Ray Train names the folders of reported checkpoints checkpoint_<time>
    folders = [
        entry.path
        for entry in fs.get_file_info(pyarrow.fs.FileSelector(run))
        if entry.base_name.startswith("checkpoint_") and entry.type == pyarrow.fs.FileType.Directory
    ]
    return any(fs.get_file_info(f"{folder}/{CHECKPOINT_FILE}").is_file for folder in folders)


def fit(job: TrainJob, scale: ScaleParams, storage: str) -> FitResult:
    """Train ``job`` to the end (resuming if its run already has a checkpoint)."""
    if scale.num_workers == 0:
        train_local(job)
        path = Path(job.run_dir) / job.name / CHECKPOINT_FILE
        return FitResult(str(path), summary(load_checkpoint(path)))
    with ray_cluster():
        result = trainer(job, scale, storage).fit()
    if result.error is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError(f"Ray run {job.name} finished without a checkpoint")
    uri = f"{result.checkpoint.path.rstrip('/')}/{CHECKPOINT_FILE}"
    if result.checkpoint.filesystem.type_name != "local":
        uri = f"{result.checkpoint.filesystem.type_name}://{uri}"
    return FitResult(uri, summary(load_checkpoint_uri(uri)))
