"""MLflow tracking: the ONE place that knows experiments, run names, tags, artifacts and the
model registry.

- Where: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<project>/mlflow.db`` (artifacts beside
  it in ``mlartifacts/``). One experiment per task and corpus: ``hiertx/<task>/<corpus>``.
  A relative sqlite URI (``sqlite:///mlflow.db``) means the project's folder, whatever the
  working directory: the workspace for a DVC experiment run in a temporary copy
  (``dvc exp run --temp``, queued experiments), so its runs outlive the copy. Manifests
  record local stores relative (:func:`portable_uri`); readers :func:`resolve_uri` them, so
  a copied or moved project uses its own store.
- What: a run per training (Tune trials: child runs of one parent run), flattened params,
  git commit, the dvc.lock hashes of the inputs, system info, metrics, the vocabulary,
  the final checkpoint, sample generations, and the final model as a pyfunc registered as
  ``hiertx-<model>-<corpus>`` (a version per run).
- Never in the way: if the tracking server cannot be reached (at the start or mid-run),
  the :class:`Tracker` warns once and continues in a local fallback store
  (``<project>/runs/mlflow-fallback``), replaying everything it had logged, so nothing is
  lost. A fallback run carries the tag ``hiertx.origin_run_id``; every process that falls
  back (driver, rank-0 worker) finds and shares the same fallback run. When the run ends,
  the run it stands in for is marked FAILED (if the server answers again) and tagged with
  the fallback run's id; ``python -m pipeline sync-mlflow`` copies fallback runs to the
  server (``pipeline.tracking_sync``).
- Re-runs: a run is found again by its run key tag (:meth:`Tracker.start` ``resume_key``),
  so a training resumed from its checkpoint (even a finished one) goes on in the run that
  holds its history instead of starting an empty one.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import yaml

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

SQLITE = "sqlite:///"
DVC_ROOT_ENV = "DVC_ROOT"  # set by DVC for stage commands: the workspace, even in a temp copy
DVC_EXPS_TMP = Path(".dvc") / "tmp" / "exps"  # where DVC runs experiments in temporary copies

Reuse = Literal["unfinished", "any", "never"]


class TrackingUnavailable(RuntimeWarning):
    """The tracking server failed; logging continues in the local fallback store."""


def configure_env() -> None:
    """Process-wide MLflow settings: no telemetry; fail fast against a dead server (the
    defaults retry for minutes) unless the user chose otherwise."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


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


def experiment_name(task: str, corpus: str, prefix: str = "hiertx") -> str:
    return f"{prefix}/{task}/{corpus}"


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
    made it, or a dependency of any stage); inputs it does not know are left out."""
    lock = Path(root) / "dvc.lock"
    if not lock.is_file():
        return {}
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    found: dict[str, str] = {}
    for section in ("outs", "deps"):
        for stage in stages.values():
            for entry in stage.get(section, []):
                path = str(entry.get("path", "")).rstrip("/")
                if path in inputs and path not in found and "md5" in entry:
                    found[path] = str(entry["md5"])
    return found


def system_info() -> dict[str, str]:
    import torch

    info = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpus": str(os.cpu_count()),
        "cuda": torch.version.cuda or "none",
        "gpus": str(torch.cuda.device_count()),
    }
    if torch.cuda.is_available():
        info["gpu_name"] = torch.cuda.get_device_name(0)
    return info


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunRef:
    """How any process (a Ray worker, a Tune trial) reaches a run: picklable."""

    uri: str
    run_id: str
    experiment: str
    run_name: str
    fallback_uri: str

    def attach(self) -> Tracker:
        return Tracker(self)


Op = Callable[[Any, str], Any]  # (MlflowClient, run_id) -> result


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    from pipeline.tracking_sync import follow_move

    follow_move(uri)  # a local store moved with its project writes artifacts beside itself
    return MlflowClient(tracking_uri=uri)


def _artifact_location(uri: str) -> str | None:
    """Local stores keep artifacts beside the database; servers decide themselves."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        db = Path(uri.removeprefix("sqlite:///")).resolve()
        return (db.parent / ARTIFACT_DIR).as_uri()
    return None


