"""A training waiting on its MLflow store says so within seconds, and a store that fails
for good sends it to the fallback store with the command that copies the runs back."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from pipeline.tracking import Tracker
from pipeline.tracking.store import TrackingUnavailable, mlflow_client
from pipeline.tracking.tracker import waiting_notice


def test_a_slow_call_is_announced_once_it_passes_the_threshold(capsys) -> None:
    with waiting_notice("sqlite:///x.db", after_s=0.2):
        time.sleep(0.5)
    err = capsys.readouterr().err
    assert "the MLflow store sqlite:///x.db has not answered for 0.2 s" in err
    assert "python -m pipeline sync-mlflow" in err
    with waiting_notice("sqlite:///x.db", after_s=0.5):
        pass  # a quick call says nothing
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_locked_store_is_announced_and_nothing_is_lost(tmp_path: Path, capsys) -> None:
    """Another process holds the sqlite store's write lock for 8 s: the tracker says it is
    waiting within a few seconds, and the metric lands (in the store, or the fallback)."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    fallback = f"sqlite:///{tmp_path / 'fallback.db'}"
    mlflow_client(uri).search_experiments()  # creates the store's tables
    tracker = Tracker.start(uri, fallback, "exp", run_name="r", resume_key="r")
    locked, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        con = sqlite3.connect(db, timeout=1)
        con.execute("BEGIN EXCLUSIVE")
        locked.set()
        release.wait(8)
        con.rollback()
        con.close()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    locked.wait(10)
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.log_metrics({"loss": 1.5}, step=3)
    release.set()
    holder.join()
    err = capsys.readouterr().err
    assert "has not answered for 3 s" in err, err
    assert time.monotonic() - started >= 3
    fell_back = [w for w in caught if issubclass(w.category, TrackingUnavailable)]
    for warning in fell_back:
        assert "python -m pipeline sync-mlflow" in str(warning.message)
    store = tracker.ref.uri  # the fallback's, if it fell back
    history = mlflow_client(store).get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(3, 1.5)]


STARTER = """
import sys, time
from pipeline.tracking import Tracker
uri, fallback, name, at = sys.argv[1:5]
time.sleep(max(0.0, float(at) - time.time()))  # every process starts at the same instant
tracker = Tracker.start(uri, fallback, "exp-" + name, run_name=name, resume_key=name)
tracker.log_metrics({"loss": 1.0}, step=1)
tracker.end()
print("FELL_BACK" if tracker.fell_back else "OK")
"""


@pytest.mark.slow
def test_processes_opening_a_new_sqlite_store_at_once_lose_no_run(tmp_path: Path) -> None:
    """Concurrent stages (``make repro JOBS=N``) open the project's store for the first time
    together: MLflow's table creation is not safe against itself, so one process creates
    the store while the others wait; every run lands in it, none in the fallback store."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    fallback = f"sqlite:///{tmp_path / 'fallback.db'}"
    at = str(time.time() + 8)  # after every interpreter has imported MLflow
    command = [sys.executable, "-c", STARTER, uri, fallback]
    procs = [
        subprocess.Popen([*command, f"run{i}", at], stdout=subprocess.PIPE, text=True)
        for i in range(4)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [out.strip() for out, _ in outputs] == ["OK"] * 4
    client = mlflow_client(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    names = {r.info.run_name for r in client.search_runs(experiments)}
    assert names == {"run0", "run1", "run2", "run3"}
