"""MLflow tracking: experiments, resume, the fallback store, the pyfunc model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import mlflow
import pytest
import yaml

from pipeline import tracking
from pipeline.tracking import Tracker, store
from pipeline.tracking import tracker as tracker_module
from pipeline.tracking.store import TrackingUnavailable


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
    return store.sqlite_uri(root / "mlflow.db"), tracking.fallback_uri(root)


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
    assert exp == "hiertx-generate-chitchat" and not t.fell_back
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
    # pytest.warns records every warning: the first MLflow store a process opens also warns
    # (SQLAlchemy's SADeprecationWarning), whichever test opens it
    unavailable = [w for w in caught if issubclass(w.category, TrackingUnavailable)]
    assert len(unavailable) == 1 and t.fell_back and t.ref.uri == fallback
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

    _failing_client(monkeypatch, uri)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker.log_metrics({"loss": 2.0}, step=2)
        worker.log_metrics({"loss": 1.0}, step=3)
        driver.log_text("done", "notes.txt")
        driver.end()
    # every warning is recorded (a library's first-use warning too, whichever test comes
    # first): only the tracking's own are counted
    fell_back = [w for w in caught if issubclass(w.category, TrackingUnavailable)]
    assert len(fell_back) == 2
    assert worker.fell_back and driver.fell_back and driver.ref.uri == fallback
    assert worker.run_id == driver.run_id != origin  # both found the same fallback run
    run = _run(fallback, driver.run_id)
    assert run.data.tags[store.TAG_ORIGIN] == origin and run.data.tags["k"] == "v"
    client = mlflow.tracking.MlflowClient(fallback)
    steps = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert steps == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert run.data.params == {"a": "1"} and run.info.status == "FINISHED"


def test_the_loops_metrics_go_on_from_the_last_step_a_resumed_run_logged(stores, monkeypatch):
    """A training killed after logging step 5 and resumed from its checkpoint of step 3
    recomputes steps 4 and 5 exactly: the sink logs them once. Logging elsewhere (the
    evaluate stage's test metrics at step 0, again on a re-evaluation) stays as it was."""
    uri, fallback = stores
    driver = Tracker.start(uri, fallback, "resumed", "r", resume_key="train-k-2")
    first = driver.sink()
    for step in range(1, 6):
        first.log_metrics({"train_loss": 10.0 - step, "lr": 0.1}, step)
    first.log_metrics({"valid_loss": 4.0}, 4)
    # the resumed process: the same run goes on, from step 3's checkpoint
    again = Tracker.start(uri, fallback, "resumed", "r", resume_key="train-k-2", reuse="any")
    assert again.run_id == driver.run_id
    sink = again.sink()
    for step in range(4, 8):
        sink.log_metrics({"train_loss": 10.0 - step, "lr": 0.1}, step)
        if step % 2 == 0:
            sink.log_metrics({"valid_loss": 8.0 - step}, step)
    again.log_metrics({"test_bleu": 1.0}, 0)
    again.log_metrics({"test_bleu": 2.0}, 0)  # re-evaluated: MLflow shows the latest
    history = {
        key: sorted(tracking.metric_history(uri, again.run_id, key, section=section))
        for key, section in (("train_loss", "curves"), ("valid_loss", "curves"), ("lr", "curves"))
    }
    assert history["train_loss"] == [(s, 10.0 - s) for s in range(1, 8)]
    assert history["lr"] == [(s, 0.1) for s in range(1, 8)]
    assert history["valid_loss"] == [(4, 4.0), (6, 2.0)]
    assert sorted(tracking.metric_history(uri, again.run_id, "test_bleu", section="")) == [
        (0, 1.0),
        (0, 2.0),
    ]
    # a sink that falls back replays its history whole into the fallback run
    _failing_client(monkeypatch, uri)
    with pytest.warns(TrackingUnavailable):
        sink.log_metrics({"train_loss": 2.0}, 8)
    steps = tracking.metric_history(fallback, sink.run_id, "train_loss")
    assert sorted(steps) == [(s, 10.0 - s) for s in range(4, 9)]


# --------------------------------------------------------------------------- where the store is


def test_store_is_the_projects_and_manifests_record_it_relative(tmp_path, monkeypatch):
    monkeypatch.delenv(store.TRACKING_URI_ENV, raising=False)
    monkeypatch.delenv(store.DVC_ROOT_ENV, raising=False)
    project = tmp_path / "project"
    uri = tracking.tracking_uri(project)
    assert uri == f"sqlite:///{project / 'mlflow.db'}"
    assert tracking.portable_uri(uri, project) == "sqlite:///mlflow.db"
    fallback = tracking.fallback_uri(project)
    assert tracking.portable_uri(fallback, project) == "sqlite:///runs/mlflow-fallback/mlflow.db"
    # a copied (or moved) project reads its own store, not the original's
    moved = tmp_path / "elsewhere"
    assert tracking.resolve_uri("sqlite:///mlflow.db", moved) == f"sqlite:///{moved / 'mlflow.db'}"
    # servers and stores outside the project are kept as they are
    assert tracking.portable_uri("http://127.0.0.1:5000", project) == "http://127.0.0.1:5000"
    outside = f"sqlite:///{tmp_path / 'shared.db'}"
    assert (
        tracking.portable_uri(outside, project) == outside == tracking.resolve_uri(outside, project)
    )
    # a relative $MLFLOW_TRACKING_URI (as the README shows) means the project's folder,
    # whatever the working directory
    monkeypatch.setenv(store.TRACKING_URI_ENV, "sqlite:///mlflow.db")
    monkeypatch.chdir(tmp_path)
    assert tracking.tracking_uri(project) == uri


def test_a_dvc_temp_experiment_logs_into_the_workspace_store(tmp_path, monkeypatch):
    monkeypatch.delenv(store.TRACKING_URI_ENV, raising=False)
    workspace = tmp_path / "ws"
    copy = workspace / ".dvc" / "tmp" / "exps" / "standalone" / "tmpab12cd"  # as DVC 3.67
    copy.mkdir(parents=True)
    # as DVC runs a stage of `dvc exp run --temp`: cwd = the copy, $DVC_ROOT = the workspace
    monkeypatch.setenv(store.DVC_ROOT_ENV, str(workspace))
    assert store.project_root(copy) == workspace.resolve()
    assert tracking.tracking_uri(copy) == f"sqlite:///{workspace.resolve() / 'mlflow.db'}"
    assert tracking.fallback_uri(copy).startswith(f"sqlite:///{workspace.resolve() / 'runs'}")
    assert tracking.portable_uri(tracking.tracking_uri(copy), copy) == "sqlite:///mlflow.db"
    # a stage script run by hand inside the copy (no $DVC_ROOT) finds it from the layout
    monkeypatch.delenv(store.DVC_ROOT_ENV)
    assert store.project_root(copy / "sub") == workspace.resolve()
    # $DVC_ROOT of another project (a stage that trains elsewhere) changes nothing
    monkeypatch.setenv(store.DVC_ROOT_ENV, str(workspace))
    assert store.project_root(tmp_path / "other") == (tmp_path / "other").resolve()
    assert store.project_root(workspace) == workspace.resolve()


# --------------------------------------------------------------------------- re-runs


def test_reuse_any_goes_on_in_a_finished_run_never_starts_afresh(stores):
    uri, fallback = stores
    first = Tracker.start(uri, fallback, "reuse", "r", resume_key="train-k-1")
    first.log_params({"scale": {"cpus": 1}, "lr": 0.1})
    first.log_metrics({"valid_loss": 2.0}, step=5)
    first.end()
    # a training resuming its (finished) checkpoint: the run with its history goes on
    again = Tracker.start(uri, fallback, "reuse", "r", resume_key="train-k-1", reuse="any")
    assert again.run_id == first.run_id and _run(uri, again.run_id).info.status == "RUNNING"
    # a setting outside the run key changed: recorded, not a (fallback-causing) error
    again.log_params({"scale": {"cpus": 2}, "lr": 0.1, "new": 1})
    again.end()
    run = _run(uri, first.run_id)
    assert not again.fell_back and run.info.status == "FINISHED"
    assert run.data.params == {"scale.cpus": "1", "lr": "0.1", "new": "1"}
    assert run.data.tags[f"{store.TAG_CHANGED_PARAM}.scale.cpus"] == "2"
    assert tracking.metric_history(uri, run.info.run_id, "valid_loss") == [(5, 2.0)]
    # a training that starts from step 0 gets a run of its own (no doubled history)
    fresh = Tracker.start(uri, fallback, "reuse", "r", resume_key="train-k-1", reuse="never")
    assert fresh.run_id != first.run_id
    assert _run(uri, fresh.run_id).data.tags[store.TAG_RUN_KEY] == "train-k-1"


def test_end_children_gives_trials_the_schedulers_verdict(stores):
    uri, fallback = stores
    parent = Tracker.start(uri, fallback, "children", "tune")
    kids = {}
    for trial in ("a", "b", "c", "d", "e"):
        kids[trial] = Tracker.start(
            uri, fallback, "children", trial, {tracking.TAG_TRIAL: trial}, parent.run_id
        )
    kids["b"].end("KILLED")  # interrupted after its last report
    kids["d"].end("FINISHED")
    kids["e"].end("FAILED")  # an invalid config: the trial reported inf and ended itself
    verdict = {"a": "FINISHED", "b": "FINISHED", "c": "FAILED", "e": "FINISHED"}
    assert parent.end_children(verdict) == 3
    status = {t: _run(uri, k.run_id).info.status for t, k in kids.items()}
    assert status == {
        "a": "FINISHED",
        "b": "FINISHED",
        "c": "FAILED",
        "d": "FINISHED",
        "e": "FAILED",
    }
    lost = Tracker.start(uri, fallback, "children", "e", {}, parent.run_id)
    assert parent.end_children({}, default="FAILED") == 1
    assert _run(uri, lost.run_id).info.status == "FAILED"


# --------------------------------------------------------------------------- server failures


def _failing_client(monkeypatch, uri: str):
    """The server at ``uri`` stops answering the tracker; the returned call brings it back."""
    real_client = store.mlflow_client

    def failing(u: str):
        if u == uri:
            raise ConnectionError("server went away")
        return real_client(u)

    monkeypatch.setattr(tracker_module, "mlflow_client", failing)
    return lambda: monkeypatch.setattr(tracker_module, "mlflow_client", real_client)


def test_the_partial_server_run_is_failed_when_the_server_answers_again(stores, monkeypatch):
    uri, fallback = stores
    driver = Tracker.start(uri, fallback, "partial", "r", resume_key="train-p-1")
    driver.log_params({"a": 1})
    worker = driver.ref.attach()
    worker.log_metrics({"loss": 3.0}, step=1)
    origin = driver.run_id
    back = _failing_client(monkeypatch, uri)
    with pytest.warns(TrackingUnavailable):
        worker.log_metrics({"loss": 2.0}, step=2)  # only the worker meets the dead server
    back()  # the server answers again before the driver logs anything
    driver.log_text("done", "notes.txt")
    driver.end()
    # the driver joined the worker's fallback run: it holds the whole run
    assert driver.fell_back and driver.ref.uri == fallback and driver.run_id == worker.run_id
    whole = _run(fallback, driver.run_id)
    assert whole.data.params == {"a": "1"} and whole.info.status == "FINISHED"
    assert tracking.metric_history(fallback, driver.run_id, "loss") == [(1, 3.0), (2, 2.0)]
    partial = _run(uri, origin)
    assert partial.info.status == "FAILED"
    assert partial.data.tags[store.TAG_FALLBACK_RUN] == driver.run_id
    # resuming the training goes on in the run that holds the history, not the partial one
    again = Tracker.start(uri, fallback, "partial", "r", resume_key="train-p-1", reuse="any")
    assert again.fell_back and again.run_id == driver.run_id


def test_a_rerun_goes_on_in_the_fallback_run_when_the_server_was_still_down(stores, monkeypatch):
    uri, fallback = stores
    driver = Tracker.start(uri, fallback, "down", "r", resume_key="train-d-1")
    origin = driver.run_id
    back = _failing_client(monkeypatch, uri)
    with pytest.warns(TrackingUnavailable):
        driver.log_metrics({"loss": 1.0}, step=1)
        driver.end()  # one try to fail the server run: still down
    back()
    assert _run(uri, origin).info.status == "RUNNING"
    again = Tracker.start(uri, fallback, "down", "r", resume_key="train-d-1", reuse="any")
    assert again.fell_back and again.run_id == driver.run_id
    again.end()  # the server answers now: the partial run is closed
    assert _run(uri, origin).info.status == "FAILED"


@pytest.mark.slow
def test_dvc_exp_run_temp_logs_into_the_workspace_store(tmp_path):
    """DVC runs `dvc exp run --temp` in <workspace>/.dvc/tmp/exps/<tmp>/ and deletes it
    afterwards: the run must land in the workspace's store."""
    repo = Path(__file__).resolve().parents[1]
    workspace = tmp_path / "ws"
    workspace.mkdir()
    stage = (
        "import os; from pipeline import tracking; "
        "t = tracking.Tracker.start(tracking.tracking_uri('.'), tracking.fallback_uri('.'), "
        "'temp-exp', 'r', tags={'cwd': os.getcwd()}); t.end(); "
        "open('out.txt', 'w').write(t.ref.uri)"
    )
    log = {"cmd": f'{sys.executable} -c "{stage}"', "outs": ["out.txt"]}
    (workspace / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"log": log}}))
    env = {k: v for k, v in os.environ.items() if k not in (store.TRACKING_URI_ENV, "DVC_ROOT")}
    env.update(
        PYTHONPATH=str(repo),
        DVC_NO_ANALYTICS="1",
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@example.com",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@example.com",
    )
    dvc = str(Path(sys.executable).parent / "dvc")
    for command in (
        ["git", "init", "-q"],
        [dvc, "init", "-q"],
        ["git", "add", "-A"],
        ["git", "commit", "-qm", "init"],
        [dvc, "exp", "run", "--temp"],
    ):
        done = subprocess.run(
            command, cwd=workspace, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
    client = mlflow.tracking.MlflowClient(store.sqlite_uri(workspace / "mlflow.db"))
    runs = client.search_runs([client.get_experiment_by_name("temp-exp").experiment_id])
    assert len(runs) == 1
    ran_in = Path(runs[0].data.tags["cwd"])
    assert ran_in.is_relative_to((workspace / ".dvc" / "tmp" / "exps").resolve())
    assert not ran_in.exists()  # DVC removed the copy; the run is still in the workspace


def test_sync_mlflow_says_what_to_do_when_there_is_nothing_to_sync(tmp_path, monkeypatch, capsys):
    from pipeline import cli

    monkeypatch.delenv(store.TRACKING_URI_ENV, raising=False)
    assert cli.main(["sync-mlflow", "--root", str(tmp_path)]) == 0
    assert "no fallback store" in capsys.readouterr().out
    fallback = tracking.fallback_uri(tmp_path)
    Tracker.start(fallback, fallback, "e", "r").end()
    # a store synced into itself is refused, saying where to point the sync...
    assert cli.main(["sync-mlflow", "--root", str(tmp_path), "--to", fallback]) == 2
    assert "MLFLOW_TRACKING_URI: source and target are the same store" in capsys.readouterr().err
    # ...and a server that does not answer is named
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    dead = _closed_port_uri()
    assert cli.main(["sync-mlflow", "--root", str(tmp_path), "--to", dead]) == 1
    assert f"cannot sync into {dead}" in capsys.readouterr().err


@pytest.mark.slow
def test_a_moved_project_store_keeps_its_artifacts_and_models_beside_it(tmp_path):
    from pipeline.serving import ServingSpec, log_pyfunc
    from tests.test_serving import tiny_checkpoint

    first = tmp_path / "first"
    first.mkdir()
    checkpoint, vocab = tiny_checkpoint(first)
    uri = tracking.tracking_uri(first)
    t = Tracker.start(uri, tracking.fallback_uri(first), "moving", "r")
    t.log_text("before", "notes/before.txt")
    spec = ServingSpec("generate")
    version = t.call(
        lambda client, run_id: log_pyfunc(
            client.tracking_uri,
            run_id,
            "moving-model",
            checkpoint=checkpoint,
            vocab=vocab,
            spec=spec,
        )
    )
    t.end()
    moved = tmp_path / "moved"
    first.rename(moved)  # `mv project elsewhere`
    uri = tracking.tracking_uri(moved)
    with pytest.warns(UserWarning, match="was moved or copied"):
        again = Tracker.start(uri, tracking.fallback_uri(moved), "moving", "r2")
    again.log_text("after", "notes/after.txt")
    again.end()
    assert not first.exists()  # nothing re-creates the old folder
    client = mlflow.tracking.MlflowClient(uri)
    for run_id, name in ((t.run_id, "before"), (again.run_id, "after")):
        local = client.download_artifacts(run_id, f"notes/{name}.txt", str(tmp_path))
        assert Path(local).read_text() == name
        assert client.get_run(run_id).info.artifact_uri.startswith((moved / "mlartifacts").as_uri())
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(f"models:/moving-model/{version}")
    finally:
        mlflow.set_tracking_uri(None)
    assert len(model.predict([{"history": ["hi there"]}])) == 1
    assert not first.exists()


def test_the_null_tracker_answers_every_call_a_run_gets_where_tracking_is_off(tmp_path):
    """Callers log unconditionally; with tracking off nothing is written anywhere."""
    import inspect

    null = tracking.NullTracker()
    assert not null.recording and tracking.Tracker.recording
    assert null.sink is None and null.ref is None and null.run_id is None
    shared = ["log_params", "set_tags", "log_metrics", "log_dict", "end_children", "end"]
    for name in shared:
        ours, theirs = getattr(tracking.NullTracker, name), getattr(tracking.Tracker, name)
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(theirs).parameters
        ), name
    null.log_params({"a": 1})
    null.log_metrics({"loss": 1.0}, step=3)
    assert null.end_children({"t": "FINISHED"}) == 0
    null.end("FAILED")
    assert list(tmp_path.iterdir()) == []


