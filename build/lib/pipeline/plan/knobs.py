"""Each run's knobs as it will train, checked by the rules between them
(``config.run_rules.knob_problem``): a train run's merged knobs (``train.defaults`` <
``train.models.<m>`` < its overrides); a tuned run's training from its best trial and its
trials, at each extreme of the search's optimizer values (``SearchSpace.corners``). Part
of the params check (``plan.check``); an error is keyed on the params key that sets the
knob to change first, and names the run and every other knob with the key that sets it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pydantic import ValidationError

from pipeline.config import (
    Params,
    RunParams,
    RunTarget,
    sampled_model,
    trial_params,
    tuned_knobs,
)
from pipeline.config.run_rules import knob_problem, names_from
from pipeline.config.validation import config_error
from pipeline.errors import ConfigError


def runs_of(params: Params) -> Iterator[tuple[str, str, RunTarget]]:
    """``(dotted key, run key, target)`` of every train and tuned run."""
    for where, runs in (("train.runs", params.train.runs), ("tune.runs", params.tune.runs)):
        for key, target in runs.items():
            yield f"{where}.{key}", key, target


@dataclass(frozen=True)
class RunKnobs:
    """One set of knobs a run trains with (``label``: ``run gpt-chitchat``, ``the trials
    of tuned run hier-chitchat``), and where the knobs that no ``train`` level sets come
    from (a search's extreme, the trials' budget)."""

    label: str
    key: str
    model: str
    knobs: RunParams
    given: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # said after a given knob's value

    def source(self, params: Params, knob: str) -> str:
        """The dotted params key that sets ``knob``."""
        if knob in self.given:
            return self.given[knob]
        for given, where in self.given.items():  # a section set whole (a trial's averaging)
            if knob.startswith(f"{given}."):
                return where
        return params.train.source(self.key, self.model, knob)

    def name(self, params: Params, knob: str) -> str:
        """How a message names ``knob``: its params key and value."""
        named = names_from(self.knobs, lambda k: self.source(params, k), self.notes)(knob)
        given = knob in self.given or params.train.sets(self.key, self.model, knob)
        return named if given else f"{named} (default)"


# What a tune trial sets itself, whatever the run's knobs say (``config.trial_params``).
_TRIAL_KNOBS = ("eval_every", "checkpoint_every", "patience", "max_steps", "averaging")


def knob_sets(params: Params) -> Iterator[RunKnobs]:
    """Every set of knobs every run trains with: a train run's merged knobs; a tuned
    run's training from its best trial and its trials, at each extreme of the search's
    optimizer values."""
    tune = params.tune
    for _, key, target in runs_of(params):
        merged = params.train.run(target.model, target.corpus, target.variant)
        if key not in tune.runs:
            yield RunKnobs(f"run {key}", key, target.model, merged)
            continue
        space = tune.spaces[target.model]
        seen = set()
        for sample, taken in space.corners():
            optimizer = sample.get("optimizer", {})
            if tuple(sorted(optimizer.items())) in seen:
                continue
            seen.add(tuple(sorted(optimizer.items())))
            where = f"tune.spaces.{target.model}.optimizer"
            given = {f"optimizer.{k}": f"{where}.{k}" for k in optimizer}
            notes = {
                f"optimizer.{k}": f" (the search's {taken[f'optimizer.{k}']})" for k in optimizer
            }
            try:
                trained = tuned_knobs(merged, sampled_model(sample), optimizer)
            except ValidationError as err:
                raise config_error(err, where) from None
            yield RunKnobs(f"tuned run {key}", key, target.model, trained, given, notes)
            trial = trial_params(merged, tune, sample)
            budget = {k: f"a tune trial's {k}" for k in _TRIAL_KNOBS}
            given = {**given, **budget, "epochs": "tune.epochs_per_trial"}
            label = f"the trials of tuned run {key}"
            yield RunKnobs(label, key, target.model, trial, given, notes)


def check_knobs(params: Params) -> None:
    """The rules between each run's knobs (``config.run_rules.knob_problem``), in each set
    of knobs it trains with; the error is keyed on the knob to change first and names
    the run and every other knob (where it is set, and its value)."""
    for run in knob_sets(params):
        problem = knob_problem(run.knobs, lambda knob, run=run: run.name(params, knob))
        if problem is not None:
            raise ConfigError(run.source(params, problem.knob), f"{run.label}: {problem.reason}")
