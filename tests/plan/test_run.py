"""The run plan (``pipeline.plan.run``): what a train or tune stage reads of params for run
``<key>`` (``RunRequest``), what it will compute, decided and checked before any compute
(``plan_training``/``plan_search``), its seeds, and its identity: the name that a run
resumes by, which changes with whatever changes the result and nothing else."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest

from pipeline.artifacts import BEST_FILE, Layout, TuneRecord
from pipeline.config import parse_params
from pipeline.errors import ConfigError, DataError
from pipeline.names import Task
from pipeline.plan import SEED_STRIDE, RunPlan, RunRequest, checked, plan_search, plan_training
from tests.train.conftest import TINY_TRANSFORMER, TOKENIZE, stage_params, tokenized

KEY = "transformer-chitchat"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project folder holding ``data/shards/chitchat``, and no code."""
    return tokenized(tmp_path_factory.mktemp("project"))


def _plan(raw: dict, root: Path, key: str = KEY) -> RunPlan:
    return plan_training(RunRequest.of(checked(raw), key), root)


def _tuned(raw: dict | None = None) -> dict:
    """``raw`` (default: the stage params) with its run moved to ``tune.runs``."""
    raw = raw or stage_params()
    raw["tune"] = {
        "runs": raw["train"].pop("runs"),
        "spaces": {"transformer": {"model": {"n_heads": {"kind": "int", "low": 1, "high": 2}}}},
    }
    raw["train"]["runs"] = {}
    return raw


# --------------------------------------------------------------------------- checks


def test_bad_params_name_the_key_before_any_compute(project):
    with pytest.raises(ConfigError) as caught:
        parse_params(stage_params(train={"defaults": {"optimizer": {"lr": -1}}}))
    assert caught.value.key == "train.defaults.optimizer.lr"

    raw = stage_params()
    raw["train"]["models"]["transformer"]["model"] = {"n_heads": 0}
    with pytest.raises(ConfigError) as caught:
        checked(raw)
    assert caught.value.key == "train.models.transformer.model.n_heads"
    # the plan validates the config again, at the sizes of the data it will train on
    with pytest.raises(ConfigError) as caught:
        plan_training(RunRequest.of(parse_params(raw), KEY), project)
    assert caught.value.key == "train.models.transformer.model.n_heads"

    raw = stage_params()
    raw["train"]["scale"] = {"num_workers": 2}
    raw["train"]["defaults"]["batch_size"] = 15
    with pytest.raises(ConfigError) as caught:
        checked(raw)
    assert caught.value.key == "train.defaults.batch_size"

    raw = stage_params()
    raw["train"]["runs"]["hrt_last-chitchat"] = {"model": "hrt_last", "corpus": "chitchat"}
    with pytest.raises(ConfigError) as caught:
        checked(raw)
    assert caught.value.key == "train.runs.hrt_last-chitchat"
    assert "select model" in caught.value.reason

    with pytest.raises(ConfigError, match=r"runs\.oops: must be named 'transformer-chitchat'"):
        parse_params(
            stage_params(train={"runs": {"oops": {"model": "transformer", "corpus": "chitchat"}}})
        )


def test_a_request_names_a_run_of_params(project):
    params = checked(stage_params())
    with pytest.raises(ConfigError, match=r"no run 'gpt-chitchat' in train\.runs or tune\.runs"):
        RunRequest.of(params, "gpt-chitchat")
    with pytest.raises(ConfigError, match="'transformer' is no run key"):
        RunRequest.of(params, "transformer")
    with pytest.raises(ConfigError, match=r"tune\.runs: transformer-chitchat is not a tuned run"):
        plan_search(RunRequest.of(params, KEY, search=True), project)
    request = RunRequest.of(params, KEY)
    assert (request.model, request.corpus, request.variant, request.tuned) == (
        "transformer",
        "chitchat",
        None,
        False,
    )
    assert request.search is None and request.space is None and request.workers == 0
    assert request.corpus_params == params.corpus("chitchat")


