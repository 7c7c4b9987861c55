"""Ray Tune over the same training loop: Optuna's TPE proposes, ASHA stops poor trials.

Each trial trains ``tune.epochs_per_trial`` epochs of the search plan's knobs with the
sampled model-config and optimizer values, reporting the validation loss after every epoch.
Trials run the loop in the trial process (``train.scale.num_workers: 0``) or start a
``TorchTrainer`` of their own (Ray Train V2 inside a function trainable, reporting through
``TuneReportCallback``; ``Tuner(TorchTrainer)`` no longer exists). Every trial is an MLflow
child run of one parent run. The search is named after its inputs and lives under the
storage path: running it again resumes it (``Tuner.restore``), finished trials included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.artifacts import TuneRecord
from pipeline.cluster import use_gpu
from pipeline.config import SearchDim, SearchKind, SearchSpace, TuneParams
from pipeline.config.tune import sampled_model, trial_params
from pipeline.errors import ConfigError
from pipeline.machine import cpu_threads, default_device
from pipeline.plan import RunPlan
from pipeline.tracking import TAG_TRIAL, NullTracker, RunRef, Tracker
from pipeline.train.checkpoint import TrainingState
from pipeline.train.context import DataFactory, ValidationScore
from pipeline.train.distributed import read_checkpoint, report_with_checkpoint, trainer
from pipeline.train.loop import TrainJob, train_worker

# --------------------------------------------------------------------------- space


def _dimension(dim: SearchDim) -> Any:
    from ray import tune

    low, high = dim.low, dim.high
    if dim.kind == SearchKind.CHOICE:
        return tune.choice(list(dim.choices or ()))
    assert low is not None and high is not None
    if dim.kind == SearchKind.INT:
        step = int(dim.step or 1)
        return (
            tune.qrandint(int(low), int(high), step)
            if step > 1
            else tune.randint(int(low), int(high) + 1)
        )
    if dim.kind == SearchKind.LOG_FLOAT:
        return tune.loguniform(low, high)
    return tune.quniform(low, high, dim.step) if dim.step else tune.uniform(low, high)


def param_space(space: SearchSpace) -> dict[str, dict[str, Any]]:
    """The Tune search space: ``{"model": {field: dim}, "optimizer": {field: dim}}``, and
    ``"per_head"`` when the space has it (absent otherwise, so a search saved before
    ``per_head`` existed restores with the same space)."""
    out = {
        "model": {k: _dimension(d) for k, d in space.model.items()},
        "optimizer": {k: _dimension(d) for k, d in space.optimizer.items()},
    }
    if space.per_head:
        out["per_head"] = {k: _dimension(d) for k, d in space.per_head.items()}
    return out


# --------------------------------------------------------------------------- trials


class TuneContext:
    """The loop's view of a Ray Tune function trial running in-process (one worker)."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.device = default_device()

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def stop_requested(self) -> int | None:
        return None  # Ray Tune stops its trials, and resumes them from its checkpoints

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def latest_checkpoint(self) -> TrainingState | None:
        from ray import tune

        checkpoint = tune.get_checkpoint()
        return None if checkpoint is None else read_checkpoint(checkpoint)

    def report(self, metrics: dict[str, float], checkpoint: TrainingState | None) -> None:
        from ray import tune

        report_with_checkpoint(tune.report, tune.Checkpoint, metrics, checkpoint)


@dataclass(frozen=True)
class TrialSetup:
    """What every trial shares (shipped to trial processes by ``tune.with_parameters``):
    the search's plan, the factories its trials build from, and the parent MLflow run."""

    plan: RunPlan
    model_factory: Any  # (name, sampled RunParams) -> ModelFactory; raises ConfigError
    data: DataFactory
    parent: RunRef | None
    tags: dict[str, str] = field(default_factory=dict)
    validation_score: ValidationScore | None = None  # when the plan's select_by reads one

    @property
    def tune(self) -> TuneParams:
        assert self.plan.search is not None, "a search plan has its search knobs"
        return self.plan.search


def run_trial(config: dict[str, Any], setup: TrialSetup) -> None:
    """One trial (a Tune function trainable)."""
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    plan = setup.plan
    params = trial_params(plan.knobs, setup.tune, config)
    tracker: Tracker | NullTracker = NullTracker()
    if setup.parent is not None:
        p = setup.parent
        tracker = Tracker.start(
            p.uri,
            p.fallback_uri,
            p.experiment,
            run_name=f"trial-{trial_id}",
            tags={**setup.tags, TAG_TRIAL: trial_id},
            parent_run_id=p.run_id,
            resume_key=f"{plan.name}-{trial_id}",  # the full identity, as the parent's
        )
        tracker.log_params({"sampled": config, "train": params.model_dump(mode="json")})
    try:
        model = setup.model_factory(plan.model, params)
    except ConfigError as err:
        # an invalid combination (e.g. heads not dividing the width): worst possible score
        tracker.set_tags({"hiertx.invalid_config": str(err)})
        tracker.end("FAILED")
        select = plan.knobs.select_by
        worst = -math.inf if select.higher_is_better else math.inf
        tune.report({select.metric: worst, "invalid": 1.0})
        return
    job = TrainJob(
        name=f"trial-{trial_id}",
        model_name=plan.model,
        model=model,
        data=setup.data,
        params=params,
        run_dir=plan.storage,
        sink=tracker.sink,
        show_progress=False,
        validation_score=setup.validation_score,
    )
    try:
        if plan.workers == 0:
            with cpu_threads(setup.tune.cpus_per_trial):
                train_worker(job, TuneContext())
        else:
            from ray.tune.integration.ray_train import TuneReportCallback

            callbacks = [TuneReportCallback()]
            trainer(job, plan.workers, plan.placement, plan.storage, callbacks).fit()
    except SystemExit as stop:
        # Tune stops a trial it is done with (ASHA, the last epoch) by exiting its thread
        # right after a report: the trial completed
        tracker.end("FINISHED" if stop.code in (0, None) else "FAILED")
        raise
    except Exception:
        tracker.end("FAILED")
        raise
    except BaseException:  # interrupted (Ctrl-C)
        tracker.end("KILLED")
        raise
    tracker.end()


