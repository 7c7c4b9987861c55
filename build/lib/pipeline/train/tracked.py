"""A training's (or a search's) MLflow run: opened with the tags that find it again, and,
at the end, the final metrics, the vocabulary, the exported weights, sample generations
and the pyfunc model registered as a new version of ``hiertx-<run key>``.

What the MLflow UI shows of it: a short run name that tells the runs of one experiment
apart in the runs table (:func:`display_name`; the full identity is the tag
``hiertx.run_key``), a one-line description of the run, of its experiment and of its
registered model, and the DVC stage that made it as its source."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from pipeline import tracking
from pipeline.artifacts import MODEL_FILE, VOCAB_FILE, MlflowRef
from pipeline.cluster import PROJECT_ON_SHARED_FS, STORAGE_ENV, remote_nodes, require_shared
from pipeline.data.loader import BatchLoader, load_vocab, open_split
from pipeline.data.splits import Split
from pipeline.errors import ConfigError
from pipeline.machine import code_version
from pipeline.models.saved import load_model
from pipeline.names import Task
from pipeline.plan import RunPlan
from pipeline.serving import ServingSpec, log_pyfunc
from pipeline.train.distributed import FitResult

Tracker = tracking.Tracker | tracking.NullTracker


def check_reachable(plan: RunPlan) -> None:
    """Before a Ray run: its workers read the project's data, write metrics to the MLflow
    store and checkpoints to the storage path, so on a cluster with nodes other than this
    machine none of them may be on this machine's disk alone (a local multi-node cluster,
    or an NFS mount every node shares, keeps them). Ray must be up."""
    if plan.workers == 0:
        return
    elsewhere = remote_nodes()
    if not elsewhere:
        return
    uri = tracking.tracking_uri(plan.root)
    if plan.tracking.enabled and urlparse(uri).scheme in ("sqlite", "file", ""):
        raise ConfigError(
            tracking.TRACKING_URI_ENV,
            f"the MLflow store {uri} is a file on this machine, which Ray workers on "
            f"{', '.join(elsewhere[:3])} cannot write: start a tracking server they reach "
            "(infra/mlflow, README 'On a cluster') and export "
            "MLFLOW_TRACKING_URI=http://<host>:5000",
        )
    if "://" not in plan.storage:
        require_shared(
            Path(plan.storage),
            "train.placement.storage_path",
            "checkpoints would go to",
            f"set it (or ${STORAGE_ENV}) to storage every node mounts at the same path (NFS) "
            "or an s3:// or gs:// URI",
        )
    require_shared(
        plan.layout.data_dir, "project", "the tokenized corpus is under", PROJECT_ON_SHARED_FS
    )


def start_tracker(plan: RunPlan, resumes: bool) -> Tracker:
    """The plan's MLflow run. ``resumes``: the training (or search) goes on from a
    checkpoint of an earlier run of the same identity, finished or not, so that run, which
    holds the history before the checkpoint, goes on; otherwise a fresh run logs it all."""
    if not plan.tracking.enabled:
        return tracking.NullTracker()
    root = plan.root
    shards = plan.layout.relative(plan.shards)
    inputs = tracking.dvc_input_hashes(root, [shards])
    tags = {
        tracking.TAG_MODEL: plan.model,
        tracking.TAG_CORPUS: plan.corpus,
        tracking.TAG_VARIANT: plan.variant or "",
        tracking.TAG_TASK: plan.task.value,
        tracking.TAG_STAGE: plan.stage,
        tracking.TAG_GIT: code_version(root) or "unknown",
        **{f"{tracking.TAG_INPUT}.{path}": md5 for path, md5 in inputs.items()},
        **{f"hiertx.system.{k}": v for k, v in tracking.system_info().items()},
    }
    prefix = plan.tracking.experiment_prefix
    return tracking.Tracker.start(
        tracking.tracking_uri(root),
        tracking.fallback_uri(root),
        tracking.experiment_name(plan.task.value, plan.corpus, prefix),
        run_name=display_name(plan),
        tags=tags,
        resume_key=plan.name,
        reuse="any" if resumes else "never",
        description=describe_run(plan),
        source=plan.dvc_stage,
        experiment_description=tracking.describe_task(plan.task.value, plan.corpus),
        former_experiment=tracking.former_experiment_name(plan.task.value, plan.corpus, prefix),
    )


def display_name(plan: RunPlan) -> str:
    """The run's name in the MLflow runs table, which shows about 22 characters of it:
    ``<model>[-<variant>][ search| tuned][ #<seed index>] <digest>``, the digest the first
    5 characters of the identity's (``hiertx.run_key`` holds it whole)."""
    kind = " search" if plan.stage == "tune" else " tuned" if plan.tuned_from else ""
    seed = f" #{plan.seed_index}" if plan.stage == "train" and plan.knobs.seeds > 1 else ""
    variant = f"-{plan.variant}" if plan.variant else ""
    return f"{plan.model}{variant}{kind}{seed} {plan.identity().digest[:5]}"


def describe_run(plan: RunPlan) -> str:
    """The run's description: what trains on what, with which seed and key settings."""
    k = plan.knobs
    steps = f"{k.epochs} epochs" + (
        f" of {k.max_batches_per_epoch} batches" if k.max_batches_per_epoch else ""
    )
    if k.max_steps:
        steps += f", at most {k.max_steps} steps"
    what = f"{plan.model} on {plan.corpus} ({plan.task.value})"
    settings = f"{steps}, batch {k.batch_size}, {k.optimizer.kind} lr {k.optimizer.lr:g}"
    if plan.stage == "tune":
        return f"Tune search over {what}: its trials are the child runs; {settings} each."
    seeds = f"seed {k.seed}" + (f" ({plan.seed_index + 1} of {k.seeds})" if k.seeds > 1 else "")
    tuned = f"; settings of the search {plan.tuned_from.search}" if plan.tuned_from else ""
    return f"Training of {what}, {seeds}: {settings}{tuned}. `dvc repro {plan.dvc_stage}`."


def describe_model(plan: RunPlan) -> str:
    """A registered model's description: what it serves, and where its versions come from."""
    return (
        f"{plan.model} trained on {plan.corpus} for the task {plan.task.value}, as an MLflow "
        f"pyfunc (README, Serving); a version per training run of `dvc repro {plan.dvc_stage}`."
    )


def sample_generations(model_file: Path, plan: RunPlan) -> str:
    """Greedy responses of the exported model to the first validation histories (none
    where the valid split has no example)."""
    n = plan.tracking.sample_generations
    if plan.task != Task.GENERATE or n == 0:
        return ""
    from pipeline.decode import DecodeConfig, generate

    model = load_model(model_file)
    vocab = load_vocab(plan.shards)
    loader = BatchLoader(
        open_split(plan.shards, plan.task, Split.VALID), n, shuffle=False, bucket=False
    )
    batch = next(iter(loader), None)
    if batch is None:
        return ""
    with torch.no_grad():
        max_length = plan.corpus_params.generate.max_response
        out = generate(model, batch, DecodeConfig(max_length=max_length))
    lines = []
    for i in range(batch.batch_size):
        ids = batch.history.input_ids[i][batch.history.input_mask[i]].tolist()
        lines += [
            f"## {batch.dialogue_id[i]}",
            f"history:   {vocab.decode(ids)}",
            f"reference: {vocab.decode(batch.target_ids[i].tolist())}",
            f"generated: {vocab.decode(out.tokens[i][: int(out.lengths[i])].tolist())}",
            "",
        ]
    return "\n".join(lines)


def _describe_version(
    name: str, version: str, description: str, plan: RunPlan
) -> Callable[[Any, str], None]:
    """Describe the registered model ``name`` and its new ``version`` (serving registers
    them without a description)."""

    def op(client: Any, run_id: str) -> None:
        client.update_registered_model(name, description=description)
        client.update_model_version(
            name, version, description=f"{describe_run(plan)} MLflow run {run_id}."
        )

    return op


def track_final(
    plan: RunPlan, tracker: tracking.Tracker, model_file: Path, result: FitResult
) -> MlflowRef:
    """Log a finished training's outcome, its files and its pyfunc model (registered)."""
    tracker.log_metrics(
        {f"final_{k}": v for k, v in result.metrics.items()}, int(result.metrics["steps"])
    )
    tracker.log_artifact(plan.shards / VOCAB_FILE, "tokenizer")
    tracker.log_artifact(model_file, "checkpoint")
    samples = sample_generations(model_file, plan)
    if samples:
        tracker.log_text(samples, "samples/generations.txt")
    version = None
    registered = tracking.registered_model_name(plan.model, plan.corpus, plan.variant)
    if plan.tracking.log_model:
        name = registered if plan.tracking.register_model else None
        spec = ServingSpec.of(plan.task, plan.corpus_params)
        version = tracker.call(
            lambda client, run_id: log_pyfunc(
                client.tracking_uri,
                run_id,
                name,
                checkpoint=model_file,
                vocab=plan.shards / VOCAB_FILE,
                spec=spec,
            )
        )
        if name is not None and version is not None:
            tracker.call(_describe_version(name, str(version), describe_model(plan), plan))
    return MlflowRef(
        tracking_uri=tracking.portable_uri(tracker.ref.uri, plan.root),
        experiment=tracker.ref.experiment,
        run_id=tracker.run_id,
        fallback=tracker.fell_back,
        checkpoint_uri=f"runs:/{tracker.run_id}/checkpoint/{MODEL_FILE}",
        registered_model=registered if version is not None else None,
        model_version=version,
    )
