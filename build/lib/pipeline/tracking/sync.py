"""Moving MLflow runs between stores: ``python -m pipeline sync-mlflow`` sends the runs of the
local fallback store to the server.

When the tracking server cannot be reached, training goes on in the local fallback store
``runs/mlflow-fallback`` (:mod:`pipeline.tracking`). :func:`sync_store` copies every ended
run of that store into the configured store (``$MLFLOW_TRACKING_URI``, or ``--to``), into
the experiment of the same name (with the kind and description it lacks): params, every
metric's whole step history (values, steps and timestamps), tags, artifacts, the models
logged by the run with their registered versions (and the registered models'
descriptions), start and end time and status. Parents are copied before their children (Tune
trials), whose parent tag then names the parent's copy.

Idempotent: a copy carries the tag ``hiertx.synced_from`` = the source run's id. Syncing
again finds it and adds only what it lacks (for example the metrics the evaluate stage
logged into the fallback run after the last sync); a second sync of an unchanged store adds
nothing. The server run a fallback run stood in for (its ``hiertx.origin_run_id``), left
RUNNING with part of the history when the server died, is marked FAILED and tagged with the
ids of the fallback run and of its copy, so searches that resume runs skip it. Runs still
RUNNING in the fallback store are left out: a training may still be writing them.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.tracking import describe, store

COMMAND = "sync-mlflow"
TAG_SYNCED_FROM = "hiertx.synced_from"  # on a copy (run, logged model, model version)
TAG_SYNCED_TO = "hiertx.synced_to"  # on the server run a synced fallback run stood in for
SKIP_MODEL_TAGS = ("mlflow.modelVersions",)  # the source registry's versions, not the target's
MLMODEL_FILE = "MLmodel"
METRICS_PER_BATCH = 1000  # MLflow's limits per log_batch call
PARAMS_PER_BATCH = 100


@dataclass
class SyncReport:
    """What a sync did, by source run id."""

    copied: list[str] = field(default_factory=list)  # new copies
    completed: list[str] = field(default_factory=list)  # existing copies that lacked something
    in_sync: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # still RUNNING (or their children)
    notes: list[str] = field(default_factory=list)  # what could not be carried over
    experiments: dict[str, str] = field(default_factory=dict)  # name -> id in the target

    def summary(self) -> str:
        return (
            f"{len(self.copied)} runs copied, {len(self.completed)} completed, "
            f"{len(self.in_sync)} already in sync, {len(self.skipped)} still running (skipped)"
        )


def sync_store(source: str, target: str) -> SyncReport:
    """Copy every ended run of store ``source`` into store ``target`` (module docstring)."""
    if source == target:
        raise ConfigError(
            "MLFLOW_TRACKING_URI",
            f"source and target are the same store ({source}); set MLFLOW_TRACKING_URI (or "
            "--to) to the tracking server to sync into",
        )
    store.configure_env()
    src, dst = store.mlflow_client(source), store.mlflow_client(target)
    report = SyncReport()
    for experiment in _experiments(src):
        runs = list(_runs(src, experiment.experiment_id))
        if not runs:
            continue
        # its kind and description too (a target experiment keeps the ones it has)
        dst_exp = store.experiment_id(dst, experiment.name, experiment.tags)
        report.experiments[experiment.name] = dst_exp
        copies: dict[str, str] = {}  # source run id -> copy's id
        for run in _parents_first(runs):
            run_id = run.info.run_id
            parent = run.data.tags.get(store.TAG_PARENT)
            if run.info.status == "RUNNING" or (parent is not None and parent not in copies):
                report.skipped.append(run_id)
                continue
            copy_id, outcome = _sync_run(src, dst, run, dst_exp, copies.get(parent or ""), report)
            copies[run_id] = copy_id
            getattr(report, outcome).append(run_id)
    return report


# --------------------------------------------------------------------------- listing


def _experiments(client: Any) -> Iterator[Any]:
    token = None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def _runs(client: Any, experiment_id: str, filter_string: str = "") -> Iterator[Any]:
    token = None
    while True:
        page = client.search_runs(
            [experiment_id], filter_string, max_results=1000, page_token=token
        )
        yield from page
        token = page.token
        if not token:
            return


def _parents_first(runs: list[Any]) -> list[Any]:
    by_id = {r.info.run_id: r for r in runs}

    def depth(run: Any) -> int:
        n, seen = 0, set()
        while (parent := run.data.tags.get(store.TAG_PARENT)) in by_id and parent not in seen:
            seen.add(parent)
            run, n = by_id[parent], n + 1
        return n

    return sorted(runs, key=lambda r: (depth(r), r.info.start_time or 0))


# --------------------------------------------------------------------------- one run


def _sync_run(
    src: Any, dst: Any, run: Any, dst_exp: str, parent_copy: str | None, report: SyncReport
) -> tuple[str, str]:
    """Make the copy of ``run`` hold everything ``run`` holds; returns the copy's id and
    which list of the report the run belongs to."""
    run_id = run.info.run_id
    tags = {k: v for k, v in run.data.tags.items() if k != store.TAG_PARENT}
    tags[TAG_SYNCED_FROM] = run_id
    if parent_copy is not None:
        tags[store.TAG_PARENT] = parent_copy
    found = next(iter(_runs(dst, dst_exp, f"tags.`{TAG_SYNCED_FROM}` = '{run_id}'")), None)
    if found is None:
        copy = dst.create_run(
            dst_exp, start_time=run.info.start_time, tags=tags, run_name=run.info.run_name
        )
        copy_id, have_tags, status = copy.info.run_id, tags, None
    else:
        copy_id, have_tags, status = found.info.run_id, found.data.tags, found.info.status
    changes = _sync_tags(dst, copy_id, tags, have_tags)
    changes += _sync_params(dst, copy_id, run, report)
    changes += _sync_metrics(src, dst, run, copy_id)
    changes += _sync_artifacts(src, dst, run_id, copy_id)
    changes += _sync_models(src, dst, run, copy_id, dst_exp, report)
    if status != run.info.status:  # last: a copy interrupted midway stays RUNNING
        dst.set_terminated(copy_id, run.info.status, end_time=run.info.end_time)
        changes += 1
    changes += _close_origin(dst, run, copy_id)
    if found is None:
        return copy_id, "copied"
    return copy_id, "completed" if changes else "in_sync"


def _sync_tags(dst: Any, copy_id: str, tags: dict[str, str], have: dict[str, str]) -> int:
    from mlflow.entities import RunTag

    missing = [RunTag(k, v) for k, v in tags.items() if have.get(k) != v]
    for i in range(0, len(missing), PARAMS_PER_BATCH):
        dst.log_batch(copy_id, tags=missing[i : i + PARAMS_PER_BATCH])
    return len(missing)


def _sync_params(dst: Any, copy_id: str, run: Any, report: SyncReport) -> int:
    from mlflow.entities import Param

    have = dst.get_run(copy_id).data.params
    for key, value in run.data.params.items():
        if key in have and have[key] != value:
            report.notes.append(
                f"run {run.info.run_id}: param {key} is {have[key]!r} in the copy "
                f"{copy_id}, {value!r} in the fallback store (MLflow params cannot change)"
            )
    missing = [Param(k, v) for k, v in sorted(run.data.params.items()) if k not in have]
    for i in range(0, len(missing), PARAMS_PER_BATCH):
        dst.log_batch(copy_id, params=missing[i : i + PARAMS_PER_BATCH])
    return len(missing)


def _point(metric: Any) -> tuple[int, int, str]:
    value = float(metric.value)
    return int(metric.step), int(metric.timestamp), "nan" if math.isnan(value) else repr(value)


def _sync_metrics(src: Any, dst: Any, run: Any, copy_id: str) -> int:
    """Every point of every metric's history the copy lacks (counted with multiplicity, so
    a history that logged the same point twice is copied whole, once)."""
    from mlflow.entities import Metric

    missing: list[Any] = []
    for key in sorted(run.data.metrics):
        source = src.get_metric_history(run.info.run_id, key)
        lacking = Counter(map(_point, source)) - Counter(
            map(_point, dst.get_metric_history(copy_id, key))
        )
        for step, timestamp, value in sorted(lacking.elements()):
            missing.append(Metric(key, float(value), timestamp, step))
    for i in range(0, len(missing), METRICS_PER_BATCH):
        dst.log_batch(copy_id, metrics=missing[i : i + METRICS_PER_BATCH])
    return len(missing)


def _files(client: Any, run_id: str, path: str | None = None) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for info in client.list_artifacts(run_id, path):
        if info.is_dir:
            out.update(_files(client, run_id, info.path))
        else:
            out[info.path] = info.file_size
    return out


def _sync_artifacts(src: Any, dst: Any, run_id: str, copy_id: str) -> int:
    have = _files(dst, copy_id)
    missing = [p for p, size in _files(src, run_id).items() if have.get(p, -1) != size]
    with tempfile.TemporaryDirectory() as tmp:
        for path in missing:
            local = src.download_artifacts(run_id, path, tmp)
            folder = str(Path(path).parent)
            dst.log_artifact(copy_id, local, None if folder == "." else folder)
    return len(missing)


# --------------------------------------------------------------------------- models


def _sync_models(
    src: Any, dst: Any, run: Any, copy_id: str, dst_exp: str, report: SyncReport
) -> int:
    """The models ``run`` logged (MLflow 3 logged models: their artifacts live outside the
    run's) and their registered versions."""
    run_id = run.info.run_id
    models = src.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"
    )
    changes, copies = 0, {}
    for model in models:
        copies[model.model_id], changed = _sync_model(src, dst, model, copy_id, dst_exp)
        changes += changed
    for version in src.search_model_versions(f"run_id = '{run_id}'"):
        changes += _sync_version(src, dst, version, copy_id, copies, report)
    return changes


