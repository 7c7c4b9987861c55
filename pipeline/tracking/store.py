"""Where MLflow records live, and reading them: URIs, experiments, run lookup.

- Where: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<project>/mlflow.db`` (artifacts beside
  it in ``mlartifacts/``). One experiment per task and corpus: ``hiertx-<task>-<corpus>``
  (``pipeline.tracking.describe``: names, tags and descriptions as the UI shows them).
  A relative sqlite URI (``sqlite:///mlflow.db``) means the project's folder, whatever the
  working directory: the workspace for a DVC experiment run in a temporary copy
  (``dvc exp run --temp``, queued experiments), so its runs outlive the copy. Manifests
  record local stores relative (:func:`portable_uri`); readers :func:`resolve_uri` them, so
  a copied or moved project uses its own store.
- A local sqlite store records its artifact locations as absolute paths
  (``file:///<project>/mlartifacts/...``): a project copied or moved elsewhere would go on
  writing artifacts into the original's folder (or re-create it). :func:`follow_move`, run
  once per store and process before it is used (:func:`client`), points them at the
  ``mlartifacts`` folder beside the store.
- Waiting on a store: a call to a sqlite store another writer holds locked is tried again
  (:func:`patiently`), and one that takes long is announced on stderr
  (:func:`waiting_notice`), so a training waiting on its store does not look hung.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import socket
import sqlite3
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

WAIT_NOTICE_S = 3.0  # a store call slower than this is announced (waiting_notice)
LOCKED_WAIT_S = 120.0  # how long a write waits for a locked sqlite store before falling back
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
FALLBACK_DIR = Path("runs") / "mlflow-fallback"
ARTIFACT_DIR = "mlartifacts"

TAG_PARENT = "mlflow.parentRunId"
TAG_RUN_KEY = "hiertx.run_key"  # <stage>-<model>-<corpus>-<params hash>: finds a run to resume
TAG_ORIGIN = "hiertx.origin_run_id"  # on a fallback run: the run it stands in for
TAG_MODEL = "hiertx.model"
TAG_CORPUS = "hiertx.corpus"
TAG_VARIANT = "hiertx.variant"  # a further run of the same model and corpus ("" if none)
TAG_TASK = "hiertx.task"
TAG_STAGE = "hiertx.stage"
TAG_GIT = "hiertx.git_commit"
TAG_INPUT = "hiertx.input"  # + ".<path>": the dvc.lock md5 of an input
TAG_TRIAL = "hiertx.trial_id"  # on a Tune trial's child run
TAG_FALLBACK_RUN = "hiertx.fallback_run_id"  # on a server run: where it went on (its twin)
TAG_CHANGED_PARAM = "hiertx.changed_param"  # + ".<key>": a resumed run's new value of a param
CURVES = "curves"  # the chart section of the training loop's metrics (describe.py)

SQLITE = "sqlite:///"
DVC_ROOT_ENV = "DVC_ROOT"  # set by DVC for stage commands: the workspace, even in a temp copy
DVC_EXPS_TMP = Path(".dvc") / "tmp" / "exps"  # where DVC runs experiments in temporary copies


class TrackingUnavailable(RuntimeWarning):
    """The tracking server failed; logging continues in the local fallback store."""


# What configure_env sets where the user has not: no telemetry; fail fast against a dead
# server (MLflow's defaults retry for minutes)
ENV_DEFAULTS: Mapping[str, str] = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def configure_env() -> None:
    """Process-wide MLflow settings (:data:`ENV_DEFAULTS`), each unless the user chose
    otherwise: in ``os.environ``, as MLflow reads them at every request and the processes
    a run starts (Ray workers, stages) inherit them."""
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def project_root(root: str | Path) -> Path:
    """The project whose MLflow store ``root`` uses: ``root`` itself, or the workspace when
    ``root`` is a temporary copy DVC runs an experiment in (``<workspace>/.dvc/tmp/exps/
    <tmp>/``, deleted afterwards). DVC exports the workspace as ``$DVC_ROOT`` to the stage
    commands of such a copy (``dvc/repo/experiments/queue/base.py``); the folder layout
    finds it when a stage script is run by hand inside the copy."""
    here = Path(root).resolve()
    workspace = os.environ.get(DVC_ROOT_ENV)
    if workspace and here.is_relative_to(Path(workspace).resolve() / DVC_EXPS_TMP):
        return Path(workspace).resolve()
    parts = here.parts
    for i in range(len(parts) - len(DVC_EXPS_TMP.parts)):
        if parts[i + 1 : i + 1 + len(DVC_EXPS_TMP.parts)] == DVC_EXPS_TMP.parts:
            return Path(*parts[: i + 1])
    return here


def tracking_uri(root: str | Path) -> str:
    """``$MLFLOW_TRACKING_URI`` or the project's local sqlite store (absolute: ready to use)."""
    return resolve_uri(os.environ.get(TRACKING_URI_ENV) or f"{SQLITE}mlflow.db", root)


