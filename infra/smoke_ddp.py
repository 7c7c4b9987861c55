"""Cluster smoke test: a 2-worker Ray Train DDP job with one worker per node.

    python infra/smoke_ddp.py [--workers 2] [--gpu] [--storage s3://bucket/path]

Each worker takes one DDP step of a tiny model on gloo (nccl when GPUs are used) and reports
its node; the job prints one line, ``SMOKE {json}``: the nodes used and whether the
all-reduced gradients agreed.
Run it against any cluster (RAY_ADDRESS) before a long training run. Storage: ``--storage``,
else ``$HIERTX_STORAGE_PATH``, else a temporary folder here; Ray Train refuses a folder the
other nodes do not see once a worker there uploads a checkpoint, so a folder is probed first
(``pipeline.cluster.unshared``) and the script stops, saying what to pass, when it is not
shared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import ray
import torch
from ray import train
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model

from pipeline.cluster import STORAGE_ENV, ray_cluster, unshared


def worker_loop(config: dict) -> None:
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 1))
    rank = train.get_context().get_world_rank()
    world = train.get_context().get_world_size()
    x = torch.full((8, 4), float(rank + 1))
    model(x).sum().backward()
    grad = next(model.parameters()).grad.detach().flatten().tolist()
    gathered: list = [None] * world
    torch.distributed.all_gather_object(
        gathered, {"node": ray.get_runtime_context().get_node_id(), "grad": grad}
    )
    metrics = {
        "nodes": sorted({g["node"] for g in gathered}),
        "grads_agree": all(g["grad"] == gathered[0]["grad"] for g in gathered),
        "world_size": world,
    }
    # Ray Train V2 keeps the metrics reported with a checkpoint: rank 0 attaches a tiny one.
    with tempfile.TemporaryDirectory() as folder:
        if rank == 0:
            (Path(folder) / "metrics.json").write_text(json.dumps(metrics))
        checkpoint = Checkpoint.from_directory(folder) if rank == 0 else None
        train.report(metrics, checkpoint=checkpoint)


def shared_storage(storage: str | None) -> str:
    """The run's storage: a URI as given, or a folder every node of the cluster sees (Ray
    must be initialised); exits with what to pass when the other nodes do not see it."""
    storage = storage or os.environ.get(STORAGE_ENV)
    if storage and "://" in storage:
        return storage
    folder = Path(storage or tempfile.mkdtemp(prefix="hiertx-smoke-")).resolve()
    if blind := unshared(folder):
        sys.exit(
            f"smoke_ddp.py: the Ray nodes on {', '.join(blind)} do not see {folder}, where "
            "the run would keep its checkpoint: pass --storage s3://BUCKET/smoke (or gs://, "
            f"or a folder on a filesystem every node mounts), or set {STORAGE_ENV}"
        )
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--storage", default=None, help=f"shared storage (default ${STORAGE_ENV}, multi-node)"
    )
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    with ray_cluster():
        smoke(args.workers, args.gpu, shared_storage(args.storage))


def smoke(workers: int, gpu: bool, storage: str) -> None:
    """The two-step DDP job on ``workers`` workers, one per node; prints its SMOKE line."""
    trainer = TorchTrainer(
        worker_loop,
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=gpu, placement_strategy="STRICT_SPREAD"
        ),
        run_config=RunConfig(name="hiertx-smoke", storage_path=storage),
    )
    result = trainer.fit()
    print("SMOKE " + json.dumps(result.metrics), flush=True)


if __name__ == "__main__":
    main()
