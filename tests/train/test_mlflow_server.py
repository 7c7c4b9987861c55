"""A real ``mlflow server`` on 127.0.0.1 shows a training run, its metrics and the
registered model over its REST API (what the MLflow UI and teams' tooling read), with the
run's artifacts in a bucket of the local S3 server, as a team deploys ``infra/mlflow``
(``MLFLOW_ARTIFACTS_DESTINATION=s3://...``)."""

from __future__ import annotations

import shutil
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from pipeline import cli, tracking
from pipeline.plan import RunRequest, checked, plan_training
from pipeline.serving import ServingSpec, log_pyfunc
from pipeline.tracking import Tracker
from pipeline.tracking import store as tracking_store
from pipeline.tracking import sync as tracking_sync
from pipeline.tracking.store import TrackingUnavailable
from pipeline.train.training import train_plan
from tests.s3_server import S3Server
from tests.test_serving import tiny_checkpoint
from tests.train import postgres
from tests.train.conftest import stage_params
from tests.train.mlflow_server import MlflowServer, call


@dataclass(frozen=True)
class TeamServer:
    """A running team server and the bucket its artifacts go to."""

    url: str
    s3: S3Server
    bucket: str


@pytest.fixture(params=["sqlite", "postgresql"])
def mlflow_server(request, tmp_path: Path, s3_server: S3Server) -> Iterator[TeamServer]:
    """A real server on a sqlite file, and on a real PostgreSQL (``infra/mlflow``'s store),
    its artifacts in a fresh bucket. Only the server has the bucket's credentials: the
    trainings send artifacts through it (``--serve-artifacts``, on by default)."""
    database = None
    if request.param == "postgresql":
        if reason := postgres.available():
            pytest.skip(reason)
        database = postgres.Postgres()
        database.start()
    bucket = s3_server.new_bucket()
    server = MlflowServer(
        tmp_path,
        backend=database.uri if database else None,
        artifacts=f"s3://{bucket}/mlartifacts",
        env=s3_server.env,
    )
    try:
        server.start()
        yield TeamServer(server.url, s3_server, bucket)
    finally:
        server.stop()
        if database:
            database.stop()


@pytest.mark.slow
def test_server_shows_run_metrics_and_registered_model(
    project, mlflow_server: TeamServer, monkeypatch, tmp_path
):
    # a project of its own: training in the shared one would resume that project's run
    own = tmp_path / "project"
    shutil.copytree(project / "data" / "shards", own / "data" / "shards")
    for name in mlflow_server.s3.env:  # the training holds no key to the bucket
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    plan = plan_training(RunRequest.of(checked(stage_params()), "transformer-chitchat"), own)
    trained = train_plan(plan, show_progress=False)
    mf = trained.mlflow
    assert not mf.fallback, "training must log to the server, not to the local fallback"

    server = mlflow_server.url
    experiment = call(
        server,
        "/api/2.0/mlflow/experiments/get-by-name?experiment_name="
        + urllib.request.quote(mf.experiment),
    )["experiment"]
    runs = call(
        server, "/api/2.0/mlflow/runs/search",
        {"experiment_ids": [experiment["experiment_id"]], "max_results": 10},
    )["runs"]  # fmt: skip
    run = next(r for r in runs if r["info"]["run_id"] == mf.run_id)
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["train.optimizer.lr"] == "0.003"
    history = call(
        server,
        f"/api/2.0/mlflow/metrics/get-history?run_id={mf.run_id}&metric_key=curves/valid_loss",
    )["metrics"]
    assert len(history) == 2
    best = min(m["value"] for m in history)
    assert best == pytest.approx(trained.metrics["best_valid_loss"], rel=1e-6)

    search = "/api/2.0/mlflow/registered-models/search?max_results=10"  # GET, unlike runs
    models = call(server, search)["registered_models"]
    registered = next(m for m in models if m["name"] == mf.registered_model)
    versions = registered["latest_versions"]
    assert any(v["version"] == mf.model_version and v["run_id"] == mf.run_id for v in versions)

    # the model the version points at lies in the team's bucket, put there by the server
    version = call(
        server,
        f"/api/2.0/mlflow/model-versions/get?name={mf.registered_model}&version={mf.model_version}",
    )["model_version"]
    assert version["source"].startswith(("models:/", "mlflow-artifacts:/", "runs:/"))
    stored = mlflow_server.s3.keys(mlflow_server.bucket)
    assert any(k.startswith("mlartifacts/") and k.endswith("/MLmodel") for k in stored), stored
    assert not (tmp_path / "artifacts").exists()  # nothing went to the server's disk


def _points(client, run_id: str, key: str) -> list[tuple[int, int, float]]:
    return sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.slow
