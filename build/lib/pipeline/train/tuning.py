"""The tune stage's logic: a run's search plan -> Ray Tune search -> ``best.json``.

The search (``search.search``: Optuna TPE + ASHA over the training loop) is named after
its plan's identity and lives under the storage path, so running the stage again resumes
it. Its MLflow parent run holds the search's knobs and space; each trial is a child run.
The best trial is written as the :class:`~pipeline.artifacts.TuneRecord` that the run's
``train_tuned`` stage trains from.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import tracking
from pipeline.artifacts import BEST_FILE, TuneRecord
from pipeline.cluster import ray_cluster
from pipeline.config import trial_params
from pipeline.plan import RunPlan, RunRequest, plan_search
from pipeline.train.job import ConfiguredModel, shard_data, validation_score
from pipeline.train.run_checks import planned_step_notes
from pipeline.train.search import TrialSetup, search, search_exists
from pipeline.train.tracked import check_reachable, start_tracker


def tune_run(request: RunRequest, root: str | Path = ".", show_progress: bool = True) -> TuneRecord:
    """Search the hyper-parameters of the run ``request`` names; writes and returns the
    best trial's record (``data/tune/<key>/best.json``)."""
    plan = plan_search(request, root)
    assert plan.search is not None and plan.space is not None
    check_trials(plan)
    parent = start_tracker(plan, search_exists(plan.name, plan.storage))
    try:
        parent.log_params(
            {
                "train": plan.knobs.model_dump(mode="json"),
                "tune": plan.identity().search or {},
                "space": plan.space.model_dump(mode="json"),
            }
        )
        setup = TrialSetup(
            plan=plan,
            model_factory=ConfiguredModel(plan.sizes),
            data=shard_data(plan),
            validation_score=validation_score(plan),
            parent=parent.ref,
            tags={
                tracking.TAG_MODEL: plan.model,
                tracking.TAG_CORPUS: plan.corpus,
                tracking.TAG_STAGE: "tune",
            },
        )
        with ray_cluster():
            check_reachable(plan)
            result = search(setup, show_progress)
        best = result.record(
            model=plan.model, corpus=plan.corpus, search=plan.name, parent_run_id=parent.run_id
        )
        # Ray's verdict: a trial it reports completed is FINISHED, one that errored (or
        # never reported) FAILED
        parent.end_children(result.trial_status, default="FAILED")
        best_metrics = {"best_valid_loss": result.valid_loss}
        if result.valid_score is not None:
            best_metrics["best_valid_score"] = result.valid_score
        parent.log_metrics(best_metrics, step=0)
        parent.log_dict(best.model_dump(mode="json"), BEST_FILE)
        parent.end()
    except BaseException:
        parent.end("FAILED")
        raise
    best.write(plan.layout.tune_out(plan.key) / BEST_FILE)
    return best


def check_trials(plan: RunPlan) -> None:
    """The rules that need the step count (``run_checks``) for the search's trials, at the
    corpus' real batches an epoch, before Ray starts: else every trial would refuse."""
    assert plan.search is not None
    knobs = trial_params(plan.knobs, plan.search, {})  # no rule reads a sampled value
    train, _ = shard_data(plan, knobs)(0, max(plan.workers, 1))
    sources = {**plan.sources, "epochs": "tune.epochs_per_trial"}
    planned_step_notes(knobs, len(train), sources, f"the trials of tuned run {plan.key}")
