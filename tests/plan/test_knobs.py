"""Each run checked as it will train (``pipeline.plan.knobs``, and the model config and
compile checks of ``pipeline.plan.check``): the merged knobs of every train and tuned run,
a tuned run's trials and the extremes of its search space included; each refusal keyed on
the knob to change, naming the run and every level that contributed. The probes of issue
43, on ``profiles/tiny.yaml`` (8 examples a batch, at most 4 steps an epoch)."""

from __future__ import annotations

import copy

import pytest
import yaml

from pipeline.config import Params
from pipeline.models import registry
from pipeline.plan import checked
from tests.plan.test_check import REPO, _error
from tests.test_config import with_value

GPT = "train.models.gpt"
HIER = "train.models.hier"


@pytest.fixture(scope="module")
def tiny() -> dict:
    return yaml.safe_load((REPO / "profiles" / "tiny.yaml").read_text())


def _with(raw: dict, **values: object) -> dict:
    """``raw`` with each dotted key (``__`` for ``.``) set."""
    for key, value in values.items():
        raw = with_value(raw, key.replace("__", "."), value)
    return raw


def test_averaging_the_whole_run_under_a_warm_up_is_refused(tiny: dict) -> None:
    """Probe 1: the schedule stops where averaging begins, at step 0: lr / warm-up."""
    raw = _with(tiny, train__defaults__epochs=2)
    raw = with_value(raw, f"{GPT}.schedule", {"kind": "linear_warmup", "warmup_steps": 100})
    err = _error(with_value(raw, f"{GPT}.averaging", {"kind": "uniform", "epochs": 2}))
    assert err.key == f"{GPT}.averaging.epochs"
    assert err.reason.startswith(
        "run gpt-chitchat: averaging (the last 2 epochs of train.defaults.epochs = 2) "
        "begins at step 0 (it covers every epoch), before the warm-up ends "
        f"({GPT}.schedule.warmup_steps = 100, {GPT}.schedule.kind = linear_warmup)"
    )
    # no warm-up fits before step 0: the fixes it names are ones that can be made
    assert err.reason.endswith("Average fewer epochs, or set schedule.kind: none")
    assert "trains at 0.01 x optimizer.lr. Average fewer epochs" in err.reason
    # a constant learning rate may be averaged from the first step
    constant = with_value(raw, f"{GPT}.averaging", {"kind": "uniform", "epochs": 2})
    assert checked(with_value(constant, f"{GPT}.schedule", {"kind": "none"}))
    # one epoch fewer: up to 4 steps before averaging, too few for 100 of warm-up, enough for 3
    one = with_value(raw, f"{GPT}.averaging", {"kind": "uniform", "epochs": 1})
    err = _error(one)
    assert err.key == f"{GPT}.averaging.epochs"
    assert "begins by step 4 at the latest (epoch 2 of 2, at most 4 steps an epoch: " in err.reason
    assert checked(with_value(one, f"{GPT}.schedule.warmup_steps", 3))


def test_averaging_after_a_cosine_to_a_min_lr_of_0_is_refused(tiny: dict) -> None:
    """Probe 2: the cosine's default decay ends where averaging begins: at lr 0."""
    raw = _with(tiny, train__defaults__epochs=2)
    raw = with_value(raw, f"{GPT}.schedule", {"kind": "cosine", "warmup_steps": 2})
    raw = with_value(raw, f"{GPT}.averaging", {"kind": "uniform", "epochs": 1})
    err = _error(raw)
    assert err.key == f"{GPT}.schedule.min_lr"
    assert err.reason.startswith(
        f"run gpt-chitchat: the cosine reaches {GPT}.schedule.min_lr = 0 (default) where "
        "averaging begins"
    )
    assert "trains at a learning rate of 0: the average never moves. Set min_lr above 0" in (
        err.reason
    )
    assert checked(with_value(raw, f"{GPT}.schedule.min_lr", 1e-3))
    # the fix it names: a decay that ends after averaging begins (at step 4 at the latest)
    assert "or decay_steps above 5, past the step averaging begins" in err.reason
    assert checked(with_value(raw, f"{GPT}.schedule.decay_steps", 6))


