"""MLflow tracking: experiments, resume, the fallback store, the pyfunc model."""

from __future__ import annotations

import socket
import warnings
from pathlib import Path

import mlflow
import pytest

from pipeline import tracking
from pipeline.tracking import Tracker, TrackingUnavailable


def _closed_port_uri() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def _run(uri: str, run_id: str):
    return mlflow.tracking.MlflowClient(uri).get_run(run_id)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """One primary and one fallback store for the module (creating a sqlite store takes
    seconds); tests keep apart by experiment name."""
    root = tmp_path_factory.mktemp("mlflow")
    return tracking.sqlite_uri(root / "mlflow.db"), tracking.fallback_uri(root)


@pytest.fixture(autouse=True)
def _no_retries(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def test_run_logs_params_metrics_and_artifacts_beside_the_db(stores):
    uri, fallback = stores
    exp = tracking.experiment_name("generate", "chitchat")
    t = Tracker.start(uri, fallback, exp, "train-x", tags={tracking.TAG_MODEL: "x"})
    t.log_params({"optimizer": {"lr": 0.1, "betas": (0.9, 0.98)}, "seed": 3})
    t.log_metrics({"valid_loss": 2.5}, step=4)
    t.log_metrics({"valid_loss": 2.0}, step=8)
    t.log_text("hello", "samples.txt")
    t.end()
    run = _run(uri, t.run_id)
    assert exp == "hiertx/generate/chitchat" and not t.fell_back
    assert run.data.params == {"optimizer.lr": "0.1", "optimizer.betas": "(0.9, 0.98)", "seed": "3"}
    assert run.data.tags[tracking.TAG_MODEL] == "x" and run.info.status == "FINISHED"
    history = mlflow.tracking.MlflowClient(uri).get_metric_history(t.run_id, "valid_loss")
    assert [(m.step, m.value) for m in history] == [(4, 2.5), (8, 2.0)]
    db = Path(uri.removeprefix("sqlite:///"))
    assert run.info.artifact_uri.startswith((db.parent / "mlartifacts").as_uri())
    assert (
        Path(run.info.artifact_uri.removeprefix("file://")) / "samples.txt"
    ).read_text() == "hello"


def test_resume_key_reuses_an_unfinished_run_only(stores):
    uri, fallback = stores
    first = Tracker.start(uri, fallback, "resume", "r", resume_key="train-m-c-123")
    again = Tracker.start(uri, fallback, "resume", "r", resume_key="train-m-c-123")
    assert again.run_id == first.run_id
    again.end()
    fresh = Tracker.start(uri, fallback, "resume", "r", resume_key="train-m-c-123")
    assert fresh.run_id != first.run_id


def test_unreachable_server_at_start_falls_back_and_loses_nothing(stores):
    _, fallback = stores
    dead = _closed_port_uri()
    with pytest.warns(TrackingUnavailable) as caught:
        t = Tracker.start(dead, fallback, "dead", "r", tags={"k": "v"})
        t.log_params({"a": 1})
        t.log_metrics({"m": 1.0}, step=1)
        t.end()
    assert len(caught) == 1 and t.fell_back and t.ref.uri == fallback
    run = _run(fallback, t.run_id)
    assert run.data.params == {"a": "1"} and run.data.metrics == {"m": 1.0}
    assert run.data.tags["k"] == "v" and run.info.status == "FINISHED"


def test_server_dying_mid_run_replays_everything_into_one_fallback_run(stores, monkeypatch):
    uri, fallback = stores
    driver = Tracker.start(uri, fallback, "dying", "r", tags={"k": "v"})
    driver.log_params({"a": 1})
    worker = driver.ref.attach()  # e.g. rank 0 of a Ray run
    origin = driver.run_id
    worker.log_metrics({"loss": 3.0}, step=1)

    real_client = tracking._client

    def failing(u: str):
        if u == uri:
            raise ConnectionError("server went away")
        return real_client(u)

    monkeypatch.setattr(tracking, "_client", failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker.log_metrics({"loss": 2.0}, step=2)
        worker.log_metrics({"loss": 1.0}, step=3)
        driver.log_text("done", "notes.txt")
        driver.end()
    assert [w.category for w in caught] == [TrackingUnavailable, TrackingUnavailable]
    assert worker.fell_back and driver.fell_back and driver.ref.uri == fallback
    assert worker.run_id == driver.run_id != origin  # both found the same fallback run
    run = _run(fallback, driver.run_id)
    assert run.data.tags[tracking.TAG_ORIGIN] == origin and run.data.tags["k"] == "v"
    client = mlflow.tracking.MlflowClient(fallback)
    steps = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert steps == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert run.data.params == {"a": "1"} and run.info.status == "FINISHED"
