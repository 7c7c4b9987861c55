"""Filling a Ray cluster: measured on a local multi-node cluster, projected for the papers.

``measure``: for each ``--jobs`` value, a fresh copy of the project at the tiny profile,
made heavier (every run trains ``--steps`` steps, 2 seeds, one Ray Train worker each), runs
``make repro JOBS=<jobs>`` on ``infra/local_cluster.sh --workers W --cpus 1 --head-cpus 0``
(W worker nodes of one CPU: W training slots; the head keeps the drivers). Afterwards,
still on the cluster, Ray's state API gives the slot-seconds every training worker (its
first to last task) and evaluation task held. Printed per ``--jobs``: the wall time, the span
from the first training's start to the last one's end, slot utilization (held
slot-seconds / (slots x span)), the share of held time the workers spent stepping (MLflow's
``train_loss`` timestamps: the rest is start-up, validation, checkpoints) and the wall time
against the first ``--jobs`` value's.

``project``: the paper profile (``profiles/paper.yaml``: 70 runs x 3 seeds and the HIER
search) on 1, 8 and 64 GPUs, *simulated* (``bench/schedule.py``: the order ``make repro
JOBS=N`` starts stages in, read from DVC's own stage graph, and Ray's first-asked,
first-placed GPUs). A training's GPU time is a cost model, not a measurement (no GPU was
lent to this project): 6 x parameters x tokens it trains on, at ``--tflops`` effective;
tokens = epochs x training examples (published split sizes, :data:`TRAIN_EXAMPLES`) x the
token caps of the profile's tokenize settings. Evaluation takes 0.18 of a seed's training
(the study's ratio, bench/RESULTS.md). The schedule, not the cost model, decides the ratio;
``--uniform`` replays it with every training equally long to show that.

    python -m bench.bench_cluster measure --jobs 1 2 --workers 2
    python -m bench.bench_cluster project --gpus 1 8 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import environment, table
from bench.schedule import Schedule, Stage, simulate
from pipeline.config import CorpusParams
from pipeline.names import Task
from pipeline.plan import RunRequest

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
TASKS_LIMIT = 1_000_000  # rows asked of Ray's state API (its default cap is 10,000)
EVAL_FRACTION = 0.18  # evaluation / training minutes of the study run (bench/RESULTS.md)
# Training examples per epoch (published statistics, rounded): Cornell 221,616 context-
# response pairs (304,713 utterances in 83,097 conversations) x 0.8; PersonaChat's train file
# 131,438 utterances less one per dialogue (8,939) x 0.9; MultiWOZ 2.0 8,438 training
# dialogues x 6.7 system turns; DSTC7 track 1 (Ubuntu) 100,000 training contexts; PTB 42,068
# training sentences in documents of 10.
TRAIN_EXAMPLES = {
    "cornell": 177_000,
    "personachat": 110_000,
    "multiwoz": 56_700,
    "dstc7": 100_000,
    "ptb": 4_207,
}
UNCAPPED = {"history": 400, "sentence": 25}  # typical lengths where the profile sets no cap


# ----------------------------------------------------------------------------- measure


def _copy_project(root: Path, steps: int) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in files:
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    params = yaml.safe_load((REPO / "profiles" / "tiny.yaml").read_text())
    train = params["train"]
    train["defaults"] |= {"seeds": 2, "epochs": 1000, "max_steps": steps, "eval_every": 50}
    train["defaults"] |= {"max_batches_per_epoch": None, "checkpoint_every": 50}
    train["scale"]["num_workers"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "dvc.lock").unlink(missing_ok=True)
    for folder in ("metrics", "plots"):
        shutil.rmtree(root / folder, ignore_errors=True)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "bench"]):
        git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com", *args]
        subprocess.run(git, cwd=root, check=True, capture_output=True)


def measure_once(jobs: int, workers: int, steps: int, scratch: Path) -> dict[str, float]:
    """One ``make repro JOBS=jobs`` on a fresh local cluster; its timings."""
    root = scratch / f"jobs-{jobs}" / "p"
    root.mkdir(parents=True)
    _copy_project(root, steps)
    out = root.parent / "timings.json"
    env = {
        **os.environ,
        "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "MLFLOW_TRACKING_URI": f"sqlite:///{root.parent / 'mlflow.db'}",
        "OMP_NUM_THREADS": "1",
        "DVC_NO_ANALYTICS": "1",
        # the state API answers at most 10,000 rows unless the cluster is told otherwise;
        # every health poll of every training worker is a task
        "RAY_MAX_LIMIT_FROM_API_SERVER": str(TASKS_LIMIT),
    }
    cluster = ["infra/local_cluster.sh", "--workers", str(workers), "--cpus", "1"]
    inside = [sys.executable, "-m", "bench.bench_cluster", "inside", "--jobs", str(jobs)]
    command = [*cluster, "--head-cpus", "0", "--", *inside, "--out", str(out)]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"JOBS={jobs} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    timings = json.loads(out.read_text())
    timings["stepping"] = _stepping_seconds(env["MLFLOW_TRACKING_URI"])
    return timings


def _stepping_seconds(tracking_uri: str) -> float:
    """Seconds between each MLflow run's first and last ``curves/train_loss`` (the training
    loop's), summed."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    total = 0.0
    for found in client.search_runs(ids, max_results=1000):
        history = client.get_metric_history(found.info.run_id, "curves/train_loss")
        stamps = [m.timestamp for m in history]
        if stamps:
            total += (max(stamps) - min(stamps)) / 1000
    return total