def _sync_model(src: Any, dst: Any, model: Any, copy_id: str, dst_exp: str) -> tuple[str, int]:
    import mlflow.artifacts
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    found = dst.search_logged_models(
        [dst_exp], filter_string=f"tags.`{TAG_SYNCED_FROM}` = '{model.model_id}'"
    )
    if found and found[0].status == LoggedModelStatus.READY:
        return found[0].model_id, 0
    if found:  # an interrupted copy: upload again
        new = found[0]
    else:
        tags = {k: v for k, v in model.tags.items() if not k.startswith(SKIP_MODEL_TAGS)}
        new = dst.create_logged_model(
            dst_exp,
            name=model.name,
            source_run_id=copy_id,
            tags={**tags, TAG_SYNCED_FROM: model.model_id},
            params=model.params,
            model_type=model.model_type,
        )
        dst.log_outputs(copy_id, [LoggedModelOutput(new.model_id, step=0)])
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(
            mlflow.artifacts.download_artifacts(artifact_uri=model.artifact_location, dst_path=tmp)
        )
        mlmodel = local / MLMODEL_FILE
        if mlmodel.is_file():  # the copy's own ids and place, as if it had been logged there
            meta = Model.load(mlmodel)
            meta.run_id, meta.model_id, meta.model_uuid = copy_id, new.model_id, new.model_id
            meta.artifact_path = new.artifact_location
            meta.save(mlmodel)
        dst.log_model_artifacts(new.model_id, str(local))
    dst.finalize_logged_model(new.model_id, LoggedModelStatus.READY)
    return new.model_id, 1