def fallback_uri(root: str | Path) -> str:
    return sqlite_uri(project_root(root) / FALLBACK_DIR / "mlflow.db")


def sqlite_uri(path: Path) -> str:
    return f"{SQLITE}{path.resolve()}"


def resolve_uri(uri: str, root: str | Path) -> str:
    """``uri`` usable from any working directory: a relative sqlite path is taken from the
    project root (:func:`project_root`); other URIs are returned as they are."""
    if not uri.startswith(SQLITE):
        return uri
    path, sep, query = uri.removeprefix(SQLITE).partition("?")
    if not path or path == ":memory:" or Path(path).is_absolute():
        return uri
    return f"{sqlite_uri(project_root(root) / path)}{sep}{query}"


def portable_uri(uri: str, root: str | Path) -> str:
    """``uri`` as manifests record it: a sqlite store inside the project relative to its root
    (``sqlite:///mlflow.db``), so a copied or moved project resolves it to its own store."""
    if not uri.startswith(SQLITE):
        return uri
    path, sep, query = uri.removeprefix(SQLITE).partition("?")
    if not Path(path).is_absolute():
        return uri
    try:
        relative = Path(path).resolve().relative_to(project_root(root))
    except ValueError:
        return uri
    return f"{SQLITE}{relative.as_posix()}{sep}{query}"