def inside(jobs: int, out: Path) -> None:
    """Run on the cluster (``RAY_ADDRESS`` set): ``make repro``, then read from Ray's state
    API when each training worker and evaluation task held its slot. A Ray Train worker is
    an actor, and Ray's state API gives actors no end time: an actor holds its slot from
    the start of its first task (its creation) to the end of its last (the controller
    polls every worker until the training ends)."""
    import ray
    from ray.util.state import list_tasks

    make = ["make", "-o", str(VENV / ".installed"), f"VENV={VENV}", "repro", f"JOBS={jobs}"]
    start = time.time()
    subprocess.run(make, check=True)
    wall = time.time() - start
    ray.init(address=os.environ["RAY_ADDRESS"])
    tasks = list_tasks(limit=TASKS_LIMIT, detail=True, raise_on_missing_output=False)
    by_actor: dict[str, list[float]] = {}
    held = []
    for t in tasks:
        if not (t.start_time_ms and t.end_time_ms):
            continue
        begin, end = t.start_time_ms / 1000, t.end_time_ms / 1000
        if t.func_or_class_name.startswith("RayTrainWorker.") and t.actor_id:
            span = by_actor.setdefault(t.actor_id, [begin, end])
            span[0], span[1] = min(span[0], begin), max(span[1], end)
        elif t.func_or_class_name == "_run_seed":  # an evaluation (eval.stage)
            held.append((begin, end))
    held += [(begin, end) for begin, end in by_actor.values()]
    if not by_actor:
        names = sorted({t.func_or_class_name for t in tasks})
        raise SystemExit(f"no Ray Train worker among the cluster's tasks: {names}")
    span = max(e for _, e in held) - min(s for s, _ in held)
    busy = sum(e - s for s, e in held)
    out.write_text(json.dumps({"wall": wall, "span": span, "busy": busy, "held": len(held)}))


def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as scratch:
        results = {j: measure_once(j, args.workers, args.steps, Path(scratch)) for j in args.jobs}
    base = results[args.jobs[0]]["wall"]
    rows = []
    for jobs, r in results.items():
        rows.append([
            f"JOBS={jobs}", f"{r['wall']:.0f}", f"{r['span']:.0f}", int(r["held"]),
            f"{r['busy'] / (args.workers * r['span']):.0%}",
            f"{r['stepping'] / r['busy']:.0%}", f"{base / r['wall']:.2f}x",
        ])  # fmt: skip
    print(environment().markdown())
    print(f"- cluster: head (0 CPUs) + {args.workers} worker nodes x 1 CPU = {args.workers} slots")
    headers = ["run", "wall s", "span s", "slot intervals", "slot utilization", "stepping"]
    headers.append("speed-up")
    print(table(headers, rows))


# ----------------------------------------------------------------------------- project


def _tokens_per_example(corpus: CorpusParams, task: Task) -> int:
    """The token caps of one training example (typical lengths where there is no cap)."""
    g, s, lm = corpus.generate, corpus.select, corpus.lm
    history = g.max_history or UNCAPPED["history"]
    if task == Task.SELECT:
        return history + s.n_candidates_train * s.max_candidate
    if task == Task.LM:
        return lm.sentences_per_document * (lm.max_sentence or UNCAPPED["sentence"])
    return history + g.max_response


