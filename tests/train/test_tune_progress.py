"""Tune progress: a line per finished trial, status lines in a log, a resumed search."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from pipeline import progress
from pipeline.config import Selection
from pipeline.train.tune_progress import TrialProgress, reporting


def trial(trial_id: str, status: str, config: dict, losses: list[float], **result) -> object:
    return SimpleNamespace(
        trial_id=trial_id,
        status=status,
        config=config,
        last_result={"valid_loss": losses[-1], "training_iteration": len(losses), **result},
        metric_analysis={"valid_loss": {"min": min(losses), "last": losses[-1]}},
        error_file=None,
    )


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(progress, "now", lambda: now[0])
    return now


def test_a_line_per_finished_trial_and_a_status_line_every_few_seconds(clock, capsys):
    # Ray pickles the callback with the search: it must carry no state of its own
    callback = pickle.loads(pickle.dumps(TrialProgress()))
    a = trial("a1", "RUNNING", {"model": {"n_heads": 2, "dropout": 0.24303}}, [5.2, 4.9])
    b = trial("b2", "RUNNING", {"model": {"n_heads": 1, "dropout": 0.1}}, [5.5])
    c = trial("c3", "RUNNING", {"model": {"n_heads": 8, "dropout": 0.1}}, [float("inf")])
    c.last_result["invalid"] = 1.0
    d = trial("d4", "RUNNING", {"model": {"n_heads": 4, "dropout": 0.2}}, [5.1])
    trials = [a, b, c, d]
    with reporting("tune hier-chitchat", trials=4, epochs=2):
        callback.on_step_end(iteration=1, trials=trials)
        clock[0] += 30  # a status line is due
        callback.on_step_end(iteration=2, trials=trials)
        callback.on_trial_complete(iteration=3, trials=trials, trial=a)
        a.status = "TERMINATED"
        callback.on_trial_complete(iteration=4, trials=trials, trial=b)  # ASHA stopped it
        b.status = "TERMINATED"
        callback.on_trial_complete(iteration=5, trials=trials, trial=c)
        c.status = "TERMINATED"
        clock[0] += 30
        callback.on_step_end(iteration=6, trials=trials)
        d.error_file = "/ray/d4/error.txt"
        callback.on_trial_error(iteration=7, trials=trials, trial=d)
    callback.on_trial_complete(iteration=8, trials=trials, trial=a)  # no search: ignored
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "tune hier-chitchat: trial 0/4 (0%)",
        "tune hier-chitchat: trial 0/4 (0%), 4 running",
        "tune hier-chitchat: trial 1/4 a1 finished after 2/2 epochs: valid loss 4.9 "
        "(best so far); model.n_heads=2 model.dropout=0.243",
        "tune hier-chitchat: trial 2/4 b2 stopped early by ASHA after 1/2 epochs: valid loss "
        "5.5 (best 4.9); model.n_heads=1 model.dropout=0.1",
        "tune hier-chitchat: trial 3/4 c3 skipped: an invalid configuration; "
        "model.n_heads=8 model.dropout=0.1",
        "tune hier-chitchat: trial 3/4 (75%), 1 running, best valid loss 4.9, 20 s/trial, ETA 20s",
        "tune hier-chitchat: trial 4/4 d4 failed after 1/2 epochs (error: /ray/d4/error.txt); "
        "model.n_heads=4 model.dropout=0.2",
        "tune hier-chitchat: finished trial 4/4 (100%), 1 running, best valid loss 4.9 in 1m00s",
    ]


def test_a_resumed_search_counts_its_finished_trials_apart(clock, capsys):
    restored = trial("a1", "TERMINATED", {"model": {"n_heads": 2}}, [4.0])
    running = trial("b2", "RUNNING", {"model": {"n_heads": 1}}, [5.0])
    trials = [restored, running]
    with reporting("tune x", trials=3, epochs=1):
        TrialProgress().on_step_end(iteration=1, trials=trials)
        clock[0] += 100
        TrialProgress().on_trial_complete(iteration=2, trials=trials, trial=running)
    lines = capsys.readouterr().err.splitlines()
    assert (
        lines[1] == "tune x: trial 2/3 b2 finished after 1/1 epochs: valid loss 5 (best so far)"
        "; model.n_heads=1"
    )
    # one trial in 100 s here: the trial restored as finished is not in the rate
    assert lines[2] == "tune x: trial 2/3 (67%), 1 running, 100 s/trial, ETA 1m40s"


def test_no_progress_is_silent(clock, capsys):
    t = trial("a1", "RUNNING", {}, [4.0])
    with reporting("tune x", trials=1, epochs=1, show=False):
        TrialProgress().on_step_end(iteration=1, trials=[t])
        TrialProgress().on_trial_complete(iteration=2, trials=[t], trial=t)
    assert capsys.readouterr() == ("", "")


def test_a_search_on_a_score_reports_its_highest(clock, capsys):
    def scored(trial_id: str, scores: list[float]) -> object:
        return SimpleNamespace(
            trial_id=trial_id,
            status="RUNNING",
            config={"model": {"n_heads": 2}},
            last_result={"valid_score": scores[-1], "training_iteration": len(scores)},
            metric_analysis={"valid_score": {"max": max(scores), "min": min(scores)}},
            error_file=None,
        )

    a, b = scored("a1", [40.0, 55.0, 50.0]), scored("b2", [45.0, 52.0, 53.0])
    with reporting("tune hier-multiwoz", 2, 3, Selection.MULTIWOZ_SCORE):
        TrialProgress().on_trial_complete(iteration=1, trials=[a, b], trial=a)
        TrialProgress().on_trial_complete(iteration=2, trials=[a, b], trial=b)
    lines = capsys.readouterr().err.splitlines()
    assert "finished after 3/3 epochs: valid score 55 (best so far)" in lines[1]
    assert "finished after 3/3 epochs: valid score 53 (best 55)" in lines[2]