def registered_model_name(model: str, corpus: str, variant: str | None = None) -> str:
    """``hiertx-<run key>``: one registered model per run, its versions the retrainings."""
    return f"hiertx-{model}-{corpus}" + (f"-{variant}" if variant else "")


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}`` (MLflow params are flat strings)."""
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)
    return out


def dvc_input_hashes(root: str | Path, inputs: list[str]) -> dict[str, str]:
    """The md5 ``dvc.lock`` records for each of ``inputs`` (as an output of the stage that
    made it, or a dependency of any stage); inputs it does not know are left out, and all
    of them, with a warning, from a lock file that is not one (a merge left it conflicted):
    tags are no reason to stop a training."""
    lock = Path(root) / "dvc.lock"
    if not lock.is_file():
        return {}
    found: dict[str, str] = {}
    try:
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
        for section in ("outs", "deps"):
            for stage in stages.values():
                for entry in stage.get(section, []):
                    path = str(entry.get("path", "")).rstrip("/")
                    if path in inputs and path not in found and "md5" in entry:
                        found[path] = str(entry["md5"])
    except (yaml.YAMLError, AttributeError, TypeError) as err:
        reason = str(err).splitlines()[0]
        warnings.warn(
            f"{lock} is no DVC lock file ({reason}): the MLflow run is tagged without the "
            "hashes of its inputs; `dvc repro` writes it anew",
            stacklevel=2,
        )
        return {}
    return found


def system_info() -> dict[str, str]:
    import torch

    from pipeline.machine import gpu_names

    gpus = gpu_names()
    info = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpus": str(os.cpu_count()),
        "cuda": torch.version.cuda or "none",
        "gpus": str(len(gpus)),
    }
    if gpus:
        info["gpu_name"] = gpus[0]
    return info


# --------------------------------------------------------------------------- stores


def mlflow_client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    create_once(uri)
    follow_move(uri)  # a local store moved with its project writes artifacts beside itself
    return MlflowClient(tracking_uri=uri)


_created: set[str] = set()


def create_once(uri: str) -> None:
    """Make sure the sqlite store ``uri`` has its tables, one process at a time. MLflow
    creates a new store's tables and runs its migrations without a lock: processes opening
    a new store together (concurrent stages) race, and the losers fail ("table experiments
    already exists"). A lock file beside the database lets one create it while the others
    wait. Once per store and process; other stores need nothing."""
    if uri in _created or urlparse(uri).scheme != "sqlite":
        return
    from mlflow.tracking import MlflowClient

    db = Path(uri.removeprefix(SQLITE).partition("?")[0])
    db.parent.mkdir(parents=True, exist_ok=True)
    with db.with_name(f"{db.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # the tracking store's tables
        client.search_registered_models(max_results=1)  # the registry's
    _created.add(uri)


def artifact_location(uri: str) -> str | None:
    """Local stores keep artifacts beside the database; servers decide themselves."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        db = Path(uri.removeprefix("sqlite:///")).resolve()
        return (db.parent / ARTIFACT_DIR).as_uri()
    return None


def experiment_id(
    client: Any, name: str, tags: Mapping[str, str] | None = None, formerly: str | None = None
) -> str:
    """The id of experiment ``name``, created with ``tags`` if the store lacks it; an
    existing one gets those of ``tags`` it lacks (a store made before the pipeline set
    them), never a new value for one it has (a description edited in the UI stays). A store
    holding the experiment under its former name ``formerly`` renames it."""
    tags = dict(tags or {})
    found = client.get_experiment_by_name(name)
    if found is None and formerly is not None:
        old = client.get_experiment_by_name(formerly)
        if old is not None and old.lifecycle_stage == "active":
            client.rename_experiment(old.experiment_id, name)
            found = client.get_experiment(old.experiment_id)
    if found is None:
        location = artifact_location(client.tracking_uri)
        try:
            return str(client.create_experiment(name, artifact_location=location, tags=tags))
        except Exception:
            # another process created it in between
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    for key, value in tags.items():
        if key not in found.tags:
            client.set_experiment_tag(found.experiment_id, key, value)
    return str(found.experiment_id)


def find_run(client: Any, experiment_id: str, tag: str, value: str) -> Any | None:
    """The newest run tagged ``tag = value``, leaving out runs a fallback run stood in for
    (those hold part of the history only)."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{tag}` = '{value}'",
        order_by=["attributes.start_time DESC"],
        max_results=20,
    )
    return next((r for r in runs if TAG_FALLBACK_RUN not in r.data.tags), None)


def local_store_exists(uri: str) -> bool:
    return uri.startswith(SQLITE) and Path(uri.removeprefix(SQLITE).partition("?")[0]).is_file()


LOCATION_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "storage_location"),
)
_followed: set[str] = set()


def follow_move(uri: str) -> list[str]:
    """If the local sqlite store ``uri`` was moved or copied (its experiments keep their
    artifacts in an ``mlartifacts`` folder that is not the one beside it), point every
    artifact location at the folder beside it; returns the old folders (none: nothing to
    do). Checked once per store and process."""
    if uri in _followed or not local_store_exists(uri):
        return []
    _followed.add(uri)
    db = Path(uri.removeprefix(SQLITE).partition("?")[0]).resolve()
    new = (db.parent / ARTIFACT_DIR).as_uri()
    with contextlib.closing(sqlite3.connect(db, timeout=60)) as con, con:
        try:
            rows = con.execute("SELECT artifact_location FROM experiments").fetchall()
        except sqlite3.Error:  # not an MLflow store (yet)
            return []
        olds = sorted({loc for (loc,) in rows if loc and loc.endswith(f"/{ARTIFACT_DIR}")} - {new})
        for old in olds:
            for table, column in LOCATION_COLUMNS:
                try:
                    con.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                        f"WHERE substr({column}, 1, ?) = ?",
                        (new, len(old) + 1, len(old), old),
                    )
                except sqlite3.OperationalError:  # this schema has no such table/column
                    continue
    if olds:
        warnings.warn(
            f"the MLflow store {db} was moved or copied: its artifacts now go to {new} "
            f"(they went to {', '.join(olds)})",
            stacklevel=2,
        )
    return olds


# --------------------------------------------------------------------------- reading


def metric_history(
    uri: str, run_id: str, key: str, section: str = CURVES
) -> list[tuple[int, float]]:
    """Every ``(step, value)`` logged for metric ``key`` of a run, in step order (empty if
    the run never logged it). ``key`` as the training loop names it: the run holds it in
    its chart section ``section`` (``curves/valid_loss``), or, logged
    before there were sections, as ``key`` itself."""
    client = mlflow_client(uri)
    history = client.get_metric_history(run_id, f"{section}/{key}") if section else []
    if not history:
        history = client.get_metric_history(run_id, key)
    return sorted((int(m.step), float(m.value)) for m in history)


# --------------------------------------------------------------------------- waiting


def patiently(call: Callable[[], Any], for_s: float = LOCKED_WAIT_S) -> Any:
    """``call()``, again while a sqlite store is locked by another writer (concurrent
    trainings share one store), for up to ``for_s`` seconds; other errors at once."""
    deadline = time.monotonic() + for_s
    while True:
        try:
            return call()
        except Exception as err:
            if "database is locked" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def waiting_notice(uri: str, after_s: float = WAIT_NOTICE_S) -> Iterator[None]:
    """Say on stderr, once, when a call to the store at ``uri`` has not returned after
    ``after_s`` seconds (a sqlite store locked by another process, a slow server): a
    training that waits on its tracking store should not look hung."""

    def notice() -> None:
        print(
            f"tracking: the MLflow store {uri} has not answered for {after_s:g} s (locked by "
            "another process, or a slow server); waiting for it: if it fails, logging goes on "
            "in the local fallback store (python -m pipeline sync-mlflow copies it back)",
            file=sys.stderr,
            flush=True,
        )

    timer = threading.Timer(after_s, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