def test_averaging_that_max_steps_cuts_off_is_refused_when_it_is_certain(tiny: dict) -> None:
    """Probe 3, as far as the params tell (a step an epoch at least); with the data, the
    train stage refuses the rest (``tests/train/test_run_checks.py``)."""
    raw = with_value(tiny, f"{GPT}.averaging", {"kind": "uniform", "epochs": 1})
    raw = _with(raw, train__defaults__epochs=4, train__defaults__max_steps=2)
    err = _error(raw)
    assert err.key == "train.defaults.max_steps"
    assert err.reason == (
        "run gpt-chitchat: 2 ends the run before averaging (the last epoch of "
        "train.defaults.epochs = 4) begins at step 3 at the earliest (epoch 4 of 4, at least "
        "1 step an epoch): the run would never average. Raise max_steps above 3, remove it, "
        "or average more epochs"
    )
    assert checked(with_value(raw, "train.defaults.max_steps", 6))  # the data decides


@pytest.mark.parametrize("kind", ["linear_warmup", "noam"])
def test_a_warm_up_that_outlasts_the_run_is_refused(tiny: dict, kind: str) -> None:
    """The default warm-up (1000 steps) in a run of at most 4: the learning rate never
    reaches the peak the schedule is set for, as a cosine's would not."""
    err = _error(with_value(tiny, f"{GPT}.schedule", {"kind": kind}))
    assert err.key == f"{GPT}.schedule.warmup_steps"
    assert err.reason.startswith(
        "run gpt-chitchat: the run's at most 4 planned steps (1 epoch, at most 4 steps an "
        "epoch: train.defaults.max_batches_per_epoch = 4) end before the warm-up "
        f"({GPT}.schedule.warmup_steps = 1000 (default), {GPT}.schedule.kind = {kind}) does: "
        "the learning rate never passes 0.004 x optimizer.lr"
    )
    assert "Lower warmup_steps" in err.reason
    assert checked(with_value(tiny, f"{GPT}.schedule", {"kind": kind, "warmup_steps": 3}))


def test_a_cosine_whose_planned_steps_do_not_outlast_its_warm_up_is_refused(tiny: dict) -> None:
    """Probe 4: the default warm-up (1000 steps) in a run of at most 4: no decay."""
    err = _error(with_value(tiny, f"{GPT}.schedule", {"kind": "cosine"}))
    assert err.key == f"{GPT}.schedule.warmup_steps"
    assert "run gpt-chitchat: the cosine decays over the run's planned steps" in err.reason
    assert (
        "at most 4 (1 epoch, at most 4 steps an epoch: "
        "train.defaults.max_batches_per_epoch = 4), which do not exceed "
        f"{GPT}.schedule.warmup_steps = 1000 (default): the learning rate never passes "
        "0.004 x optimizer.lr and never decays"
    ) in err.reason
    assert checked(with_value(tiny, f"{GPT}.schedule", {"kind": "cosine", "warmup_steps": 2}))
    # decay_steps set beyond the run: the warm-up still never ends
    err = _error(with_value(tiny, f"{GPT}.schedule", {"kind": "cosine", "decay_steps": 2000}))
    assert err.key == f"{GPT}.schedule.warmup_steps"
    assert err.reason.startswith(
        "run gpt-chitchat: the run's at most 4 planned steps (1 epoch, at most 4 steps an "
        "epoch: train.defaults.max_batches_per_epoch = 4) end before the warm-up "
        f"({GPT}.schedule.warmup_steps = 1000 (default)) does"
    )


def test_tuned_runs_are_checked_like_train_runs(tiny: dict) -> None:
    """Probe 5: the cross-field rules apply to a tuned run's merged knobs too."""
    cosine = {"kind": "cosine", "warmup_steps": 10, "decay_steps": 5, "min_lr": 0.5}
    err = _error(with_value(tiny, f"{HIER}.schedule", cosine))
    assert err.key == f"{HIER}.schedule.min_lr"
    assert err.reason.startswith(
        "tuned run hier-chitchat: 0.5 is above train.defaults.optimizer.lr = 0.003"
    )
    raw = _with(tiny, train__defaults__epochs=2)
    err = _error(with_value(raw, f"{HIER}.averaging", {"kind": "uniform", "epochs": 3}))
    assert err.key == f"{HIER}.averaging.epochs"
    assert err.reason.startswith(
        "tuned run hier-chitchat: 3 averaged epochs in a run of train.defaults.epochs = 2"
    )


