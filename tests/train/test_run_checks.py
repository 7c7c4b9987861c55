"""The rules that need a run's step count (``pipeline.train.run_checks``), checked once the
loop has planned its epochs and before its first step; the tune stage checks its trials'
before Ray starts; a run that patience stopped before averaging says so in its record.
The params check decides what it can without the data: ``tests/plan/test_knobs.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import RunParams
from pipeline.errors import ConfigError
from pipeline.plan import RunRequest, checked, plan_training
from pipeline.train.checkpoint import CHECKPOINT_FILE
from pipeline.train.loop import train_local
from pipeline.train.run_checks import planned_step_notes
from pipeline.train.training import train_plan
from pipeline.train.tuning import tune_run
from tests.train.conftest import stage_params
from tests.train.test_loop import make_job

SOURCES = {"epochs": "train.defaults.epochs", "max_steps": "train.defaults.max_steps"}


def _refusal(batches: int, **knobs: object) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        planned_step_notes(RunParams.model_validate(knobs), batches, SOURCES, "train x")
    return err.value


def test_averaging_that_max_steps_would_cut_off_is_refused_at_the_planned_steps() -> None:
    """Probe 3: 4 epochs of 4 steps, the last averaged: max_steps 6 ends the run first."""
    averaged = {"epochs": 4, "averaging": {"kind": "uniform", "epochs": 1}}
    err = _refusal(4, max_steps=6, **averaged)
    assert err.key == "train.defaults.max_steps"
    assert err.reason == (
        "train x: 6 ends the run before averaging (the last epoch of train.defaults.epochs = "
        "4) begins at step 12 (epoch 4 of 4, 4 steps an epoch): the run would never average. "
        "Raise max_steps above 12, remove it, or average more epochs"
    )
    assert (
        planned_step_notes(RunParams.model_validate({**averaged, "max_steps": 13}), 4, {}, "") == []
    )
    assert planned_step_notes(RunParams.model_validate(averaged), 1, {}, "") == []  # 7 > 3 steps


def test_averaging_before_the_warm_up_ends_or_at_lr_0_is_refused_at_the_planned_steps() -> None:
    averaged = {"epochs": 4, "averaging": {"kind": "uniform", "epochs": 2}}
    err = _refusal(8, schedule={"kind": "linear_warmup", "warmup_steps": 20}, **averaged)
    assert err.key == "averaging.epochs"  # no params key known: the knob's own name
    assert "begins at step 16 (epoch 3 of 4, 8 steps an epoch), before the warm-up ends" in (
        err.reason
    )
    assert "trains at 0.85 x optimizer.lr" in err.reason
    cosine = {"kind": "cosine", "warmup_steps": 4, "decay_steps": 12}  # min_lr 0 at step 12
    err = _refusal(8, schedule=cosine, **averaged)
    assert err.key == "schedule.min_lr"
    assert "reaches schedule.min_lr = 0 at step 12 (schedule.decay_steps = 12)" in err.reason
    assert (
        planned_step_notes(
            RunParams.model_validate({**averaged, "schedule": {**cosine, "decay_steps": 18}}),
            8,
            {},
            "",
        )
        == []
    )


def test_a_cosine_left_to_a_run_shorter_than_its_warm_up_is_refused() -> None:
    """Probe 4 without ``max_batches_per_epoch``: only the data tells the run's length."""
    err = _refusal(4, epochs=1, schedule={"kind": "cosine"})
    assert err.key == "schedule.warmup_steps"
    assert "4 (1 epoch, 4 steps an epoch), which do not exceed schedule.warmup_steps = 1000" in (
        err.reason
    )


def test_patience_that_may_stop_a_run_before_averaging_is_said_at_the_start() -> None:
    knobs = {"epochs": 4, "averaging": {"kind": "uniform", "epochs": 1}, "eval_every": 2}
    (note,) = planned_step_notes(
        RunParams.model_validate({**knobs, "patience": 3}), 4, {"patience": "p.patience"}, ""
    )
    assert note.startswith(
        "p.patience = 3 may stop this run before averaging begins at step 12: 6 validations "
        "come before it, and 3 in a row without improvement stop the run"
    )
    assert planned_step_notes(RunParams.model_validate({**knobs, "patience": 6}), 4, {}, "") == []
    assert (
        planned_step_notes(RunParams.model_validate({**knobs, "patience": None}), 4, {}, "") == []
    )