def test_a_plan_holds_what_the_data_decides(project):
    plan = _plan(stage_params(), project)
    assert plan.task is Task.GENERATE and plan.stage == "train"
    assert plan.config.vocab_size == plan.sizes.vocab_size > 100  # the corpus' vocabulary
    assert plan.config.d_model == 16 and plan.knobs.optimizer.lr == 0.003
    assert plan.root == project.resolve() and plan.shards == project / "data/shards/chitchat"
    assert plan.storage == str(project / "runs" / "ray")
    assert plan.model_file == project / "data/train/transformer-chitchat/model.pt"
    assert plan.label == "train transformer-chitchat (seed 1234)"
    assert plan.dvc_stage == "train@transformer-chitchat"
    assert plan.restart == f"rm -r {project}/runs/ray/{plan.name} && dvc repro {plan.dvc_stage}"
    # picklable and self-contained: a Ray task can take it
    shipped = pickle.loads(pickle.dumps(plan))
    assert shipped == plan and shipped.name == plan.name
    assert type(shipped.config) is type(plan.config)
    # a shared storage is not removed with rm
    raw = stage_params(train={"placement": {"storage_path": "s3://bucket/runs"}})
    remote = _plan(raw, project)
    assert remote.restart == f"delete s3://bucket/runs/{remote.name} && dvc repro {plan.dvc_stage}"
    # a corpus not tokenized yet: the tokenize stage's record is missing
    with pytest.raises(DataError, match=r"manifest\.json: missing: run the tokenize stage"):
        _plan(stage_params(), project / "elsewhere")


def test_tuned_run_needs_the_tune_result_and_uses_it(project, tmp_path):
    root = tokenized(tmp_path)  # a best.json of its own
    raw = _tuned()
    layout = Layout(root)
    with pytest.raises(DataError, match=r"best\.json: missing: run the tune stage"):
        _plan(raw, root)
    best = layout.tune_out(KEY) / BEST_FILE
    best.parent.mkdir(parents=True)
    best.write_text(json.dumps({"config": {"n_heads": 1}, "optimizer": {"lr": 0.01}}))
    with pytest.raises(DataError, match=r"best.json: not a valid TuneRecord \(model: Field"):
        _plan(raw, root)
    record = TuneRecord(
        model="transformer",
        corpus="chitchat",
        search="tune-x",
        config={"n_heads": 1},
        optimizer={"lr": 0.01},
        valid_loss=4.0,
        trial_id="t0",
        trials=2,
        errored_trials=0,
    )
    record.write(best)
    plan = _plan(raw, root)
    assert plan.config.n_heads == 1 and plan.config.d_model == 16
    assert plan.knobs.model["n_heads"] == 1
    assert plan.knobs.optimizer.lr == 0.01 and plan.tuned_from == record
    assert plan.dvc_stage == "train_tuned@transformer-chitchat"
    assert plan.restart.endswith(" && dvc repro train_tuned@transformer-chitchat")
    # another tune result is another training
    record.model_copy(update={"config": {"n_heads": 2}}).write(best)
    assert _plan(raw, root).name != plan.name

    search = plan_search(RunRequest.of(checked(raw), KEY, search=True), root)
    assert search.stage == "tune" and search.tuned_from is None and search.space is not None
    assert search.knobs == RunRequest.of(checked(raw), KEY).knobs  # the untuned knobs
    assert search.label == "tune transformer-chitchat"
    raw["tune"]["spaces"]["transformer"]["model"]["n_hedas"] = {"kind": "int", "low": 1, "high": 2}
    with pytest.raises(ConfigError) as caught:
        checked(raw)
    assert caught.value.key == "tune.spaces.transformer.model.n_hedas"


def test_per_model_and_per_run_overrides_merge_over_defaults():
    raw = stage_params()
    raw["train"]["models"]["transformer"]["optimizer"] = {"lr": 0.5}
    raw["train"]["runs"][KEY]["overrides"] = {
        "epochs": 9,
        "model": {"d_ff": 64},
        "optimizer": {"betas": [0.8, 0.9]},
    }
    run = RunRequest.of(checked(raw), KEY).knobs
    assert run.epochs == 9 and run.batch_size == 16  # run, defaults
    assert run.optimizer.lr == 0.5 and run.optimizer.betas == (0.8, 0.9)  # model, run
    assert run.model == {**TINY_TRANSFORMER, "d_ff": 64}