def _gpu_seconds(request: RunRequest, epochs: int, tflops: float) -> float:
    """The cost model of one seed's training (module docstring)."""
    import torch

    from pipeline.artifacts import DataSizes
    from pipeline.models import registry
    from pipeline.models.base import count_parameters

    vocab = request.corpus_params.vocab.size or 10_000  # PTB's whitespace vocabulary
    sizes = DataSizes(vocab_size=vocab + 8, n_acts=50)  # + specials; MultiWOZ's ~50 acts
    config = registry.make_config(request.model, sizes, **request.knobs.model)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        n_params = count_parameters(registry.build_from_config(request.model, config))
    per_example = _tokens_per_example(request.corpus_params, registry.spec(request.model).task)
    tokens = epochs * TRAIN_EXAMPLES[request.corpus] * per_example
    return 6 * n_params * tokens / (tflops * 1e12)


def paper_stages(params_path: Path, tflops: float, uniform: bool) -> list[Stage]:
    """The paper profile's stages in ``dvc.yaml`` order, with their GPU jobs."""
    from pipeline.plan import load_checked
    from pipeline.repro import load_plan

    params = load_checked(params_path)
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        for name in ("dvc.yaml", ".dvcignore"):
            shutil.copy2(REPO / name, name)
        shutil.copy2(params_path, "params.yaml")
        subprocess.run(["git", "init", "-q"], check=True)
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], check=True)
        plan = load_plan(final=[])
    stages = []
    for name in plan.order:
        kind, _, key = name.partition("@")
        jobs: tuple[float, ...] = ()
        concurrency = None
        if kind in ("train", "train_tuned", "evaluate", "tune"):
            request = RunRequest.of(params, key, search=kind == "tune")
            if kind == "tune":
                t = params.tune
                seconds = 1.0 if uniform else _gpu_seconds(request, t.epochs_per_trial, tflops)
                jobs, concurrency = (seconds,) * t.trials, t.concurrency
            else:
                epochs = request.knobs.epochs
                seconds = 1.0 if uniform else _gpu_seconds(request, epochs, tflops)
                scale = EVAL_FRACTION if kind == "evaluate" else 1.0
                jobs = (seconds * scale,) * request.knobs.seeds
        stages.append(Stage(name, frozenset(plan.upstream[name]), jobs, concurrency))
    return stages


def project(args: argparse.Namespace) -> None:
    stages = paper_stages(args.params, args.tflops, args.uniform)
    trainings = sum(len(s.jobs) for s in stages if not s.name.startswith("evaluate"))
    runs: dict[tuple[int, int], Schedule] = {}
    for gpus in args.gpus:
        for jobs in sorted({1, gpus}):  # one stage at a time (seeds side by side), and N
            runs[gpus, jobs] = simulate(stages, jobs=jobs, gpus=gpus)
    one = runs[min(args.gpus), 1].wall
    unit = "units" if args.uniform else "h"
    scale = 1.0 if args.uniform else 3600.0
    rows = [
        [gpus, f"JOBS={jobs}", f"{s.wall / scale:,.1f}", f"{s.utilization:.0%}",
         f"{one / s.wall:.2f}x", f"1/{one / s.wall:.1f}"]
        for (gpus, jobs), s in runs.items()
    ]  # fmt: skip
    print(f"- {len(stages)} stages, {trainings} trainings and search trials (simulated)")
    headers = ["GPUs", "make repro", f"wall {unit}", "GPU utilization", "speed-up", "of 1 GPU"]
    print(table(headers, rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="make repro on a local multi-node cluster")
    m.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    m.add_argument("--workers", type=int, default=2, help="worker nodes of 1 CPU (slots)")
    m.add_argument("--steps", type=int, default=300, help="training steps per seed")
    i = sub.add_parser("inside", help=argparse.SUPPRESS)
    i.add_argument("--jobs", type=int, required=True)
    i.add_argument("--out", type=Path, required=True)
    j = sub.add_parser("project", help="the paper profile on N GPUs, simulated")
    j.add_argument("--params", type=Path, default=REPO / "profiles" / "paper.yaml")
    j.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 64])
    j.add_argument(
        "--tflops", type=float, default=100.0, help="effective TFLOP/s per GPU (~10%% MFU)"
    )
    j.add_argument("--uniform", action="store_true", help="every training equally long")
    args = p.parse_args(argv)
    if args.command == "measure":
        measure(args)
    elif args.command == "inside":
        inside(args.jobs, args.out)
    else:
        project(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
