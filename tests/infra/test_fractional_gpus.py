"""Several trainings on one GPU with Ray: ``train.placement.gpus_per_worker: 1/N`` packs N
trainings onto one GPU, and the (N+1)-th waits for one of them.

What it runs: a real Ray cluster on this machine (``ray.init`` of a private instance,
raylet and GCS, with one *logical* GPU: ``num_gpus=1``, as ``ray start --num-gpus 1``
declares one) and N + 1 Ray Train runs at once, each with exactly the ``ScalingConfig``
the project's ``distributed.trainer`` builds for a run placed with ``gpus_per_worker
1/N`` (asserted: one worker of ``{"CPU": 1, "GPU": 1/N}``, PACK). Each run's worker
notes when it started, the GPU Ray gave it and its ``CUDA_VISIBLE_DEVICES`` (a file in a
shared folder: it holds its share), then holds its slot until the driver releases it
(another file), and notes when it ended. The driver waits for N holders and for Ray to
report the last run's placement group PENDING (waiting for resources), releases one
holder, waits for the last run to start, then releases all: a barrier, no fixed sleep.

What it shows: Ray schedules N such workers at the same time on the one GPU (the most
intervals open at once is N), all of them handed GPU 0; the (N+1)-th is pending while they
hold it and starts only after one of them has ended, so it is the GPU share, not the CPUs
(twice as many as needed), that decides how many run together.

What it does not show: no CUDA is used (this machine has no GPU; the workers' function
holds its slot instead of running the training loop, whose device and NCCL process group
need one), so it says nothing about whether N trainings fit the GPU's memory or how fast
they run together: ``python -m bench.gpu_check`` measures that on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.infra.test_cluster_repro import most_at_once

REPO = Path(__file__).resolve().parents[2]
N = 3  # trainings that share the one GPU
WAIT_S = 600  # the longest any side waits for the other before it fails

SCRIPT = """
import json, os, sys, threading, time
from pathlib import Path

import ray
from ray.train import RunConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util import placement_group_table

from pipeline.config import PlacementParams
from pipeline.train.distributed import trainer
from tests.train.test_loop import make_job

n, wait_s, out = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "900"  # the (n+1)-th queues
# address="local": a new private instance, even where another cluster left its address
ray.init(address="local", num_cpus=2 * (n + 1), num_gpus=1, include_dashboard=False)
placement = PlacementParams(use_gpu=True, gpus_per_worker=1 / n)


def write(path, text):
    Path(f"{path}.part").write_text(text)
    Path(f"{path}.part").rename(path)


def until(condition, what):
    deadline = time.monotonic() + wait_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {wait_s} s for {what}")
        time.sleep(0.05)


def hold_slot(config):
    folder, i = Path(config["folder"]), config["i"]
    start = time.time()
    seen = {"gpus": [str(g) for g in ray.get_gpu_ids()],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start}
    write(folder / f"holding-{i}.json", json.dumps(seen))
    until((folder / f"release-{i}").exists, f"the driver to release run{i}")
    write(folder / f"held-{i}.json", json.dumps({**seen, "end": time.time()}))


jobs = [make_job(out / f"job{i}", name=f"run{i}") for i in range(n + 1)]
configs = [trainer(job, 1, placement, str(out / "ray")).scaling_config for job in jobs]
print("SCALING " + json.dumps([{"workers": c.num_workers, "gpu": c.use_gpu,
      "resources": c.resources_per_worker, "strategy": c.placement_strategy} for c in configs]))


def fit(i):
    TorchTrainer(
        hold_slot,
        train_loop_config={"folder": str(out), "i": i},
        scaling_config=configs[i],
        torch_config=TorchConfig(backend="gloo"),  # no NCCL without a GPU
        run_config=RunConfig(name=f"run{i}", storage_path=str(out / "ray")),
    ).fit()


def holding():
    return sorted(int(p.name.split("-")[1].split(".")[0]) for p in out.glob("holding-*.json"))


def pending():
    return [g for g in placement_group_table().values() if g["state"] == "PENDING"]


threads = [threading.Thread(target=fit, args=(i,)) for i in range(n + 1)]
for t in threads:
    t.start()
try:
    until(lambda: len(holding()) >= n and pending(), f"{n} holders and a pending run")
    print("AT_ONCE " + json.dumps({"holding": holding(), "pending": len(pending())}))
    first = holding()[0]
    write(out / f"release-{first}", "")
    until(lambda: len(holding()) == n + 1, "the last run to start")
finally:  # let every run end, whatever happened
    for i in range(n + 1):
        (out / f"release-{i}").touch()
    for t in threads:
        t.join()
    ray.shutdown()
print("RELEASED_FIRST " + json.dumps(first))
"""


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_gpus_per_worker_packs_n_trainings_onto_one_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # fmt: skip
    env.pop("RAY_ADDRESS", None)  # a private cluster, whatever runs elsewhere
    # its own Ray temp dir (short: Ray's socket paths), not the machine's /tmp/ray, where a
    # killed cluster's address file would make ray.init wait for a dead GCS
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="hx", dir="/tmp")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(N), str(WAIT_S), str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=REPO, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    found = {}
    for line in done.stdout.splitlines():
        word, _, value = line.partition(" ")
        if word in ("SCALING", "AT_ONCE", "RELEASED_FIRST"):
            found[word] = json.loads(value)
    assert len(found["SCALING"]) == N + 1
    for config in found["SCALING"]:
        assert config == {"workers": 1, "gpu": True, "strategy": "PACK",
                          "resources": {"CPU": 1.0, "GPU": 1 / N}}  # fmt: skip
    # N held their share at once while Ray kept the last one's placement group waiting
    assert len(found["AT_ONCE"]["holding"]) == N and found["AT_ONCE"]["pending"] == 1, found
    held = {i: json.loads((tmp_path / f"held-{i}.json").read_text()) for i in range(N + 1)}
    assert all(h["gpus"] == ["0"] and h["visible"] == "0" for h in held.values()), held
    intervals = sorted((h["start"], h["end"]) for h in held.values())
    assert most_at_once(intervals) == N, intervals
    (last,) = set(held) - set(found["AT_ONCE"]["holding"])
    released = held[found["RELEASED_FIRST"]]
    assert held[last]["start"] >= released["end"], "the extra one waited for a slot"