def test_the_loop_refuses_before_its_first_step(tmp_path: Path) -> None:
    job = make_job(tmp_path, epochs=4, max_steps=6, averaging={"kind": "uniform", "epochs": 1})
    with pytest.raises(ConfigError, match="6 ends the run before averaging"):
        train_local(job)  # 32 examples of 4: 8 steps an epoch
    assert not (tmp_path / "run" / CHECKPOINT_FILE).exists()


def test_a_run_patience_stopped_before_averaging_says_so_in_its_record(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = stage_params(tracking={"enabled": False})
    raw["train"]["defaults"] |= {
        "epochs": 3,
        "max_batches_per_epoch": 2,
        "eval_every": 1,
        "patience": 1,
        "min_delta": 100.0,  # no validation after the first improves
        "averaging": {"kind": "uniform", "epochs": 1},
    }
    plan = plan_training(RunRequest.of(checked(raw), "transformer-chitchat"), project)
    plan = plan.model_copy(update={"storage": str(tmp_path)})
    seed = train_plan(plan, show_progress=False)
    assert (seed.averaged_steps, seed.stop_reason) == (0, "early_stopping")
    assert seed.averaging_never_began and seed.metric("steps") == 2
    assert "transformer-chitchat (seed 1234): averaging never began: the run stopped (early " in (
        capsys.readouterr().err
    )


def test_the_tune_stage_checks_its_trials_before_ray_starts(project: Path) -> None:
    """A cosine left to the trials' steps: 1 epoch of about 25 steps, warm-up 1000."""
    raw = stage_params(tracking={"enabled": False})
    raw["train"]["defaults"] |= {"max_batches_per_epoch": None, "epochs": 100}
    raw["train"]["models"]["transformer"]["schedule"] = {"kind": "cosine"}
    raw["tune"] = {
        "runs": raw["train"].pop("runs"),
        "epochs_per_trial": 1,
        "spaces": {"transformer": {"model": {"dropout": {"kind": "float", "low": 0, "high": 0.5}}}},
    }
    request = RunRequest.of(checked(raw), "transformer-chitchat", search=True)
    with pytest.raises(ConfigError) as err:
        tune_run(request, project)
    assert err.value.key == "train.models.transformer.schedule.warmup_steps"
    assert err.value.reason.startswith(
        "the trials of tuned run transformer-chitchat: the cosine decays over the run's "
        "planned steps (schedule.decay_steps: null), "
    )
    assert " (1 epoch, " in err.value.reason and " steps an epoch), which do not exceed " in (
        err.value.reason
    )


def test_a_warm_up_that_outlasts_the_planned_steps_is_refused() -> None:
    """2 epochs of 4 steps under a Noam or linear warm-up of 8: the run ends as the
    learning rate first reaches its peak; of 7 it passes it."""
    for kind in ("noam", "linear_warmup"):
        err = _refusal(4, epochs=2, schedule={"kind": kind, "warmup_steps": 8})
        assert err.key.endswith("schedule.warmup_steps")
        assert "the run's 8 planned steps (2 epochs, 4 steps an epoch) end before" in err.reason
        schedule = {"kind": kind, "warmup_steps": 7}
        assert planned_step_notes(RunParams.model_validate({"epochs": 2, "schedule": schedule}),
                                  4, SOURCES, "train x") == []  # fmt: skip


def test_the_train_stage_refuses_before_its_mlflow_run_and_names_the_run_once(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A linear warm-up of 1000 steps over 1 epoch of about 25: the params check cannot
    tell (whole epochs), the stage refuses before it opens the seed's MLflow run (no FAILED
    run left behind) and before any checkpoint; the error does not name the run, which
    the stage's message (``train <run>: ...``) names."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    raw = stage_params()
    raw["train"]["defaults"] |= {"max_batches_per_epoch": None, "epochs": 1}
    raw["train"]["models"]["transformer"]["schedule"] = {"kind": "linear_warmup"}
    request = RunRequest.of(checked(raw), "transformer-chitchat")
    plan = plan_training(request, project).model_copy(update={"storage": str(tmp_path / "s")})
    with pytest.raises(ConfigError) as err:
        train_plan(plan, show_progress=False)
    assert err.value.key == "train.models.transformer.schedule.warmup_steps"
    assert err.value.reason.startswith("the run's ")
    assert "transformer-chitchat" not in str(err.value)
    assert not (tmp_path / "s" / plan.name).exists()
    client = mlflow.tracking.MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert not experiments or client.search_runs(experiments) == []
