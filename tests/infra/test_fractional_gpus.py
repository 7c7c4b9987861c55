"""Several trainings on one GPU with Ray: ``train.placement.gpus_per_worker: 1/N`` packs N
trainings onto one GPU, and the (N+1)-th waits for one of them.

What it runs: a real Ray cluster on this machine (``ray.init`` of a private instance,
raylet and GCS, with one *logical* GPU: ``num_gpus=1``, as ``ray start --num-gpus 1``
declares one) and N + 1 Ray Train runs at once, each with exactly the ``ScalingConfig``
the project's ``distributed.trainer`` builds for a run placed with ``gpus_per_worker
1/N`` (asserted: one worker of ``{"CPU": 1, "GPU": 1/N}``, PACK). Each run's worker
notes when it started, the GPU Ray gave it and its ``CUDA_VISIBLE_DEVICES``, holds its
slot for ``HOLD_S`` seconds and notes when it ended.

What it shows: Ray schedules N such workers at the same time on the one GPU (the most
intervals open at once is N), all of them handed GPU 0; the (N+1)-th starts only after
one of the first N has ended, so it is the GPU share, not the CPUs (twice as many as
needed), that decides how many run together.

What it does not show: no CUDA is used (this machine has no GPU; the workers' function
sleeps instead of running the training loop, whose device and NCCL process group need
one), so it says nothing about whether N trainings fit the GPU's memory or how fast they
run together: ``python -m bench.gpu_check`` measures that on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
N = 3  # trainings that share the one GPU
HOLD_S = 40.0  # long enough that the first N overlap whatever their start-up times

SCRIPT = """
import json, os, sys, threading, time
from pathlib import Path

import ray
from ray.train import RunConfig
from ray.train.torch import TorchConfig, TorchTrainer

from pipeline.config import PlacementParams
from pipeline.train.distributed import trainer
from tests.train.test_loop import make_job

n, hold, out = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "900"  # the (n+1)-th queues
# address="local": a new private instance, even where another cluster left its address
ray.init(address="local", num_cpus=2 * (n + 1), num_gpus=1, include_dashboard=False)
placement = PlacementParams(use_gpu=True, gpus_per_worker=1 / n)


def hold_slot(config):
    start = time.time()
    seen = {"gpus": [str(g) for g in ray.get_gpu_ids()],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    time.sleep(config["hold"])
    Path(config["path"]).write_text(json.dumps({**seen, "start": start, "end": time.time()}))


jobs = [make_job(out / f"job{i}", name=f"run{i}") for i in range(n + 1)]
configs = [trainer(job, 1, placement, str(out / "ray")).scaling_config for job in jobs]
print("SCALING " + json.dumps([{"workers": c.num_workers, "gpu": c.use_gpu,
      "resources": c.resources_per_worker, "strategy": c.placement_strategy} for c in configs]))


def fit(i):
    TorchTrainer(
        hold_slot,
        train_loop_config={"hold": hold, "path": str(out / f"held-{i}.json")},
        scaling_config=configs[i],
        torch_config=TorchConfig(backend="gloo"),  # no NCCL without a GPU
        run_config=RunConfig(name=f"run{i}", storage_path=str(out / "ray")),
    ).fit()


threads = [threading.Thread(target=fit, args=(i,)) for i in range(n + 1)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ray.shutdown()
"""


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    running = peak = 0
    for _, change in events:  # an end before a start at the same instant
        running += change
        peak = max(peak, running)
    return peak


@pytest.mark.slow
def test_gpus_per_worker_packs_n_trainings_onto_one_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # fmt: skip
    env.pop("RAY_ADDRESS", None)  # a private cluster, whatever runs elsewhere
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(N), str(HOLD_S), str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=REPO, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("SCALING "))
    asked = json.loads(line.removeprefix("SCALING "))
    assert len(asked) == N + 1
    for config in asked:
        assert config == {"workers": 1, "gpu": True, "strategy": "PACK",
                          "resources": {"CPU": 1.0, "GPU": 1 / N}}  # fmt: skip
    held = [json.loads((tmp_path / f"held-{i}.json").read_text()) for i in range(N + 1)]
    assert all(h["gpus"] == ["0"] and h["visible"] == "0" for h in held), held
    intervals = sorted((h["start"], h["end"]) for h in held)
    assert most_at_once(intervals) == N, intervals
    last = intervals[-1]
    assert last[0] >= min(end for _, end in intervals[:-1]), "the extra one waited for a slot"
