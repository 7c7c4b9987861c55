"""The GPU check's runs cut short keep the rules the train stage checks before the first
step (``bench.gpu_check.ptb.cut_short``): the paper profile's recipe (its warm-up,
the last 50 of 175 epochs averaged) at the parts' lengths, smoke and GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gpu_check.loop import sized_knobs
from bench.gpu_check.ptb import cut_short
from pipeline.config import RunParams
from pipeline.config.run_rules import EpochSteps, names_from, step_problem
from pipeline.plan import RunRequest, load_checked

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recipe() -> RunParams:
    return RunRequest.of(load_checked(REPO / "profiles" / "paper.yaml"), "gpt-ptb").knobs


def _problem(knobs: RunParams, per_epoch: int) -> str | None:
    steps = EpochSteps.planned(per_epoch, knobs)
    problem = step_problem(knobs, steps, names_from(knobs, lambda knob: knob))
    return None if problem is None else problem.reason


@pytest.mark.parametrize(("max_steps", "per_epoch"), [(6, 3), (200, 132), (400, 132)])
def test_the_throughput_runs_keep_the_step_rules(
    recipe: RunParams, max_steps: int, per_epoch: int
) -> None:
    knobs = {"epochs": 10**6, "max_steps": max_steps}
    cut = recipe.model_copy(update={**knobs, **cut_short(recipe, knobs)})
    assert _problem(recipe.model_copy(update=knobs), per_epoch) is not None  # as it was
    assert _problem(cut, per_epoch) is None
    assert cut.averaging.kind == "none" and cut.schedule.warmup_steps == max(1, max_steps // 10)


@pytest.mark.parametrize(("epochs", "per_epoch"), [(2, 2), (2, 132), (4, 132), (30, 132)])
def test_the_four_runs_keep_the_step_rules(recipe: RunParams, epochs: int, per_epoch: int) -> None:
    # a smoke run cuts its epochs to 2 batches (four_runs' logging knobs)
    smoke = {"max_batches_per_epoch": 2} if per_epoch == 2 else {}
    knobs = {**sized_knobs(recipe, epochs), **smoke}
    cut = recipe.model_copy(update={**knobs, **cut_short(recipe, knobs)})
    assert _problem(recipe.model_copy(update=knobs), per_epoch) is not None  # as it was
    assert _problem(cut, per_epoch) is None
    share = round(recipe.schedule.warmup_steps * epochs / recipe.epochs)  # the profile's
    expected = min(share, epochs * per_epoch // 10) if smoke else share
    assert cut.schedule.warmup_steps == max(1, expected)