def _experiment_id(client: Any, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    location = _artifact_location(client.tracking_uri)
    try:
        return str(client.create_experiment(name, artifact_location=location))
    except Exception:
        # another process created it in between
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _find_run(client: Any, experiment_id: str, tag: str, value: str) -> Any | None:
    """The newest run tagged ``tag = value``, leaving out runs a fallback run stood in for
    (those hold part of the history only)."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{tag}` = '{value}'",
        order_by=["attributes.start_time DESC"],
        max_results=20,
    )
    return next((r for r in runs if TAG_FALLBACK_RUN not in r.data.tags), None)


def _open_run(
    client: Any,
    experiment: str,
    run_name: str,
    tags: Mapping[str, str],
    resume_key: str | None,
    reuse: Reuse,
) -> str:
    """The run tagged ``resume_key`` (reopened) if ``reuse`` allows it, else a new run."""
    exp_id = _experiment_id(client, experiment)
    if resume_key is not None and reuse != "never":
        found = _find_run(client, exp_id, TAG_RUN_KEY, resume_key)
        if found is not None and (reuse == "any" or found.info.status != "FINISHED"):
            client.update_run(found.info.run_id, status="RUNNING")
            _tag_op(tags)(client, found.info.run_id)  # e.g. the commit that goes on with it
            return str(found.info.run_id)
    return str(client.create_run(exp_id, run_name=run_name, tags=dict(tags)).info.run_id)


def _local_store_exists(uri: str) -> bool:
    return uri.startswith(SQLITE) and Path(uri.removeprefix(SQLITE).partition("?")[0]).is_file()


def _stand_in(client: Any, fallback: str, experiment: str, key: str) -> tuple[str, str | None]:
    """Where the history of the run keyed ``key`` is when a fallback run holds it: that
    fallback run's id and the id of the (partial) run it stands in for on ``client``'s
    store, or ``("", None)`` when the store ``client`` reaches holds it."""
    if fallback == client.tracking_uri or not _local_store_exists(fallback):
        return "", None
    local = _client(fallback)
    local_exp = local.get_experiment_by_name(experiment)
    if local_exp is None:
        return "", None
    exp = client.get_experiment_by_name(experiment)
    found = None if exp is None else _find_run(client, exp.experiment_id, TAG_RUN_KEY, key)
    if found is None:  # started while the server was down: only the fallback store has it
        keyed = _find_run(local, local_exp.experiment_id, TAG_RUN_KEY, key)
        return ("", None) if keyed is None else (str(keyed.info.run_id), None)
    twin = _find_run(local, local_exp.experiment_id, TAG_ORIGIN, found.info.run_id)
    return ("", None) if twin is None else (str(twin.info.run_id), str(found.info.run_id))


class NullTracker:
    """Stands in for a :class:`Tracker` where tracking is off (``tracking.enabled: false``,
    a Tune trial without a parent run, ranks other than 0): every call does nothing, so
    callers log unconditionally. ``recording`` tells the two apart."""

    recording = False
    ref: RunRef | None = None
    run_id: str | None = None
    fell_back = False
    sink: Callable[[], Tracker] | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Nothing to log to."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Nothing to tag."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Nothing to log to."""

    def log_dict(self, value: dict[str, Any], artifact_file: str) -> None:
        """Nothing to log to."""

    def end_children(self, statuses: Mapping[str, str], default: str = "KILLED") -> int:
        """No child runs: none ended."""
        return 0

    def end(self, status: str = "FINISHED") -> None:
        """No run to end."""


class Tracker:
    """Logs to one MLflow run; never lets a tracking failure stop training.

    Every call is journaled; on the first failure the tracker warns once, opens (or
    finds) the fallback run, replays the journal there and carries on there.
    """

    recording = True

    def __init__(self, ref: RunRef, tags: Mapping[str, str] | None = None) -> None:
        self.ref = ref
        self.tags = dict(tags or {})
        self.journal: list[Op] = []
        self.fell_back = False
        self.origin: RunRef | None = None  # after a fallback: the server run left behind
        self._last_result: Any = None

    @classmethod
    def start(
        cls,
        uri: str,
        fallback: str,
        experiment: str,
        run_name: str,
        tags: Mapping[str, str] | None = None,
        parent_run_id: str | None = None,
        resume_key: str | None = None,
        reuse: Reuse = "unfinished",
    ) -> Tracker:
        """A run in ``experiment``, tagged ``resume_key``; ``reuse`` says when an earlier run
        with that key goes on instead of a new one: ``"unfinished"`` (not FINISHED),
        ``"any"`` (a training resuming from its checkpoint, even a finished one: its history
        is in that run; where a fallback run holds it, that one goes on) or ``"never"``."""
        configure_env()
        tags = {
            **(tags or {}),
            **({TAG_PARENT: parent_run_id} if parent_run_id else {}),
            **({TAG_RUN_KEY: resume_key} if resume_key else {}),
        }
        tracker: Tracker | None = None
        try:
            client = _client(uri)
            if reuse == "any" and resume_key is not None:
                run_id, origin = _stand_in(client, fallback, experiment, resume_key)
                if run_id:
                    tracker = cls(RunRef(fallback, run_id, experiment, run_name, fallback), tags)
                    local = _client(fallback)
                    local.update_run(run_id, status="RUNNING")
                    _tag_op(tags)(local, run_id)
                    tracker.fell_back = True
                    if origin is not None:
                        tracker.origin = RunRef(uri, origin, experiment, run_name, fallback)
            if tracker is None:
                run_id = _open_run(client, experiment, run_name, tags, resume_key, reuse)
                tracker = cls(RunRef(uri, run_id, experiment, run_name, fallback), tags)
        except Exception as err:
            _warn(uri, err)
            run_id = _open_run(_client(fallback), experiment, run_name, tags, resume_key, reuse)
            tracker = cls(RunRef(fallback, run_id, experiment, run_name, fallback), tags)
            tracker.fell_back = True
        # journaled (already applied): a later fallback run gets the creation tags too
        tracker.journal.append(_tag_op(tags))
        return tracker

    @property
    def run_id(self) -> str:
        return self.ref.run_id

    @property
    def sink(self) -> Callable[[], Tracker]:
        """What a training job logs its metrics through (picklable: Ray ships it to the
        workers, where rank 0 attaches to this run)."""
        return self.ref.attach

    # ----------------------------------------------------------------- core

    def _do(self, op: Op) -> Any:
        self.journal.append(op)
        if self.fell_back:
            return op(_client(self.ref.uri), self.ref.run_id)
        try:
            return op(_client(self.ref.uri), self.ref.run_id)
        except Exception as err:
            _warn(self.ref.uri, err)
            self._fall_back()
            return self._last_result

    def _fall_back(self) -> None:
        client = _client(self.ref.fallback_uri)
        exp_id = _experiment_id(client, self.ref.experiment)
        found = _find_run(client, exp_id, TAG_ORIGIN, self.ref.run_id)
        if found is not None:
            run_id = str(found.info.run_id)
        else:
            tags = {**self.tags, TAG_ORIGIN: self.ref.run_id}
            run_id = str(
                client.create_run(exp_id, run_name=self.ref.run_name, tags=tags).info.run_id
            )
        self.origin = self.ref
        self.ref = RunRef(
            self.ref.fallback_uri,
            run_id,
            self.ref.experiment,
            self.ref.run_name,
            self.ref.fallback_uri,
        )
        self.fell_back = True
        self._last_result = None
        for op in self.journal:
            self._last_result = op(client, run_id)

    # ----------------------------------------------------------------- logging

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log ``params`` (flattened). A param the run already holds with another value (a
        resumed run whose non-hashed settings changed, e.g. ``train.scale.cpus_per_worker``)
        cannot change in MLflow: its new value goes to the tag ``hiertx.changed_param.<key>``."""
        from mlflow.entities import Param

        flat = {k: v[:6000] for k, v in flatten(params).items()}

        def op(client: Any, run_id: str) -> None:
            have = client.get_run(run_id).data.params
            items = [Param(k, v) for k, v in sorted(flat.items()) if k not in have]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
                client.log_batch(run_id, params=items[i : i + 100])
            changed = {
                f"{TAG_CHANGED_PARAM}.{k}": v for k, v in flat.items() if have.get(k, v) != v
            }
            if changed:
                _tag_op(changed)(client, run_id)

        self._do(op)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.tags.update(tags)
        self._do(_tag_op(tags))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._do(lambda c, r: c.log_batch(r, metrics=items))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        local = str(Path(path).resolve())
        self._do(lambda c, r: c.log_artifact(r, local, artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._do(lambda c, r: c.log_text(r, text, artifact_file))

    def log_dict(self, value: dict[str, Any], artifact_file: str) -> None:
        self._do(lambda c, r: c.log_dict(r, value, artifact_file))

    def log_pyfunc(self, registered_name: str | None, **kwargs: Any) -> str | None:
        """Log a pyfunc model (``serving.log_pyfunc`` kwargs); register it as a new version
        of ``registered_name`` if given. Returns the version (or ``None``)."""
        from pipeline import serving

        return self._do(
            lambda c, r: serving.log_pyfunc(c.tracking_uri, r, registered_name, **kwargs)
        )

    def end_children(self, statuses: Mapping[str, str], default: str = "KILLED") -> int:
        """Give child runs their scheduler's verdict: ``statuses`` maps a child's
        ``hiertx.trial_id`` tag to FINISHED / FAILED. Ray Tune stops a trial's process right
        after its last report, often before the trial ends its own run (left RUNNING, or
        KILLED): those take the verdict; children still RUNNING that ``statuses`` does not
        name get ``default``. A run its trial ended itself (FINISHED, or FAILED with a
        reason such as an invalid config) keeps its status. Returns how many changed."""

        def op(client: Any, run_id: str) -> int:
            exp_id = client.get_run(run_id).info.experiment_id
            children = client.search_runs(
                [exp_id], filter_string=f"tags.`{TAG_PARENT}` = '{run_id}'"
            )
            changed = 0
            for run in children:
                if run.info.status not in ("RUNNING", "KILLED"):
                    continue
                want = statuses.get(run.data.tags.get(TAG_TRIAL, ""))
                if want is None and run.info.status == "RUNNING":
                    want = default
                if want is not None and want != run.info.status:
                    client.set_terminated(run.info.run_id, want)
                    changed += 1
            return changed

        return int(self._do(op) or 0)

    def end(self, status: str = "FINISHED") -> None:
        """End the run. If any process of it fell back (this one or a Ray worker), the
        fallback run gets this process's part too and the server run it stands in for is
        marked FAILED and tagged with the fallback run's id (one try: a server still down
        leaves that to ``sync-mlflow``)."""
        if not self.fell_back and self._fallback_twin_exists():
            self._fall_back()
        self._do(lambda c, r: c.set_terminated(r, status))
        if self.origin is not None:
            origin, self.origin = self.origin, None
            try:
                client = _client(origin.uri)
                client.set_tag(origin.run_id, TAG_FALLBACK_RUN, self.run_id)
                client.set_terminated(origin.run_id, "FAILED")
            except Exception:  # still unreachable
                self.origin = origin

    def _fallback_twin_exists(self) -> bool:
        """Whether another process of this run fell back (a fallback run stands in for it)."""
        fallback = self.ref.fallback_uri
        if fallback == self.ref.uri or not _local_store_exists(fallback):
            return False
        try:
            client = _client(fallback)
            exp = client.get_experiment_by_name(self.ref.experiment)
            return exp is not None and (
                _find_run(client, exp.experiment_id, TAG_ORIGIN, self.run_id) is not None
            )
        except Exception:  # a broken local store must not fail the run's end
            return False


def _tag_op(tags: Mapping[str, str]) -> Op:
    from mlflow.entities import RunTag

    items = [RunTag(k, str(v)) for k, v in tags.items()]
    return lambda c, r: c.log_batch(r, tags=items)


def _warn(uri: str, err: Exception) -> None:
    warnings.warn(
        f"MLflow tracking at {uri} failed ({type(err).__name__}: {err}); continuing in the "
        "local fallback store (runs/mlflow-fallback): nothing is lost",
        TrackingUnavailable,
        stacklevel=3,
    )


# --------------------------------------------------------------------------- reading


def report_experiment_name(prefix: str = "hiertx") -> str:
    """The experiment holding the report stage's runs (tables and plots as artifacts)."""
    return f"{prefix}/report"


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """Every ``(step, value)`` logged for metric ``key`` of a run, in step order (empty if
    the run never logged it)."""
    history = _client(uri).get_metric_history(run_id, key)
    return sorted((int(m.step), float(m.value)) for m in history)
