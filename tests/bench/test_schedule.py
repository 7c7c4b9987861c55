"""The simulated schedule of ``make repro JOBS=N`` on Ray (bench/schedule.py), against
schedules worked out by hand."""

from __future__ import annotations

import pytest

from bench.schedule import Stage, simulate


def spans(schedule) -> list[tuple[str, float, float]]:
    return sorted(schedule.runs, key=lambda r: (r[1], r[0]))


def test_one_job_slot_runs_stages_in_order_and_seeds_side_by_side() -> None:
    stages = [Stage("a", jobs=(10.0, 10.0)), Stage("b", jobs=(4.0, 4.0))]
    s = simulate(stages, jobs=1, gpus=2)
    assert spans(s) == [("a", 0, 10), ("a", 0, 10), ("b", 10, 14), ("b", 10, 14)]
    assert s.wall == 14 and s.busy == 28 and s.utilization == 1.0


def test_ray_places_jobs_first_asked_first_served() -> None:
    # JOBS=2: both stages start at once; a's two seeds asked first take the two GPUs
    stages = [Stage("a", jobs=(10.0, 10.0)), Stage("b", jobs=(4.0, 6.0))]
    s = simulate(stages, jobs=2, gpus=2)
    assert spans(s) == [("a", 0, 10), ("a", 0, 10), ("b", 10, 14), ("b", 10, 16)]
    assert s.wall == 16
    assert s.utilization == pytest.approx(30 / (2 * 16))


def test_upstream_and_search_concurrency_are_respected() -> None:
    stages = [
        Stage("tokenize"),  # no GPU job: done at once
        Stage("tune", frozenset({"tokenize"}), jobs=(3.0, 3.0, 3.0), concurrency=1),
        Stage("train", frozenset({"tokenize"}), jobs=(5.0,)),
        Stage("train_tuned", frozenset({"tune"}), jobs=(2.0, 2.0)),
        Stage("report", frozenset({"train", "train_tuned"})),
    ]
    s = simulate(stages, jobs=4, gpus=4)
    assert spans(s) == [
        ("train", 0, 5), ("tune", 0, 3), ("tune", 3, 6), ("tune", 6, 9),
        ("train_tuned", 9, 11), ("train_tuned", 9, 11),
    ]  # fmt: skip
    assert s.wall == 11


def test_unknown_upstream_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown stages"):
        simulate([Stage("a", frozenset({"nope"}))], jobs=1, gpus=1)