def _sync_version(
    src: Any, dst: Any, version: Any, copy_id: str, models: dict[str, str], report: SyncReport
) -> int:
    origin = f"{version.name}/{version.version}"
    existing = dst.search_model_versions(f"run_id = '{copy_id}'")
    if any(v.tags.get(TAG_SYNCED_FROM) == origin for v in existing):
        return 0
    # the logged model it registers: its id, or (stores that keep no id) its models:/ URI
    source_model = getattr(version, "model_id", None) or str(version.source).removeprefix(
        "models:/"
    )
    model_id = models.get(source_model)
    if model_id is None:
        report.notes.append(f"model version {origin}: no logged model to register; not copied")
        return 0
    try:
        dst.get_registered_model(version.name)
    except Exception:  # new on the target: with its description from the source
        source = src.get_registered_model(version.name)
        dst.create_registered_model(version.name, tags=source.tags, description=source.description)
    dst.create_model_version(
        version.name,
        source=f"models:/{model_id}",
        run_id=copy_id,
        tags={**version.tags, TAG_SYNCED_FROM: origin},
        description=version.description,
        model_id=model_id,
    )
    return 1


def _close_origin(dst: Any, run: Any, copy_id: str) -> int:
    """Mark the partial server run the fallback run stood in for (module docstring)."""
    origin = run.data.tags.get(store.TAG_ORIGIN)
    if not origin:
        return 0
    try:
        server_run = dst.get_run(origin)
    except Exception:  # not on this server
        return 0
    want = {store.TAG_FALLBACK_RUN: run.info.run_id, TAG_SYNCED_TO: copy_id}
    changes = 0
    for key, value in want.items():
        if server_run.data.tags.get(key) != value:
            dst.set_tag(origin, key, value)
            changes += 1
    if server_run.info.status == "RUNNING":
        dst.set_terminated(origin, "FAILED")
        changes += 1
    return changes


# --------------------------------------------------------------------------- moved stores

# Where MLflow 3's sqlite schema keeps absolute artifact locations. Only locations this
# project gave (``<folder>/mlartifacts``) are rewritten; a table or column a schema lacks is
# left alone.
# --------------------------------------------------------------------------- command


def add_parser(commands: Any) -> None:
    """The ``sync-mlflow`` subcommand of ``python -m pipeline``."""
    sub = commands.add_parser(
        COMMAND,
        help="copy the runs of the local fallback store to the tracking server",
        description=__doc__.splitlines()[0],
    )
    sub.add_argument("--root", default=".", help="project folder (holds runs/mlflow-fallback)")
    sub.add_argument("--to", help="target tracking URI (default: $MLFLOW_TRACKING_URI)")
    sub.add_argument("--from", dest="source", help="source store (default: the fallback store)")


def run_command(args: argparse.Namespace) -> int:
    root = Path(args.root).resolve()
    source = store.resolve_uri(args.source or store.fallback_uri(root), root)
    target = store.resolve_uri(args.to or store.tracking_uri(root), root)
    if source.startswith(store.SQLITE) and not store.local_store_exists(source):
        print(f"{COMMAND}: no fallback store at {source}: nothing to sync")
        return 0
    try:
        report = sync_store(source, target)
    except ConfigError:
        raise
    except Exception as err:  # the server is down, refuses the request, ...
        print(f"{COMMAND}: cannot sync into {target}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    for run_id in report.copied:
        print(f"copied     {run_id}")
    for run_id in report.completed:
        print(f"completed  {run_id}")
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"{COMMAND}: {source} -> {target}: {report.summary()}")
    if target.startswith(("http://", "https://")):
        for name, exp_id in sorted(report.experiments.items()):
            print(f"  {name}: {describe.ui_url(target, exp_id)}")
    return 0
