"""Cluster smoke test: a 2-worker Ray Train DDP job with one worker per node.

    python infra/smoke_ddp.py [--workers 2] [--storage /shared/path]

Each worker takes one DDP step of a tiny model on gloo (nccl when GPUs are used) and reports
its node; the job prints one line, ``SMOKE {json}``: the nodes used and whether the
all-reduced gradients agreed.
Run it against any cluster (RAY_ADDRESS) before a long training run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import ray
import torch
from ray import train
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--storage", default=None, help="shared storage path (multi-node)")
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    storage = args.storage or tempfile.mkdtemp(prefix="hiertx-smoke-")
    trainer = TorchTrainer(
        worker_loop,
        scaling_config=ScalingConfig(
            num_workers=args.workers, use_gpu=args.gpu, placement_strategy="STRICT_SPREAD"
        ),
        run_config=RunConfig(name="hiertx-smoke", storage_path=storage),
    )
    result = trainer.fit()
    print("SMOKE " + json.dumps(result.metrics), flush=True)


if __name__ == "__main__":
    main()