# --------------------------------------------------------------------------- search


@dataclass(frozen=True)
class SearchResult:
    best: dict[str, Any]  # the best trial's sampled values ({"model":..., "optimizer":...})
    valid_loss: float  # at the best trial's best evaluation (of select_by)
    trial_id: str
    n_trials: int
    n_errors: int
    trial_status: dict[str, str] = field(default_factory=dict)  # trial id -> MLflow status
    valid_score: float | None = None  # likewise, when select_by is a score

    def record(self, model: str, corpus: str, search: str, parent_run_id: str | None) -> TuneRecord:
        """The stage's output record (``data/tune/<key>/best.json``)."""
        return TuneRecord(
            model=model,
            corpus=corpus,
            search=search,
            parent_run_id=parent_run_id,
            config=sampled_model(self.best),
            optimizer=self.best.get("optimizer", {}),
            valid_loss=self.valid_loss,
            valid_score=self.valid_score,
            trial_id=self.trial_id,
            trials=self.n_trials,
            errored_trials=self.n_errors,
        )


def search(setup: TrialSetup, show_progress: bool = True) -> SearchResult:
    """Run (or resume) the search of ``setup.plan`` under its storage; Ray must be
    initialised. Progress: a line per finished trial, or a bar on a terminal
    (``tune_progress``)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    from pipeline.train.tune_progress import TrialProgress, reporting

    plan, t = setup.plan, setup.tune
    select, name = plan.knobs.select_by, plan.name
    assert plan.space is not None, "a search plan has its space"
    # A TorchTrainer trial only coordinates: its workers hold the resources. Tune needs
    # some resource in a trial's request; a byte of memory holds nothing back, where a
    # fraction of a CPU would leave a 1-CPU node unable to host a 1-CPU worker.
    resources = {"CPU": t.cpus_per_trial} if plan.workers == 0 else {"CPU": 0, "memory": 1}
    if plan.workers == 0 and use_gpu(plan.placement):
        # a trial that trains in its own process holds its GPU share: Ray leaves a trial
        # without one every GPU, and the trials of concurrent stages would share cuda:0
        resources["GPU"] = plan.placement.gpus_per_worker
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), resources)
    space_dict = param_space(plan.space)
    path = f"{plan.storage.rstrip('/')}/{name}"
    if tune.Tuner.can_restore(path):
        tuner = tune.Tuner.restore(
            path, trainable=trainable, resume_errored=True, param_space=space_dict
        )
    else:
        import optuna

        tuner = tune.Tuner(
            trainable,
            param_space=space_dict,
            tune_config=tune.TuneConfig(
                metric=select.metric,
                mode=select.mode,
                search_alg=OptunaSearch(sampler=optuna.samplers.TPESampler(seed=t.seed)),
                scheduler=ASHAScheduler(
                    time_attr="training_iteration",
                    max_t=t.epochs_per_trial,
                    grace_period=min(t.grace_period, t.epochs_per_trial),
                    reduction_factor=t.reduction_factor,
                ),
                num_samples=t.trials,
                max_concurrent_trials=t.concurrency,
            ),
            # our progress replaces Ray's tables (verbose=0); Ray keeps both with the search
            run_config=tune.RunConfig(
                name=name, storage_path=plan.storage, verbose=0, callbacks=[TrialProgress()]
            ),
        )
    with reporting(plan.label, t.trials, t.epochs_per_trial, select, show_progress):
        grid = tuner.fit()
    metric = select.metric
    best = grid.get_best_result(
        metric=metric, mode=select.mode, scope="all", filter_nan_and_inf=True
    )
    if (
        best is None
        or best.metrics is None
        or not math.isfinite(best.metrics.get(metric, math.nan))
    ):
        raise RuntimeError(f"tune search {name}: no trial produced a finite {metric}")
    # the best trial's best evaluation (scope "all"), not its last
    at = best.metrics
    frame = best.metrics_dataframe
    if frame is not None and metric in frame and len(frame):
        row = frame[metric].idxmax() if select.higher_is_better else frame[metric].idxmin()
        at = frame.loc[row].to_dict()
    return SearchResult(
        best=dict(best.config),
        valid_loss=float(at["valid_loss"]),
        valid_score=float(at[metric]) if select.higher_is_better else None,
        trial_id=str(best.metrics.get("trial_id", "")),
        n_trials=len(grid),
        n_errors=len(grid.errors),
        trial_status=trial_statuses(grid),
    )


def trial_statuses(grid: Any) -> dict[str, str]:
    """What Ray reports of each trial as an MLflow run status: FAILED for a trial that
    errored, FINISHED for every other (completed, or stopped early by the scheduler). A
    trial that never reported has no id in its result and is left out."""
    out = {}
    for result in grid:
        trial_id = (result.metrics or {}).get("trial_id")
        if trial_id:
            out[str(trial_id)] = "FAILED" if result.error is not None else "FINISHED"
    return out


def search_exists(name: str, storage: str) -> bool:
    """Whether the search ``name`` has run before under ``storage`` (:func:`search` will
    restore it, finished trials included, rather than start over)."""
    from ray import tune

    return bool(tune.Tuner.can_restore(f"{storage.rstrip('/')}/{name}"))
