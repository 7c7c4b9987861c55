"""Ray Tune + Optuna + ASHA over the loop: search space, trials as MLflow child runs,
best config written, and a rerun resumes the finished search."""

from __future__ import annotations

import re

import mlflow
import pytest

from pipeline.artifacts import BEST_FILE, DataSizes, TuneRecord
from pipeline.config import RunParams, SearchSpace, Selection, TuneParams
from pipeline.errors import ConfigError
from pipeline.plan import RunRequest, checked, plan_search
from pipeline.train.job import ConfiguredModel
from pipeline.train.search import param_space, sampled_model, trial_params, trial_statuses
from pipeline.train.tuning import tune_run
from tests.train.conftest import stage_params

KEY = "transformer-chitchat"


def test_search_space_bounds_are_inclusive_and_typed():
    space = SearchSpace.model_validate(
        {
            "model": {
                "n_heads": {"kind": "int", "low": 2, "high": 3},
                "d_head": {"kind": "int", "low": 24, "high": 40, "step": 8},
                "dropout": {"kind": "float", "low": 0.1, "high": 0.8},
                "mask": {"kind": "choice", "choices": ["hier", "naacl"]},
            },
            "optimizer": {"lr": {"kind": "log_float", "low": 1e-5, "high": 1e-3}},
        }
    )
    dims = param_space(space)
    seen = {
        k: {dims["model"][k].sample() for _ in range(200)} for k in ("n_heads", "d_head", "mask")
    }
    assert seen == {"n_heads": {2, 3}, "d_head": {24, 32, 40}, "mask": {"hier", "naacl"}}
    lrs = [dims["optimizer"]["lr"].sample() for _ in range(100)]
    assert all(1e-5 <= v <= 1e-3 for v in lrs) and min(lrs) < 1e-4 < max(lrs)
    assert all(0.1 <= dims["model"]["dropout"].sample() <= 0.8 for _ in range(50))


def test_bad_search_dimensions_are_rejected():
    with pytest.raises(ValueError, match="low: must not exceed high"):
        SearchSpace.model_validate({"model": {"x": {"kind": "int", "low": 3, "high": 2}}})
    with pytest.raises(ValueError, match="not optimizer params"):
        SearchSpace.model_validate({"optimizer": {"lrr": {"kind": "float", "low": 0, "high": 1}}})


def test_trial_params_apply_the_sample_and_the_trial_budget():
    base = RunParams(epochs=30, patience=3, eval_every=100, model={"d_model": 16, "n_heads": 4},
                     averaging={"kind": "uniform", "epochs": 10})  # fmt: skip
    sampled = {"model": {"n_heads": 2}, "optimizer": {"lr": 0.01}}
    p = trial_params(base, TuneParams(epochs_per_trial=5), sampled)
    assert p.model == {"d_model": 16, "n_heads": 2} and p.optimizer.lr == 0.01
    assert (p.epochs, p.patience, p.eval_every) == (5, None, None)
    assert p.averaging.kind == "none"  # a whole run's last epochs: no trial has them


def test_per_head_sizes_multiply_the_sampled_heads_like_the_hier_authors_search():
    """search_params.py of bsantraigi/HIER: embedding = heads x 25..40, hidden = heads x
    10..40; the trial's config (and the record's) holds the products."""
    space = SearchSpace.model_validate(
        {
            "model": {"n_heads": {"kind": "int", "low": 2, "high": 8}},
            "per_head": {
                "d_model": {"kind": "int", "low": 25, "high": 40},
                "d_ff": {"kind": "int", "low": 10, "high": 40},
            },
        }
    )
    dims = param_space(space)
    assert set(dims) == {"model", "per_head", "optimizer"}
    assert {dims["per_head"]["d_model"].sample() for _ in range(300)} == set(range(25, 41))
    sampled = {"model": {"n_heads": 7}, "per_head": {"d_model": 25, "d_ff": 13}}
    assert sampled_model(sampled) == {"n_heads": 7, "d_model": 175, "d_ff": 91}
    p = trial_params(RunParams(model={"d_model": 100, "dropout": 0.1}), TuneParams(), sampled)
    assert p.model == {"d_model": 175, "dropout": 0.1, "n_heads": 7, "d_ff": 91}
    # a space without per_head keeps the space it always had (saved searches restore)
    assert set(param_space(SearchSpace(model=space.model))) == {"model", "optimizer"}


