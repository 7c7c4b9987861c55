"""The train stage's logic: a run's plan -> every seed trained, exported and tracked.

``train_seeds`` trains each seed of run ``<key>`` (seed i with ``seed + 1000 i``: each its
own Ray run and MLflow run, resumable like any other), exports the kept weights to
``data/train/<key>/[seed-<i>/]model.pt`` and writes the run's
:class:`~pipeline.artifacts.TrainRecord`. ``train_plan`` trains one seed: it says first
whether it starts fresh or resumes (from which step, and why), trains (in-process or on
Ray Train), exports, and records the run in MLflow: params, metrics, the vocabulary, the
checkpoint, samples, and the registered pyfunc. A seed whose knobs a rule that needs the
step count refuses (``run_checks``) is refused before its MLflow run opens; a run that
diverges, or fails otherwise, ends its MLflow run FAILED and exports nothing; one a stop
signal ends (``signals``: it resumes from its checkpoint) ends it KILLED.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pipeline import machine
from pipeline.artifacts import MANIFEST_FILE, WALL_SECONDS, TrainedSeed, TrainRecord
from pipeline.cluster import ray_cluster
from pipeline.config import AveragingKind, Selection
from pipeline.data.loader import load_vocab
from pipeline.errors import ConfigError, DataError
from pipeline.gpu_share import gpu_lease
from pipeline.models.word_vectors import (
    DimensionError,
    WordVectors,
    read_word_vectors,
    token_embeddings,
)
from pipeline.plan import RunIdentity, RunPlan, RunRequest, plan_training
from pipeline.train.checkpoint import TrainingState
from pipeline.train.distributed import fit, resume_step
from pipeline.train.job import RegistryModel, shard_data, train_job
from pipeline.train.run_checks import planned_step_notes
from pipeline.train.tracked import check_reachable, start_tracker, track_final

IDENTITY_SUFFIX = ".identity.json"  # beside a run's checkpoint folder: what it computes


def train_seeds(
    request: RunRequest, root: str | Path = ".", show_progress: bool = True
) -> TrainRecord:
    """Train every seed of the run ``request`` names; writes and returns its record. On Ray
    (``train.scale.num_workers`` > 0) the seeds train at once, each its own Ray Train run
    that Ray places where its workers fit; in-process they train one after another."""
    first = plan_training(request, root)
    plans = [first.for_seed(i) for i in range(len(first.seeds))]
    if first.workers == 0:
        # its own GPU when the stages share a machine, and a worker's CPU share
        with gpu_lease(first.placement), machine.cpu_threads(first.placement.cpus_per_worker):
            trained = [_timed(plan, show_progress) for plan in plans]
    else:
        with ray_cluster(), ThreadPoolExecutor(len(plans), "seed") as pool:
            check_reachable(first)
            trained = list(pool.map(lambda plan: _timed(plan, show_progress), plans))
    record = TrainRecord(
        model=first.model,
        corpus=first.corpus,
        task=first.task,
        seeds=trained,
        workers=first.workers,
        placement=first.placement,
        machine=machine.describe(),
        commit=machine.code_version(first.root),
        precision=first.knobs.precision,
    )
    record.write(first.layout.train_out(first.key) / MANIFEST_FILE)
    return record


def check_planned_steps(plan: RunPlan) -> None:
    """The rules that need the step count (``run_checks``) at the corpus' real batches an
    epoch (rank 0's, as the loop counts them), before the seed's MLflow run starts: a
    refusal leaves no FAILED run behind and no Ray run. The error does not name the run:
    the stage's message does (``train <run>: <key>: <reason>``). The loop checks again at
    its start, and shows the notes."""
    train, _ = shard_data(plan)(0, max(plan.workers, 1))
    planned_step_notes(plan.knobs, len(train), plan.sources, "")


def _timed(plan: RunPlan, show_progress: bool) -> TrainedSeed:
    """``train_plan`` with the wall time of this process's training (a resumed run: since
    the resume) among the seed's metrics."""
    start = time.perf_counter()
    done = train_plan(plan, show_progress)
    wall = {WALL_SECONDS: time.perf_counter() - start}
    return done.model_copy(update={"metrics": {**done.metrics, **wall}})