def test_server_dying_mid_run_then_sync_mlflow_carries_the_whole_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    server = MlflowServer(tmp_path / "server")
    root = tmp_path / "project"
    root.mkdir()
    checkpoint, vocab = tiny_checkpoint(root)
    fallback = tracking.fallback_uri(root)
    exp = "hiertx/generate/chitchat"
    server.start()
    try:
        driver = Tracker.start(server.url, fallback, exp, "train-x", {"k": "v"}, resume_key="x")
        driver.log_params({"optimizer": {"lr": 0.1}})
        worker = driver.ref.attach()  # rank 0 of the training
        for step in (1, 2, 3):
            worker.log_metrics({"valid_loss": 4.0 - step}, step)
        origin = driver.run_id

        server.stop()  # the server dies mid-training
        with pytest.warns(TrackingUnavailable):
            for step in (4, 5, 6):
                worker.log_metrics({"valid_loss": 4.0 - step}, step)
            driver.log_text("a sample", "samples/generations.txt")
            version = driver.call(  # as the train stage logs its model
                lambda client, run_id: log_pyfunc(
                    client.tracking_uri,
                    run_id,
                    "hiertx-x",
                    checkpoint=checkpoint,
                    vocab=vocab,
                    spec=ServingSpec("generate"),
                )
            )
            driver.end()
        assert driver.fell_back and version == "1"
        # a tune-like parent and child, and a run still being written, in the fallback store
        tune = "hiertx/tune-exp"
        parent = Tracker.start(fallback, fallback, tune, "tune-x")
        child = Tracker.start(fallback, fallback, tune, "t1", parent_run_id=parent.run_id)
        child.log_metrics({"valid_loss": 1.0}, 1)
        child.end()
        parent.end()
        running = Tracker.start(fallback, fallback, tune, "still-running")

        server.start()  # back, with the partial run stuck in RUNNING
        client = mlflow.tracking.MlflowClient(server.url)
        assert client.get_run(origin).info.status == "RUNNING"
        assert len(_points(client, origin, "valid_loss")) == 3

        assert cli.main(["sync-mlflow", "--root", str(root), "--to", server.url]) == 0
        out = capsys.readouterr().out
        assert "3 runs copied, 0 completed, 0 already in sync, 1 still running" in out

        copies = client.search_runs(
            [client.get_experiment_by_name(exp).experiment_id],
            f"tags.`{tracking_sync.TAG_SYNCED_FROM}` = '{driver.run_id}'",
        )
        assert len(copies) == 1
        copy = copies[0]
        source = mlflow.tracking.MlflowClient(fallback)
        assert copy.info.status == "FINISHED"
        assert copy.info.start_time == source.get_run(driver.run_id).info.start_time
        assert copy.data.params == {"optimizer.lr": "0.1"}
        assert copy.data.tags["k"] == "v" and copy.data.tags[tracking_store.TAG_ORIGIN] == origin
        history = _points(client, copy.info.run_id, "valid_loss")
        assert history == _points(source, driver.run_id, "valid_loss")
        assert [s for s, _, _ in history] == [1, 2, 3, 4, 5, 6]
        text = client.download_artifacts(copy.info.run_id, "samples/generations.txt", tmp_path)
        assert Path(text).read_text() == "a sample"
        # the partial server run is closed and points at where the whole run went
        stuck = client.get_run(origin)
        assert stuck.info.status == "FAILED"
        assert stuck.data.tags[tracking_store.TAG_FALLBACK_RUN] == driver.run_id
        assert stuck.data.tags[tracking_sync.TAG_SYNCED_TO] == copy.info.run_id
        # the registered model came along and answers from the server
        versions = client.search_model_versions(f"run_id = '{copy.info.run_id}'")
        assert [v.name for v in versions] == ["hiertx-x"]
        mlflow.set_tracking_uri(server.url)
        try:
            served = mlflow.pyfunc.load_model(f"models:/hiertx-x/{versions[0].version}")
            answer = served.predict(pd.DataFrame({"history": [["hi , how are you ?"]]}))
        finally:
            mlflow.set_tracking_uri(None)
        assert len(answer) == 1 and isinstance(answer[0], str)
        # children name their parent's copy
        tune_exp = client.get_experiment_by_name(tune).experiment_id
        by_source = {
            r.data.tags[tracking_sync.TAG_SYNCED_FROM]: r for r in client.search_runs([tune_exp])
        }
        assert set(by_source) == {parent.run_id, child.run_id}
        assert (
            by_source[child.run_id].data.tags[tracking_store.TAG_PARENT]
            == by_source[parent.run_id].info.run_id
        )

        # idempotent: a second sync adds nothing
        assert cli.main(["sync-mlflow", "--root", str(root), "--to", server.url]) == 0
        assert "0 runs copied, 0 completed, 3 already in sync, 1 still running" in (
            capsys.readouterr().out
        )
        assert len(client.search_runs([copy.info.experiment_id])) == 2  # origin + copy
        assert _points(client, copy.info.run_id, "valid_loss") == history
        assert len(client.search_model_versions("name = 'hiertx-x'")) == 1
        # what the fallback run gains later (the evaluate stage's metrics) is completed
        driver.ref.attach().log_metrics({"eval/bleu": 0.5}, 0)
        assert cli.main(["sync-mlflow", "--root", str(root), "--to", server.url]) == 0
        assert "0 runs copied, 1 completed" in capsys.readouterr().out
        assert client.get_run(copy.info.run_id).data.metrics["eval/bleu"] == 0.5

        # a re-run of the same training resumes the copy, not the partial run
        again = Tracker.start(server.url, fallback, exp, "train-x", resume_key="x", reuse="any")
        assert again.run_id == copy.info.run_id and not again.fell_back
        running.end()
    finally:
        server.stop()