def test_per_head_needs_the_searched_heads_and_integer_sizes():
    heads = {"n_heads": {"kind": "int", "low": 2, "high": 8}}
    size = {"kind": "int", "low": 10, "high": 40}
    with pytest.raises(ValueError, match="per_head: multiplies the searched n_heads"):
        SearchSpace.model_validate({"model": {"dropout": size}, "per_head": {"d_ff": size}})
    with pytest.raises(ValueError, match=r"per_head: \['d_ff'\] are also searched"):
        SearchSpace.model_validate({"model": {**heads, "d_ff": size}, "per_head": {"d_ff": size}})
    with pytest.raises(ValueError, match=r"per_head\.d_ff: a size per head is an int"):
        SearchSpace.model_validate(
            {"model": heads, "per_head": {"d_ff": {"kind": "float", "low": 1, "high": 2}}}
        )


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_tune_stage_runs_trials_as_child_runs_writes_best_and_resumes(
    project, monkeypatch, capsys, on_ray_head
):
    uri = f"sqlite:///{project / 'mlflow-tune.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    raw = stage_params()
    raw["tune"] = {
        "runs": raw["train"].pop("runs"),
        "trials": 3,
        "concurrency": 2,
        "epochs_per_trial": 2,
        "reduction_factor": 2,
        "spaces": {
            "transformer": {
                "model": {
                    "n_heads": {"kind": "int", "low": 1, "high": 2},
                    "dropout": {"kind": "float", "low": 0.0, "high": 0.3},
                },
                "optimizer": {"lr": {"kind": "log_float", "low": 1e-3, "high": 1e-2}},
            }
        },
    }
    raw["train"]["defaults"]["max_batches_per_epoch"] = 2
    request = RunRequest.of(checked(raw), KEY, search=True)
    best = tune_run(request, project)
    # progress: a line per finished trial (captured stderr is a log), none of Ray's tables
    printed = capsys.readouterr()
    assert "Trial status" not in printed.out + printed.err
    finished = r"tune transformer-chitchat: trial [1-3]/3 \w+ (finished|stopped early by ASHA) "
    trial_lines = [line for line in printed.err.splitlines() if re.match(finished, line)]
    assert len(trial_lines) == 3 and all("model.n_heads=" in line for line in trial_lines)

    path = project / "data" / "tune" / "transformer-chitchat" / BEST_FILE
    assert TuneRecord.read(path) == best
    assert set(best.config) == {"n_heads", "dropout"} and set(best.optimizer) == {"lr"}
    assert best.trials == 3 and best.errored_trials == 0
    assert best.search == plan_search(request, project).name  # the Ray Tune run it resumes by
    assert (best.model, best.corpus) == ("transformer", "chitchat")

    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name("hiertx-generate-chitchat")
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if r.info.run_id == best.parent_run_id]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == best.parent_run_id]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    assert len(children) == 3
    # Ray reports every trial completed (ASHA stops some early): none is left KILLED
    assert [c.info.status for c in children] == ["FINISHED"] * 3
    assert parent[0].data.metrics["best_valid_loss"] == pytest.approx(best.valid_loss)
    losses = [
        min(m.value for m in client.get_metric_history(c.info.run_id, "curves/valid_loss"))
        for c in children
    ]
    assert min(losses) == pytest.approx(best.valid_loss)
    sampled = {
        (c.data.params["sampled.model.n_heads"], c.data.params["sampled.optimizer.lr"])
        for c in children
    }
    assert len(sampled) == 3  # TPE proposed three different configs

    # a rerun of the same search restores it: no new trials, same answer
    again = tune_run(request, project)
    assert again.config == best.config and again.valid_loss == best.valid_loss
    children = [
        r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("mlflow.parentRunId")
    ]
    assert len(children) == 3
    # the restored search goes on in the parent run that holds its trials
    assert again.parent_run_id == best.parent_run_id
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {best.parent_run_id}
    assert [c.info.status for c in children] == ["FINISHED"] * 3


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_a_search_on_a_score_keeps_its_highest_trial(project, tmp_path, on_ray_head):
    """``select_by`` a score: Optuna and ASHA maximise it and the record holds the best
    trial's (here a score that grows with the model: the widest trial must win)."""
    from pipeline.cluster import ray_cluster
    from pipeline.models import registry
    from pipeline.models.base import count_parameters
    from pipeline.train.job import shard_data
    from pipeline.train.search import TrialSetup, search
    from tests.train.conftest import TINY_TRANSFORMER
    from tests.train.helpers import ParameterCountScore

    raw = stage_params()
    raw["train"]["defaults"] |= {"epochs": 1, "max_batches_per_epoch": 1}
    raw["train"]["placement"] = {"storage_path": str(tmp_path)}
    raw["tune"] = {
        "runs": raw["train"].pop("runs"),
        "trials": 3,
        "epochs_per_trial": 1,
        "seed": 3,  # its three draws include d_ff 512
        "spaces": {"transformer": {"model": {"d_ff": {"kind": "choice", "choices": [8, 64, 512]}}}},
    }
    plan = plan_search(RunRequest.of(checked(raw), KEY, search=True), project)
    # chitchat has no MultiWOZ score (the params check says so): a score of the model's size
    knobs = plan.knobs.model_copy(update={"select_by": Selection.MULTIWOZ_SCORE})
    plan = plan.model_copy(update={"knobs": knobs})
    setup = TrialSetup(
        plan=plan,
        model_factory=ConfiguredModel(plan.sizes),
        data=shard_data(plan),
        parent=None,
        validation_score=ParameterCountScore(),
    )
    with ray_cluster():
        result = search(setup, show_progress=False)
    widest = registry.build("transformer", plan.sizes, **{**TINY_TRANSFORMER, "d_ff": 512})
    assert result.best["model"] == {"d_ff": 512}
    assert result.valid_score == count_parameters(widest)
    assert result.n_trials == 3 and result.n_errors == 0
    assert (tmp_path / plan.name).is_dir()  # the search lives under the plan's storage
    record = result.record("transformer", "chitchat", "score", None)
    assert record.config == {"d_ff": 512} and record.valid_score == result.valid_score


def test_a_sampled_config_that_does_not_validate_names_its_search_key():
    """A trial's sampled combination is validated at the corpus' sizes; the error names
    the space's key (``search.run_trial`` reports such a trial as invalid)."""
    factory = ConfiguredModel(DataSizes(vocab_size=100))
    with pytest.raises(ConfigError) as caught:
        factory("transformer", RunParams(model={"d_model": 16, "n_heads": 0}))
    assert caught.value.key == "tune.spaces.transformer.model.n_heads"
    built = factory("transformer", RunParams(model={"d_model": 16, "n_heads": 2, "d_head": 8}))
    assert built.config.vocab_size == 100 and built.config.n_heads == 2
    assert built().config == built.config


def test_trial_statuses_follow_what_ray_reports():
    from types import SimpleNamespace

    grid = [
        SimpleNamespace(metrics={"trial_id": "a", "valid_loss": 1.0}, error=None),
        SimpleNamespace(metrics={"trial_id": "b"}, error=RuntimeError("boom")),
        SimpleNamespace(metrics=None, error=RuntimeError("died before reporting")),
    ]
    assert trial_statuses(grid) == {"a": "FINISHED", "b": "FAILED"}
