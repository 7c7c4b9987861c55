"""``make repro JOBS=N`` on one machine with 8 GPUs fills them: no two trainings on one GPU
while another idles, fractions packed without going over a GPU, ``CUDA_VISIBLE_DEVICES``
respected.

What it runs: the real ``python -m pipeline.repro --jobs 4`` on a toy DVC project whose
four stages run at once, on a machine that declares 8 *logical* GPUs through Ray's own
``RAY_OVERRIDE_RESOURCES`` (what ``ray start --num-gpus 8`` declares; Ray sets
``CUDA_VISIBLE_DEVICES`` per task without real GPUs). Two stages each start 3 trainings
of one whole GPU, one starts 3 of a quarter GPU, all through the project's
``cluster.ray_cluster()`` as a train stage does; the fourth computes in its own process
(``num_workers: 0``) under ``gpu_share.gpu_lease``. A training is a Ray task with the
GPU share one training worker asks for; each notes the ``CUDA_VISIBLE_DEVICES`` it was
given and waits until all ten have started (so all of them hold their GPU at once).

On b8b1803 every stage started its own Ray instance that owned all 8 GPUs: both whole-GPU
stages got GPUs 0, 1 and 2, the quarter-GPU trainings landed on GPU 0 on top of them, and
an in-process training used ``cuda:0``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
VISIBLE = [str(i) for i in range(8, 16)]  # the GPUs CUDA_VISIBLE_DEVICES leaves to the run
STAGES = {"a": ("ray", 3, 1.0), "b": ("ray", 3, 1.0), "c": ("ray", 3, 0.25), "d": ("lease", 1, 1.0)}
TOTAL = sum(n for _, n, _ in STAGES.values())

DVC_YAML = {
    "stages": {
        "gpus": {
            "foreach": {
                k: {"kind": kind, "n": n, "share": share} for k, (kind, n, share) in STAGES.items()
            },
            "do": {
                "cmd": "python stage.py ${item.kind} ${key} ${item.n} ${item.share}",
                "deps": ["stage.py"],
                "outs": ["out/${key}.json"],
            },
        },
        "report": {"cmd": "ls out > report.txt", "deps": ["out"], "outs": ["report.txt"]},
    }
}

STAGE_PY = """\
import json, os, sys, time
from pathlib import Path

kind, name, n, share = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
barrier, total = Path(os.environ["BARRIER"]), int(os.environ["TOTAL"])


def train(tag):
    # a training's view of its GPUs; it holds them until every training has started
    (barrier / tag).touch()
    deadline = time.time() + 600
    while len(list(barrier.iterdir())) < total and time.time() < deadline:
        time.sleep(0.2)
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "overlapped": len(list(barrier.iterdir())) >= total}


if kind == "ray":  # trainings on Ray workers, as a train stage with num_workers > 0
    import ray
    from pipeline.cluster import ray_cluster
    with ray_cluster():
        task = ray.remote(train).options(num_cpus=0, num_gpus=share)
        trainings = ray.get([task.remote(f"{name}{i}") for i in range(n)])
else:  # a training in the stage's process, as with num_workers: 0
    from pipeline.config import PlacementParams
    from pipeline.gpu_share import gpu_lease
    with gpu_lease(PlacementParams(gpus_per_worker=share)):
        trainings = [train(f"{name}0")]
os.makedirs("out", exist_ok=True)
Path(f"out/{name}.json").write_text(json.dumps({"share": share, "trainings": trainings}))
"""


def toy_project(root: Path) -> Path:
    """A git + DVC project whose four ``gpus@*`` stages are independent."""
    root.mkdir()
    (root / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (root / "stage.py").write_text(STAGE_PY)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([BIN / "dvc", "init", "-q"], cwd=root, check=True)
    subprocess.run(
        [BIN / "dvc", "config", "--local", "core.site_cache_dir", str(root / ".site-cache")],
        cwd=root,
        check=True,
    )
    return root


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_jobs_4_on_8_gpus_gives_every_training_its_own_gpu_share(tmp_path: Path) -> None:
    project = toy_project(tmp_path / "p")
    (tmp_path / "barrier").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # a Ray temp dir of its own (short: Ray's socket paths): no other instance to join
    ray_tmp = tempfile.mkdtemp(prefix="hx", dir="/tmp")
    env |= {
        "PATH": f"{BIN}{os.pathsep}{env['PATH']}",
        "PYTHONPATH": str(REPO),
        "DVC_NO_ANALYTICS": "1",
        "OMP_NUM_THREADS": "1",
        "RAY_TMPDIR": ray_tmp,
        "RAY_OVERRIDE_RESOURCES": json.dumps({"GPU": 8}),
        "CUDA_VISIBLE_DEVICES": ",".join(VISIBLE),
        "BARRIER": str(tmp_path / "barrier"),
        "TOTAL": str(TOTAL),
    }
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.repro", "--jobs", "4"],
        cwd=project, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "started one Ray instance for this run at 127.0.0.1:" in output
    assert output.count("joined the cluster at 127.0.0.1:") == 4, output[-6000:]
    held = {k: json.loads((project / "out" / f"{k}.json").read_text()) for k in STAGES}
    trainings = [(k, t, held[k]["share"]) for k in STAGES for t in held[k]["trainings"]]
    print("PLACEMENT", {k: [t["visible"] for t in held[k]["trainings"]] for k in STAGES})
    assert len(trainings) == TOTAL
    assert all(t["overlapped"] for _, t, _ in trainings), "all ten held their GPU at once"
    assert all(t["visible"] in VISIBLE for _, t, _ in trainings), trainings  # one id each
    load: dict[str, float] = defaultdict(float)
    for _, t, share in trainings:
        load[t["visible"]] += share
    assert max(load.values()) <= 1.0, dict(load)  # no GPU over-subscribed, fractions packed
    whole = [t["visible"] for _, t, share in trainings if share == 1.0]
    assert len(set(whole)) == len(whole) == 7, whole  # distinct while free ones exist
    assert f"computing in this process on GPU {held['d']['trainings'][0]['visible']}" in output