def test_a_tuned_run_is_checked_at_its_search_spaces_extremes_and_in_its_trials(
    tiny: dict,
) -> None:
    schedule = {"kind": "cosine", "warmup_steps": 2, "min_lr": 1e-3}
    raw = with_value(tiny, f"{HIER}.schedule", schedule)
    assert isinstance(checked(raw), Params)
    lr = {"kind": "log_float", "low": 1e-4, "high": 1e-2}
    err = _error(with_value(raw, "tune.spaces.hier.optimizer.lr", lr))
    assert err.key == f"{HIER}.schedule.min_lr"
    assert err.reason.startswith(
        "tuned run hier-chitchat: 0.001 is above tune.spaces.hier.optimizer.lr = 0.0001 "
        "(the search's low)"
    )
    # the trials train tune.epochs_per_trial epochs: a warm-up longer than those never decays
    long = _with(raw, train__defaults__epochs=30)
    long = with_value(long, f"{HIER}.schedule.warmup_steps", 10)
    err = _error(long)
    assert err.key == f"{HIER}.schedule.warmup_steps"
    assert err.reason.startswith(
        "the trials of tuned run hier-chitchat: the cosine decays over the run's planned "
        "steps (schedule.decay_steps: null), at most 4 (1 epoch, at most 4 steps an epoch"
    )
    bad = with_value(raw, "tune.spaces.hier.optimizer.lr", {"kind": "float", "low": 0, "high": 1})
    assert _error(bad).key == "tune.spaces.hier.optimizer.lr"  # lr 0 at the low end


def test_flex_is_checked_against_the_dropout_in_effect_where_the_levels_meet(
    tiny: dict,
) -> None:
    """Probe 10: flex with a searched attention dropout is refused naming both; flex in a
    model's knobs made valid by a run's ``attention_dropout: 0`` is accepted."""
    flex = with_value(tiny, f"{HIER}.model.attention_layout", "flex")
    flex = with_value(flex, f"{HIER}.model.attention_dropout", 0.0)
    assert checked(flex)  # the tiny search over dropout leaves attention_dropout at 0
    dim = {"kind": "float", "low": 0.1, "high": 0.3}
    err = _error(with_value(flex, "tune.spaces.hier.model.attention_dropout", dim))
    assert err.key == f"{HIER}.model.attention_layout"
    assert err.reason.startswith(
        "tuned run hier-chitchat: flex cannot drop attention probabilities, and "
        "attention_dropout = 0.1 is in effect"
    )
    assert "tune.spaces.hier.model.attention_dropout = 0.1 (the search's low)" in err.reason
    # the fix is where the value comes from: the search, not a level already at 0
    assert err.reason.endswith(
        "; the search draws tune.spaces.hier.model.attention_dropout: narrow or drop it there"
    )
    merged = copy.deepcopy(flex)
    del merged["train"]["models"]["hier"]["model"]["attention_dropout"]
    del merged["tune"]["runs"]["hier-chitchat"]
    run = {"model": "hier", "corpus": "chitchat", "overrides": {"model": {"attention_dropout": 0}}}
    assert checked(with_value(merged, "train.runs.hier-chitchat", run))
    # no run completes it: the model's own entry is checked alone
    del merged["tune"]["runs"]
    assert _error(merged).key == f"{HIER}.model.attention_layout"


