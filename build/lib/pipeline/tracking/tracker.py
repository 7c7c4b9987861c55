"""Logging to one MLflow run from any process, never letting a tracking failure stop
training.

- What: a run per training (Tune trials: child runs of one parent run), flattened params,
  git commit, the dvc.lock hashes of the inputs, system info, metrics, the vocabulary,
  the final checkpoint, sample generations, and the final model as a pyfunc (logged by the
  training code through :meth:`Tracker.call`) registered as ``hiertx-<run key>``.
- Never in the way: if the tracking server cannot be reached (at the start or mid-run),
  the :class:`Tracker` warns once and continues in a local fallback store
  (``<project>/runs/mlflow-fallback``), replaying everything it had logged, so nothing is
  lost. A fallback run carries the tag ``hiertx.origin_run_id``; every process that falls
  back (driver, rank-0 worker) finds and shares the same fallback run. When the run ends,
  the run it stands in for is marked FAILED (if the server answers again) and tagged with
  the fallback run's id; ``python -m pipeline sync-mlflow`` copies fallback runs to the
  server (``pipeline.tracking.sync``).
- Re-runs: a run is found again by its run key tag (:meth:`Tracker.start` ``resume_key``),
  so a training resumed from its checkpoint (even a finished one) goes on in the run that
  holds its history instead of starting an empty one. The training loop's metrics
  (:attr:`Tracker.sink`) are logged once per step: a run killed after step 114 and resumed
  from its checkpoint of step 100 recomputes steps 101-114 exactly, and the steps its
  history already holds are not logged again (MLflow cannot delete a point of a history).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.tracking import describe
from pipeline.tracking.store import (
    CURVES,
    TAG_CHANGED_PARAM,
    TAG_FALLBACK_RUN,
    TAG_ORIGIN,
    TAG_PARENT,
    TAG_RUN_KEY,
    TAG_TRIAL,
    TrackingUnavailable,
    configure_env,
    experiment_id,
    find_run,
    flatten,
    local_store_exists,
    mlflow_client,
    patiently,
    waiting_notice,
)

Reuse = Literal["unfinished", "any", "never"]

# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunRef:
    """How any process (a Ray worker, a Tune trial) reaches a run: picklable."""

    uri: str
    run_id: str
    experiment: str
    run_name: str
    fallback_uri: str
    section: str = ""  # the chart section its metrics go to (describe.section_key)
    # log a key only at steps after the last one the run's history holds for it
    once_per_step: bool = False

    def attach(self) -> Tracker:
        return Tracker(self)


Op = Callable[[Any, str], Any]  # (MlflowClient, run_id) -> result


@dataclass(frozen=True)
class Place:
    """Where a run goes: its experiment, that experiment's tags (kind, description) and the
    name a store may still hold it under (renamed on first use)."""

    experiment: str
    tags: Mapping[str, str]
    formerly: str | None = None

    def id_in(self, client: Any) -> str:
        return experiment_id(client, self.experiment, self.tags, self.formerly)


def _open_run(
    client: Any,
    place: Place,
    run_name: str,
    tags: Mapping[str, str],
    resume_key: str | None,
    reuse: Reuse,
) -> str:
    """The run tagged ``resume_key`` (reopened) if ``reuse`` allows it, else a new run."""
    exp_id = place.id_in(client)
    if resume_key is not None and reuse != "never":
        found = find_run(client, exp_id, TAG_RUN_KEY, resume_key)
        if found is not None and (reuse == "any" or found.info.status != "FINISHED"):
            client.update_run(found.info.run_id, status="RUNNING")
            # e.g. the commit that goes on with it; a description edited in the UI stays
            kept = {describe.NOTE} & set(found.data.tags)
            _tag_op({k: v for k, v in tags.items() if k not in kept})(client, found.info.run_id)
            return str(found.info.run_id)
    return str(client.create_run(exp_id, run_name=run_name, tags=dict(tags)).info.run_id)


def _inherited(client: Any, parent_run_id: str | None) -> dict[str, str]:
    """What a child run (a Tune trial) takes from its parent: the source tags (the DVC stage
    and commit that made the search)."""
    if parent_run_id is None:
        return {}
    parent = client.get_run(parent_run_id).data.tags
    return {k: parent[k] for k in describe.SOURCE_TAGS if k in parent}


def _stand_in(client: Any, fallback: str, experiment: str, key: str) -> tuple[str, str | None]:
    """Where the history of the run keyed ``key`` is when a fallback run holds it: that
    fallback run's id and the id of the (partial) run it stands in for on ``client``'s
    store, or ``("", None)`` when the store ``client`` reaches holds it."""
    if fallback == client.tracking_uri or not local_store_exists(fallback):
        return "", None
    local = mlflow_client(fallback)
    local_exp = local.get_experiment_by_name(experiment)
    if local_exp is None:
        return "", None
    exp = client.get_experiment_by_name(experiment)
    found = None if exp is None else find_run(client, exp.experiment_id, TAG_RUN_KEY, key)
    if found is None:  # started while the server was down: only the fallback store has it
        keyed = find_run(local, local_exp.experiment_id, TAG_RUN_KEY, key)
        return ("", None) if keyed is None else (str(keyed.info.run_id), None)
    twin = find_run(local, local_exp.experiment_id, TAG_ORIGIN, found.info.run_id)
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

    def __init__(
        self, ref: RunRef, tags: Mapping[str, str] | None = None, place: Place | None = None
    ) -> None:
        self.ref = ref
        self.tags = dict(tags or {})
        # where a fallback run goes (a process attached by RunRef knows only the name)
        self.place = place or Place(
            ref.experiment,
            describe.experiment_tags(describe.describe_experiment(ref.experiment, self.tags)),
        )
        self.journal: list[Op] = []
        self.fell_back = False
        self.origin: RunRef | None = None  # after a fallback: the server run left behind
        self._last_result: Any = None
        self._last_steps: dict[str, dict[str, int]] = {}  # run id -> key -> last step logged

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
        description: str | None = None,
        source: str | None = None,
        experiment_description: str | None = None,
        former_experiment: str | None = None,
    ) -> Tracker:
        """A run in ``experiment``, tagged ``resume_key``; ``reuse`` says when an earlier run
        with that key goes on instead of a new one: ``"unfinished"`` (not FINISHED),
        ``"any"`` (a training resuming from its checkpoint, even a finished one: its history
        is in that run; where a fallback run holds it, that one goes on) or ``"never"``.

        What the MLflow UI shows (``pipeline.tracking.describe``): the run's ``description``
        and ``source`` (the DVC stage that made it; a child run takes its parent's), the
        experiment's kind and ``experiment_description`` (defaults from the hiertx tags);
        a store holding the experiment as ``former_experiment`` renames it."""
        configure_env()
        given = dict(tags or {})
        tags = {
            **describe.run_tags(given, run_name, source, description),
            **({TAG_PARENT: parent_run_id} if parent_run_id else {}),
            **({TAG_RUN_KEY: resume_key} if resume_key else {}),
        }
        place = Place(
            experiment,
            describe.experiment_tags(
                experiment_description or describe.describe_experiment(experiment, tags)
            ),
            former_experiment,
        )
        tracker: Tracker | None = None
        try:
            client = mlflow_client(uri)
            if parent_run_id is not None and source is None:
                # one read per child run: its parent's source, unless its caller named one
                inherited = _inherited(client, parent_run_id)
                tags.update({k: v for k, v in inherited.items() if k not in given})
            if reuse == "any" and resume_key is not None:
                run_id, origin = _stand_in(client, fallback, experiment, resume_key)
                if run_id:
                    tracker = cls(
                        RunRef(fallback, run_id, experiment, run_name, fallback), tags, place
                    )
                    local = mlflow_client(fallback)
                    local.update_run(run_id, status="RUNNING")
                    _tag_op(tags)(local, run_id)
                    tracker.fell_back = True
                    if origin is not None:
                        tracker.origin = RunRef(uri, origin, experiment, run_name, fallback)
            if tracker is None:
                with waiting_notice(uri):
                    run_id = patiently(
                        lambda: _open_run(client, place, run_name, tags, resume_key, reuse)
                    )
                tracker = cls(RunRef(uri, run_id, experiment, run_name, fallback), tags, place)
        except Exception as err:
            _warn(uri, err)
            run_id = _open_run(mlflow_client(fallback), place, run_name, tags, resume_key, reuse)
            tracker = cls(RunRef(fallback, run_id, experiment, run_name, fallback), tags, place)
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
        workers, where rank 0 attaches to this run): into the chart section ``curves``,
        which the MLflow UI shows first (``describe``), each step of a key once (a resumed
        training recomputes the steps after its checkpoint: module docstring)."""
        return dataclasses.replace(self.ref, section=CURVES, once_per_step=True).attach

    # ----------------------------------------------------------------- core

    def _do(self, op: Op) -> Any:
        self.journal.append(op)
        if self.fell_back:
            return op(mlflow_client(self.ref.uri), self.ref.run_id)
        try:
            with waiting_notice(self.ref.uri):
                return patiently(lambda: op(mlflow_client(self.ref.uri), self.ref.run_id))
        except Exception as err:
            _warn(self.ref.uri, err)
            self._fall_back()
            return self._last_result

    def _fall_back(self) -> None:
        client = mlflow_client(self.ref.fallback_uri)
        exp_id = self.place.id_in(client)
        found = find_run(client, exp_id, TAG_ORIGIN, self.ref.run_id)
        if found is not None:
            run_id = str(found.info.run_id)
        else:
            tags = {**self.tags, TAG_ORIGIN: self.ref.run_id}
            run_id = str(
                client.create_run(exp_id, run_name=self.ref.run_name, tags=tags).info.run_id
            )
        self.origin = self.ref
        self.ref = dataclasses.replace(self.ref, uri=self.ref.fallback_uri, run_id=run_id)
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
        section = self.ref.section
        items = [
            Metric(describe.section_key(k, section), float(v), now, step)
            for k, v in metrics.items()
        ]
        if self.ref.once_per_step:
            self._do(lambda c, r: self._log_new_steps(c, r, items))
        else:
            self._do(lambda c, r: c.log_batch(r, metrics=items))

    def _log_new_steps(self, client: Any, run_id: str, items: list[Any]) -> None:
        """Log the ``items`` whose step is after the last one run ``run_id`` holds for their
        key: read from its history once per run (the fallback run has its own), then kept."""
        last = self._last_steps.get(run_id)
        if last is None:
            last = self._last_steps[run_id] = _last_steps(client, run_id)
        new = [m for m in items if m.step > last.get(m.key, -1)]
        if new:
            client.log_batch(run_id, metrics=new)
            last.update((m.key, m.step) for m in new)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        local = str(Path(path).resolve())
        self._do(lambda c, r: c.log_artifact(r, local, artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._do(lambda c, r: c.log_text(r, text, artifact_file))

    def log_dict(self, value: dict[str, Any], artifact_file: str) -> None:
        self._do(lambda c, r: c.log_dict(r, value, artifact_file))

    def call(self, op: Op) -> Any:
        """Run ``op(client, run_id)`` against this run's store, journaled like every log
        call (a fallback replays it): what the training code logs beyond metrics and files,
        e.g. its pyfunc model (``serving.log_pyfunc``). Returns ``op``'s result."""
        return self._do(op)

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
                client = mlflow_client(origin.uri)
                client.set_tag(origin.run_id, TAG_FALLBACK_RUN, self.run_id)
                client.set_terminated(origin.run_id, "FAILED")
            except Exception:  # still unreachable
                self.origin = origin

    def _fallback_twin_exists(self) -> bool:
        """Whether another process of this run fell back (a fallback run stands in for it)."""
        fallback = self.ref.fallback_uri
        if fallback == self.ref.uri or not local_store_exists(fallback):
            return False
        try:
            client = mlflow_client(fallback)
            exp = client.get_experiment_by_name(self.ref.experiment)
            return exp is not None and (
                find_run(client, exp.experiment_id, TAG_ORIGIN, self.run_id) is not None
            )
        except Exception:  # a broken local store must not fail the run's end
            return False


def _last_steps(client: Any, run_id: str) -> dict[str, int]:
    """The last step of each key in run ``run_id``'s history (none in a new run)."""
    keys = client.get_run(run_id).data.metrics
    return {k: max(m.step for m in client.get_metric_history(run_id, k)) for k in keys}


def _tag_op(tags: Mapping[str, str]) -> Op:
    from mlflow.entities import RunTag

    items = [RunTag(k, str(v)) for k, v in tags.items()]
    return lambda c, r: c.log_batch(r, tags=items)


def _warn(uri: str, err: Exception) -> None:
    warnings.warn(
        f"MLflow tracking at {uri} failed ({type(err).__name__}: {err}); continuing in the "
        "local fallback store (runs/mlflow-fallback): nothing is lost. When the store "
        "answers again, copy these runs into it with `python -m pipeline sync-mlflow`",
        TrackingUnavailable,
        stacklevel=3,
    )
