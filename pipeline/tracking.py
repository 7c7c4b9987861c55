"""MLflow tracking: the ONE place that knows experiments, run names, tags, artifacts and the
model registry.

- Where: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<project>/mlflow.db`` (artifacts beside
  it in ``mlartifacts/``). One experiment per task and corpus: ``hiertx/<task>/<corpus>``.
- What: a run per training (Tune trials: child runs of one parent run), flattened params,
  git commit, the dvc.lock hashes of the inputs, system info, metrics, the vocabulary,
  the final checkpoint, sample generations, and the final model as a pyfunc registered as
  ``hiertx-<model>-<corpus>`` (a version per run).
- Never in the way: if the tracking server cannot be reached (at the start or mid-run),
  the :class:`Tracker` warns once and continues in a local fallback store
  (``<project>/runs/mlflow-fallback``), replaying everything it had logged, so nothing is
  lost. A fallback run carries the tag ``hiertx.origin_run_id``; every process that falls
  back (driver, rank-0 worker) finds and shares the same fallback run.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
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
TAG_TASK = "hiertx.task"
TAG_STAGE = "hiertx.stage"
TAG_GIT = "hiertx.git_commit"
TAG_INPUT = "hiertx.input"  # + ".<path>": the dvc.lock md5 of an input


class TrackingUnavailable(RuntimeWarning):
    """The tracking server failed; logging continues in the local fallback store."""


def configure_env() -> None:
    """Process-wide MLflow settings: no telemetry; fail fast against a dead server (the
    defaults retry for minutes) unless the user chose otherwise."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


def tracking_uri(root: str | Path) -> str:
    """``$MLFLOW_TRACKING_URI`` or the project's local sqlite store."""
    return os.environ.get(TRACKING_URI_ENV) or sqlite_uri(Path(root) / "mlflow.db")


def fallback_uri(root: str | Path) -> str:
    return sqlite_uri(Path(root) / FALLBACK_DIR / "mlflow.db")


def sqlite_uri(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"


def experiment_name(task: str, corpus: str, prefix: str = "hiertx") -> str:
    return f"{prefix}/{task}/{corpus}"


def registered_model_name(model: str, corpus: str) -> str:
    return f"hiertx-{model}-{corpus}"


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


def git_commit(root: str | Path) -> str:
    """``HEAD``'s commit (``+dirty`` if the tree has changes), or ``unknown``."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return "unknown"
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


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
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{tag}` = '{value}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0] if runs else None


def _create_run(
    client: Any, experiment: str, run_name: str, tags: Mapping[str, str], resume_key: str | None
) -> str:
    exp_id = _experiment_id(client, experiment)
    if resume_key is not None:
        found = _find_run(client, exp_id, TAG_RUN_KEY, resume_key)
        if found is not None and found.info.status != "FINISHED":
            client.update_run(found.info.run_id, status="RUNNING")
            return str(found.info.run_id)
    all_tags = {**tags, **({TAG_RUN_KEY: resume_key} if resume_key else {})}
    return str(client.create_run(exp_id, run_name=run_name, tags=all_tags).info.run_id)


class Tracker:
    """Logs to one MLflow run; never lets a tracking failure stop training.

    Every call is journaled; on the first failure the tracker warns once, opens (or
    finds) the fallback run, replays the journal there and carries on there.
    """

    def __init__(self, ref: RunRef, tags: Mapping[str, str] | None = None) -> None:
        self.ref = ref
        self.tags = dict(tags or {})
        self.journal: list[Op] = []
        self.fell_back = False
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
    ) -> Tracker:
        """A new run (or the unfinished run tagged ``resume_key``) in ``experiment``."""
        configure_env()
        tags = {**(tags or {}), **({TAG_PARENT: parent_run_id} if parent_run_id else {})}
        try:
            run_id = _create_run(_client(uri), experiment, run_name, tags, resume_key)
            tracker = cls(RunRef(uri, run_id, experiment, run_name, fallback), tags)
        except Exception as err:
            _warn(uri, err)
            run_id = _create_run(_client(fallback), experiment, run_name, tags, resume_key)
            tracker = cls(RunRef(fallback, run_id, experiment, run_name, fallback), tags)
            tracker.fell_back = True
        # journaled (already applied): a later fallback run gets the creation tags too
        tracker.journal.append(_tag_op(tags))
        return tracker

    @property
    def run_id(self) -> str:
        return self.ref.run_id

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
        from mlflow.entities import Param

        flat = flatten(params)
        items = [Param(k, v[:6000]) for k, v in sorted(flat.items())]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            chunk = items[i : i + 100]
            self._do(lambda c, r, chunk=chunk: c.log_batch(r, params=chunk))

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

    def end_children(self, status: str = "KILLED") -> int:
        """Mark child runs still RUNNING (trials stopped by the scheduler, whose process
        was killed before it could end its run) as ``status``; returns how many."""

        def op(client: Any, run_id: str) -> int:
            exp_id = client.get_run(run_id).info.experiment_id
            runs = client.search_runs(
                [exp_id],
                filter_string=f"tags.`{TAG_PARENT}` = '{run_id}' and attributes.status = 'RUNNING'",
            )
            for run in runs:
                client.set_terminated(run.info.run_id, status)
            return len(runs)

        return int(self._do(op) or 0)

    def end(self, status: str = "FINISHED") -> None:
        self._do(lambda c, r: c.set_terminated(r, status))

    def artifact_uri(self) -> str:
        return str(_client(self.ref.uri).get_run(self.ref.run_id).info.artifact_uri)


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