def train_plan(plan: RunPlan, show_progress: bool = True) -> TrainedSeed:
    """Train (or resume) one seed's plan and export its kept weights (module docstring)."""
    step = resume_step(plan.name, plan.workers, plan.storage, plan.restart)
    resumes = step is not None
    check_planned_steps(plan)
    announce(plan, step)
    # a resumed run's checkpoint holds the embeddings it started from: no second read
    vectors = None if resumes else read_vectors(plan)
    tracker = start_tracker(plan, resumes)
    exported = False
    try:
        tracker.log_params(
            {
                "train": plan.knobs.model_dump(mode="json"),
                "model_config": plan.config.model_dump(mode="json"),
                "workers": plan.workers,
                "placement": plan.placement.model_dump(mode="json"),
                "tuned": plan.tuned_from is not None,
                "identity.code": plan.code,
                "identity.data": plan.data,
            }
        )
        if vectors is not None:
            coverage = vectors.coverage.as_dict()
            tracker.log_params({"word_vectors": coverage})
            tracker.log_metrics({f"word_vectors_{k}": v for k, v in coverage.items()}, step=0)
        job = train_job(plan, tracker.sink, show_progress, vectors)
        result = fit(job, plan.workers, plan.placement, plan.storage)
        if result.state.best_model is None:
            raise _unvalidated(plan, result.state.position.last_eval_step)
        result.state.exported(result.metrics, plan.name).write(plan.model_file)
        exported = True
        mlflow = None
        if tracker.recording:
            mlflow = track_final(plan, tracker, plan.model_file, result)  # type: ignore[arg-type]
        tracker.end()
    except BaseException as err:
        # stopped by a signal, the run resumes from its checkpoint; else it failed
        tracker.end("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
        if exported:  # a failure after the export: no model.pt that looks like a result
            plan.model_file.unlink(missing_ok=True)
        raise
    layout = plan.layout
    local = "://" not in result.checkpoint
    seed = TrainedSeed(
        seed=plan.knobs.seed,
        run_name=plan.name,
        checkpoint=layout.relative(plan.model_file),
        run_checkpoint=layout.relative(Path(result.checkpoint)) if local else result.checkpoint,
        metrics=result.metrics,
        tuned_from=plan.tuned_from,
        mlflow=mlflow,
        stop_reason=result.state.position.stop_reason or None,
        averaged_steps=averaged_steps(plan, result.state),
    )
    if seed.averaging_never_began:
        print(f"{plan.label}: {never_averaged(plan, seed)}", file=sys.stderr, flush=True)
    return seed


def averaged_steps(plan: RunPlan, state: TrainingState) -> int | None:
    """The steps the run's weight average covers; None without averaging."""
    if plan.knobs.averaging.kind == AveragingKind.NONE:
        return None
    return state.average_count if state.average is not None else 0


def never_averaged(plan: RunPlan, seed: TrainedSeed) -> str:
    """What the stage says of a seed whose averaging never began."""
    knobs = plan.knobs
    stop = (seed.stop_reason or "").replace("_", " ")
    n = knobs.averaging.epochs
    last = "the last epoch" if n == 1 else f"the last {n} epochs"
    return (
        f"averaging never began: the run stopped ({stop}) at step {seed.metric('steps'):.0f}, "
        f"before averaging ({last} of {knobs.epochs}); it keeps its live weights (patience "
        f"{knobs.patience}: null always reaches averaging)"
    )


def _unvalidated(plan: RunPlan, last_eval_step: int) -> DataError:
    """The error of a run whose evaluations, the last at ``last_eval_step``, never gave a
    finite value of what selects its weights (``select_by``): no validation chose any, so
    nothing is exported (the checkpoint's fallback, the final weights, would pass for a
    result). A validation loss is infinite only where the valid split has no target token,
    which tokenize refuses (``data.coverage``): shards tokenized before it did are the
    likely cause."""
    select = plan.knobs.select_by
    cause = (
        f": the valid split holds no {plan.task.value} target token"
        if select is Selection.VALID_LOSS
        else ""
    )
    return DataError(
        plan.layout.relative(plan.shards),
        f"no validation chose the weights of seed {plan.knobs.seed}: no evaluation (the "
        f"last at step {last_eval_step}) gave a finite {select.metric.replace('_', ' ')}{cause}"
        f"; nothing exported: tokenize {plan.corpus} again (`dvc repro "
        f"tokenize@{plan.corpus}`), which refuses a corpus whose valid split gives no example",
    )


def announce(plan: RunPlan, step: int | None) -> None:
    """The stage's first line about a seed: where it trains, and whether it resumes (from
    which step) or starts fresh, and why: what differs from the last run of this key."""
    where = "in this process" if plan.workers == 0 else f"on {plan.workers} Ray Train workers"
    if step is not None:
        how = f"resuming {plan.name} from step {step} (same code, params and data)"
    else:
        how = f"starting fresh as {plan.name}: {why_fresh(plan)}"
    print(f"{plan.label}: {how}, {where}", file=sys.stderr, flush=True)
    record_identity(plan)


def why_fresh(plan: RunPlan) -> str:
    """Why no checkpoint fits: what changed since the newest other run of this key
    (identities are kept beside the checkpoints, local storage only)."""
    if "://" in plan.storage:
        return "no checkpoint of this identity"
    prefix = plan.name.rsplit("-", 1)[0]
    others = sorted(
        (
            p
            for p in Path(plan.storage).glob(f"{prefix}-*{IDENTITY_SUFFIX}")
            if p.name != f"{plan.name}{IDENTITY_SUFFIX}"
        ),
        key=lambda p: p.stat().st_mtime,
    )
    if not others:
        return "the first run of this key"
    try:
        last = RunIdentity.model_validate_json(others[-1].read_text())
    except ValueError:
        return "no checkpoint of this identity"
    mine = plan.identity()
    changed = [f for f in RunIdentity.model_fields if getattr(last, f) != getattr(mine, f)]
    names = {"knobs": "params", "config": "model config", "workers": "number of workers"}
    what = ", ".join(names.get(f, f) for f in changed) or "its identity"
    return f"the {what} changed since {last.name}"


def record_identity(plan: RunPlan) -> None:
    """Keep the plan's identity beside its checkpoints (``why_fresh`` of a later run)."""
    if "://" in plan.storage:
        return
    path = Path(plan.storage) / f"{plan.name}{IDENTITY_SUFFIX}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.identity().model_dump_json(indent=2))


def read_vectors(plan: RunPlan) -> WordVectors | None:
    """The run's pre-trained word vectors for its corpus' vocabulary (None without
    ``word_vectors``), read once here rather than by every worker. The model is built on
    the meta device (no memory, no compute) to learn its token embeddings' size, so a
    file of another dimension fails at its first line, naming the config field to set."""
    if plan.word_vectors is None:
        return None
    key = f"train.models.{plan.model}"
    with torch.device("meta"):
        embeddings = token_embeddings(RegistryModel(plan.model, plan.config)())
    if not embeddings:
        raise ConfigError(
            f"{key}.word_vectors",
            f"{plan.model} has no token embedding to load word vectors into: unset it",
        )
    dims = sorted({e.embedding_dim for e in embeddings})
    if len(dims) > 1:
        raise ConfigError(
            f"{key}.word_vectors",
            f"{plan.model}'s token embeddings differ in size {dims}: one file cannot fill them",
        )
    try:
        return read_word_vectors(plan.word_vectors, load_vocab(plan.shards).tokens, dims[0])
    except DimensionError as err:
        config = plan.config.model_dump()
        fields = [f for f in ("d_embed", "d_sentence", "d_model") if config.get(f) == dims[0]]
        where = f"{key}.model.{fields[0]}" if fields else f"{key}.word_vectors"
        raise ConfigError(where, str(err)) from None
