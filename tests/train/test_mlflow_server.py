"""A real ``mlflow server`` on 127.0.0.1 shows a training run, its metrics and the
registered model over its REST API (what the MLflow UI and teams' tooling read)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.config import parse_params
from pipeline.train.run import train_run
from tests.train.conftest import stage_params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(base: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def mlflow_server(tmp_path: Path):
    port = _free_port()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {server.stderr.read()[-2000:]}")
            time.sleep(1)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.mark.slow
def test_server_shows_run_metrics_and_registered_model(
    project, mlflow_server, monkeypatch, tmp_path
):
    # a project of its own: training in the shared one would resume that project's run
    own = tmp_path / "project"
    shutil.copytree(project / "data" / "shards", own / "data" / "shards")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    manifest = train_run(parse_params(stage_params()), "transformer", "chitchat", own, False)
    mf = manifest["mlflow"]
    assert not mf["fallback"], "training must log to the server, not to the local fallback"

    experiment = _call(
        mlflow_server,
        "/api/2.0/mlflow/experiments/get-by-name?experiment_name="
        + urllib.request.quote(mf["experiment"]),
    )["experiment"]
    runs = _call(
        mlflow_server, "/api/2.0/mlflow/runs/search",
        {"experiment_ids": [experiment["experiment_id"]], "max_results": 10},
    )["runs"]  # fmt: skip
    run = next(r for r in runs if r["info"]["run_id"] == mf["run_id"])
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["train.optimizer.lr"] == "0.003"
    history = _call(
        mlflow_server,
        f"/api/2.0/mlflow/metrics/get-history?run_id={mf['run_id']}&metric_key=valid_loss",
    )["metrics"]
    assert len(history) == 2
    best = min(m["value"] for m in history)
    assert best == pytest.approx(manifest["metrics"]["best_valid_loss"], rel=1e-6)

    search = "/api/2.0/mlflow/registered-models/search?max_results=10"  # GET, unlike runs
    models = _call(mlflow_server, search)["registered_models"]
    registered = next(m for m in models if m["name"] == mf["registered_model"])
    versions = registered["latest_versions"]
    assert any(
        v["version"] == mf["model_version"] and v["run_id"] == mf["run_id"] for v in versions
    )