def test_compile_on_for_a_model_that_cannot_compile_names_it_and_why(tiny: dict) -> None:
    """Probe 8: ``compile: on`` for a model whose class says it breaks the graph (a
    wrapper: one of its members), with the class's reason."""
    ranker = {"d_embed": 16, "d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1}
    raw = with_value(tiny, "train.models.hrt_last.model", ranker)
    for model in ("hrt_last", "s2sa", "with_none"):
        raw = with_value(
            raw, f"train.runs.{model}-chitchat", {"model": model, "corpus": "chitchat"}
        )
    raw = with_value(raw, "train.models.with_none.model", {"overrides": ranker})
    assert checked(with_value(raw, "train.defaults.compile", "auto"))  # auto leaves them eager
    err = _error(with_value(raw, "train.models.hrt_last.compile", "on"))
    assert err.key == "train.models.hrt_last.compile"
    assert err.reason.startswith(
        "run hrt_last-chitchat: hrt_last cannot be compiled whole (compile: on): its "
        "recurrence runs once per utterance of the batch's longest context"
    )
    assert "Set compile: auto" in err.reason
    err = _error(with_value(raw, "train.models.s2sa.compile", "on"))
    assert "s2sa cannot be compiled whole (compile: on): it runs nn.GRU, which" in err.reason
    err = _error(with_value(raw, "train.models.with_none.compile", "reduce-overhead"))
    assert "with_none cannot be compiled whole (compile: reduce-overhead): its recurrence" in (
        err.reason
    )
    transformer = with_value(tiny, "train.defaults.compile", "on")  # GPT, U-Net ... compile
    assert checked(with_value(transformer, "tune.runs", {}))


def test_the_embedding_multiplier_is_for_a_model_with_a_token_embedding(tiny: dict) -> None:
    """``optimizer.embedding_lr_multiplier`` trains a model's one token embedding at its
    own rate: refused for a model that declares none (``TaskModel.token_embedding``: the
    language models do), and where its rate would start below the cosine's ``min_lr``."""
    assert checked(with_value(tiny, f"{GPT}.optimizer.embedding_lr_multiplier", 2))
    err = _error(with_value(tiny, "train.defaults.optimizer.embedding_lr_multiplier", 2))
    assert err.key == "train.defaults.optimizer.embedding_lr_multiplier"
    assert err.reason.startswith(
        "run transformer-chitchat: transformer has no single token embedding to train at 2 x lr"
    )
    cosine = {"kind": "cosine", "warmup_steps": 2, "decay_steps": 4, "min_lr": 2e-3}
    raw = with_value(tiny, f"{GPT}.schedule", cosine)
    assert checked(raw)  # min_lr under lr (3e-3)
    err = _error(with_value(raw, f"{GPT}.optimizer.embedding_lr_multiplier", 0.5))
    assert err.key == f"{GPT}.schedule.min_lr"
    assert "0.002 is above the token embedding's learning rate 0.0015" in err.reason


def test_every_model_that_cannot_compile_says_why() -> None:
    classes = {registry.spec(name).builder for name in registry.names()}
    eager = [c for c in classes if isinstance(c, type) and c.supports_compile is False]
    assert len(eager) >= 6 and all(len(c.eager_reason) > 20 for c in eager)


def test_batch_tokens_must_leave_each_worker_a_token(tiny: dict) -> None:
    """Probe 9: found by the check, not by a worker after Ray started."""
    two = _with(tiny, train__scale__num_workers=2, train__defaults__batch_tokens=1)
    err = _error(two)
    assert err.key == "train.defaults.batch_tokens"
    assert "split over train.scale.num_workers=2: each worker would plan its batches within 0 " in (
        err.reason
    )
    assert checked(with_value(two, "train.defaults.batch_tokens", 2))


def test_a_refusal_names_the_run_and_every_level_that_contributed(tiny: dict) -> None:
    """Probe 12: ``min_lr`` in the defaults, ``lr`` in one run's overrides."""
    raw = with_value(tiny, "train.defaults.schedule", {"kind": "cosine", "warmup_steps": 2,
                                                       "min_lr": 1e-3})  # fmt: skip
    raw = with_value(raw, "train.defaults.optimizer.lr", 3e-3)
    run = {"model": "gpt", "corpus": "chitchat", "overrides": {"optimizer": {"lr": 1e-4}}}
    err = _error(with_value(raw, "train.runs.gpt-chitchat", run))
    assert err.key == "train.defaults.schedule.min_lr"
    assert err.reason.startswith(
        "run gpt-chitchat: 0.001 is above train.runs.gpt-chitchat.overrides.optimizer.lr = "
        "0.0001: the cosine decays from lr down to min_lr; make min_lr at most 0.0001"
    )


@pytest.mark.parametrize(("key", "value"), [("min_lr", 1e-4), ("decay_steps", 40)])
def test_a_schedule_key_its_kind_would_ignore_is_refused(
    tiny: dict, key: str, value: float
) -> None:
    """Probe 12: ``min_lr`` and ``decay_steps`` belong to the cosine."""
    raw = with_value(tiny, f"{GPT}.schedule", {"kind": "linear_warmup", key: value})
    err = _error(raw)
    assert err.key == f"{GPT}.schedule.{key}"
    assert err.reason.startswith(
        f"run gpt-chitchat: {value:g} applies to the cosine schedule only, and "
        f"{GPT}.schedule.kind = linear_warmup would ignore it: set schedule.kind: cosine"
    )