def test_the_input_hashes_come_from_dvc_lock_and_a_broken_one_only_warns(tmp_path):
    """The run's input tags are read before training: a lock file a merge left conflicted
    raised a raw YAML error from the tracking code."""
    lock = tmp_path / "dvc.lock"
    lock.write_text(
        yaml.safe_dump(
            {
                "schema": "2.0",
                "stages": {
                    "tokenize@chitchat": {
                        "deps": [{"path": "data/raw/chitchat", "md5": "raw1.dir"}],
                        "outs": [{"path": "data/shards/chitchat", "md5": "abc.dir"}],
                    }
                },
            }
        )
    )
    inputs = ["data/shards/chitchat", "data/raw/chitchat", "data/shards/ptb"]
    assert store.dvc_input_hashes(tmp_path, inputs) == {
        "data/shards/chitchat": "abc.dir",
        "data/raw/chitchat": "raw1.dir",
    }
    lock.write_text("stages:\n<<<<<<< HEAD\n  a: 1\n=======\n  a: 2\n>>>>>>> theirs\n")
    with pytest.warns(UserWarning, match=r"dvc\.lock is no DVC lock file .*tagged without"):
        assert store.dvc_input_hashes(tmp_path, inputs) == {}
    lock.write_text("stages: [a, b]\n")
    with pytest.warns(UserWarning, match="is no DVC lock file"):
        assert store.dvc_input_hashes(tmp_path, inputs) == {}