def test_a_variant_is_one_more_run_of_the_pair_with_its_own_overrides():
    raw = stage_params()
    raw["train"]["runs"]["transformer-chitchat-wide"] = {
        "model": "transformer",
        "corpus": "chitchat",
        "variant": "wide",
        "overrides": {"model": {"d_ff": 64}},
    }
    params = checked(raw)
    wide = RunRequest.of(params, "transformer-chitchat-wide")
    assert wide.variant == "wide" and wide.knobs.model["d_ff"] == 64
    assert RunRequest.of(params, KEY).knobs.model == {**TINY_TRANSFORMER}
    assert params.train.runs["transformer-chitchat-wide"].label == "transformer (wide)"
    # the key names the variant
    raw["train"]["runs"]["transformer-chitchat-broad"] = raw["train"]["runs"].pop(
        "transformer-chitchat-wide"
    )
    with pytest.raises(ConfigError, match=r"must be named 'transformer-chitchat-wide'"):
        parse_params(raw)


# --------------------------------------------------------------------------- seeds


def test_seeds_are_copies_of_the_first_seeds_plan_with_their_own_seed(project):
    plan = _plan(stage_params(train={"defaults": {"seeds": 3, "seed": 5}}), project)
    assert plan.seeds == [5, 5 + SEED_STRIDE, 5 + 2 * SEED_STRIDE] == [5, 1005, 2005]
    assert plan.for_seed(0) == plan
    third = plan.for_seed(2)
    assert third.knobs.seed == 2005 and third.seed_index == 2
    assert third.seeds == plan.seeds  # every seed's plan knows the run's seeds
    assert third.model_file == project / "data/train/transformer-chitchat/seed-2/model.pt"
    assert plan.model_file == project / "data/train/transformer-chitchat/seed-0/model.pt"
    assert third.label == "train transformer-chitchat (seed 2005)"
    # nothing else changes: the same config, data, code, storage
    same = {"knobs", "seed_index"}
    assert third.model_dump(exclude=same) == plan.model_dump(exclude=same)
    assert third.knobs.model_copy(update={"seed": 5}) == plan.knobs
    # each seed is its own run: its own checkpoints, its own MLflow run
    names = {plan.for_seed(i).name for i in range(3)}
    assert len(names) == 3
    assert third.for_seed(1) == plan.for_seed(1)


# --------------------------------------------------------------------------- identity


def test_the_same_params_and_data_plan_the_same_run(project):
    plan = _plan(stage_params(), project)
    assert re.fullmatch(r"train-transformer-chitchat-[0-9a-f]{10}", plan.name)
    again = _plan(stage_params(), project)
    assert again == plan and again.name == plan.name
    assert again.identity() == plan.identity()
    # the search of the same run is another run
    search = plan_search(RunRequest.of(checked(_tuned()), KEY, search=True), project)
    assert re.fullmatch(r"tune-transformer-chitchat-[0-9a-f]{10}", search.name)


@pytest.mark.parametrize(
    "change",
    [
        {"train": {"defaults": {"epochs": 3}}},  # a knob
        {"train": {"defaults": {"optimizer": {"lr": 0.004}}}},  # a nested knob
        {"train": {"defaults": {"seed": 1}}},
        {"train": {"models": {"transformer": {"model": {**TINY_TRANSFORMER, "d_ff": 64}}}}},
        {"train": {"scale": {"num_workers": 1}}},  # the global batch splits over workers
    ],
)
def test_what_changes_the_result_changes_the_run(project, change):
    base = _plan(stage_params(), project)
    raw = stage_params()
    for section, values in change.items():
        for key, value in values.items():
            raw[section][key] = _merged(raw[section].get(key), value)
    assert _plan(raw, project).name != base.name


def _merged(old, new):
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}
    return new


def test_where_a_run_goes_and_how_it_is_recorded_do_not_change_it(project, tmp_path):
    base = _plan(stage_params(), project)
    placed = stage_params(
        train={
            "placement": {
                "use_gpu": False,
                "cpus_per_worker": 3,
                "gpus_per_worker": 0.5,
                "strategy": "SPREAD",
                "max_failures": 4,
                "storage_path": str(tmp_path / "elsewhere"),
            }
        },
        tracking={"enabled": False, "experiment_prefix": "other", "sample_generations": 0},
    )
    plan = _plan(placed, project)
    assert plan.storage == str(tmp_path / "elsewhere") != base.storage
    assert plan.placement != base.placement and plan.tracking != base.tracking
    assert plan.name == base.name


def test_another_variant_with_the_same_knobs_is_another_run(project):
    raw = stage_params()
    raw["train"]["runs"]["transformer-chitchat-again"] = {
        "model": "transformer",
        "corpus": "chitchat",
        "variant": "again",
    }
    params = checked(raw)
    plain = plan_training(RunRequest.of(params, KEY), project)
    again = plan_training(RunRequest.of(params, "transformer-chitchat-again"), project)
    assert again.knobs == plain.knobs and again.config == plain.config
    assert again.name != plain.name
    assert again.model_file == project / "data/train/transformer-chitchat-again/model.pt"


def test_other_data_is_another_run(project, tmp_path):
    base = _plan(stage_params(), project)
    same = tokenized(tmp_path / "same")
    assert _plan(stage_params(), same).name == base.name  # the same data elsewhere
    other = {"corpora": {"chitchat": {**TOKENIZE["corpora"]["chitchat"], "max_dialogues": 25}}}
    changed = tokenized(tmp_path / "fewer", other)
    plan = _plan(stage_params(), changed)
    assert plan.data != base.data and plan.name != base.name


def test_other_training_code_is_another_run(tmp_path):
    root = tokenized(tmp_path)
    base = _plan(stage_params(), root)
    loop = root / "pipeline" / "train" / "loop.py"
    loop.parent.mkdir(parents=True)
    loop.write_text("STEP = 1\n")
    first = _plan(stage_params(), root)
    assert first.code != base.code and first.name != base.name
    loop.write_text("STEP = 2\n")
    edited = _plan(stage_params(), root)
    assert edited.code != first.code and edited.name != first.name
    (root / "stages").mkdir()
    (root / "stages" / "train.py").write_text("# the train stage\n")
    script = _plan(stage_params(), root)
    assert script.name != edited.name
    # what the training does not run leaves it alone: other files, bytecode, other stages
    (root / "pipeline" / "train" / "notes.md").write_text("not code\n")
    cache = root / "pipeline" / "train" / "__pycache__"
    cache.mkdir()
    (cache / "loop.py").write_text("cached\n")
    (root / "stages" / "evaluate.py").write_text("# another stage\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("x = 1\n")
    assert _plan(stage_params(), root).name == script.name
    # the tune stage's script is the search's code, not the training's
    (root / "stages" / "tune.py").write_text("# the tune stage\n")
    assert _plan(stage_params(), root).name == script.name


def test_a_search_is_named_by_its_knobs_and_space_not_by_how_many_trials_run_at_once(project):
    def search(**tune) -> RunPlan:
        raw = _tuned()
        raw["tune"] |= tune
        return plan_search(RunRequest.of(checked(raw), KEY, search=True), project)

    base = search(trials=4, concurrency=1)
    assert base.search.trials == 4 and base.space is not None
    assert search(trials=4, concurrency=1).name == base.name
    assert search(trials=4, concurrency=2).name == base.name  # placement, not the result
    assert search(trials=5, concurrency=1).name != base.name
    assert search(trials=4, epochs_per_trial=2).name != base.name
    assert search(trials=4, seed=9).name != base.name
    wider = {"transformer": {"model": {"n_heads": {"kind": "int", "low": 1, "high": 4}}}}
    assert search(trials=4, spaces=wider).name != base.name
