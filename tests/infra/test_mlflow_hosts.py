"""The team MLflow server answers every hostname the cluster configs reach it by.

MLflow >= 3.5 answers 403 "Invalid Host header" to a Host it was not told to allow, and an
explicit list replaces its defaults (localhost and private addresses). The compose file
takes the list from configuration (``MLFLOW_ALLOWED_HOSTS`` in ``.env`` ->
``MLFLOW_SERVER_ALLOWED_HOSTS``); this test starts a real ``mlflow server`` on 127.0.0.1
with ``.env.example``'s list and sends requests with the Host headers of every
``MLFLOW_TRACKING_URI`` in ``infra/`` (KubeRay's Service, the ``ray up`` and Slurm configs),
a private address, and one it must refuse. b8b1803's fixed ``--allowed-hosts`` list
refused all but ``localhost:5000``/``mlflow:5000``.
"""

from __future__ import annotations

import http.client
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.train.mlflow_server import MlflowServer

INFRA = Path(__file__).resolve().parents[2] / "infra"
COMPOSE = INFRA / "mlflow" / "docker-compose.yaml"
SEARCH = "/ajax-api/2.0/mlflow/experiments/search?max_results=1"  # not a health endpoint


def env_example() -> dict[str, str]:
    lines = (INFRA / "mlflow" / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def tracking_hosts() -> set[str]:
    """The host:port of every MLFLOW_TRACKING_URI the cluster configs set."""
    texts = [p.read_text() for p in INFRA.rglob("*") if p.suffix in {".yaml", ".sh", ".sbatch"}]
    uris = re.findall(r"MLFLOW_TRACKING_URI\W+(?:value: \"?|\$\{MLFLOW_TRACKING_URI:-)?"
                      r"(https?://[^\s\"'}]+)", "\n".join(texts))  # fmt: skip
    return {uri.split("://", 1)[1].split("/", 1)[0] for uri in uris} - {"127.0.0.1:5000"}


def test_compose_takes_the_allowed_hosts_from_configuration() -> None:
    service = yaml.safe_load(COMPOSE.read_text())["services"]["mlflow"]
    assert "--allowed-hosts" not in service["command"]  # it would replace the variable
    assert service["environment"]["MLFLOW_SERVER_ALLOWED_HOSTS"].startswith(
        "${MLFLOW_ALLOWED_HOSTS:?"
    )
    assert "pip install" not in service["command"]  # the drivers are in the image
    assert {"mlflow.mlflow.svc:5000", "CHANGE-ME-mlflow:5000"} <= tracking_hosts()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_SERVER_ALLOWED_HOSTS", env_example()["MLFLOW_ALLOWED_HOSTS"])
        running = MlflowServer(tmp_path_factory.mktemp("mlflow"))
        running.start()
    yield running
    running.stop()


def status(server: MlflowServer, host: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("GET", SEARCH, headers={"Host": host})
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.mark.slow
def test_every_cluster_hostname_gets_through(server: MlflowServer) -> None:
    hosts = [*sorted(tracking_hosts()), f"127.0.0.1:{server.port}", "10.0.3.7:5000"]
    assert {host: status(server, host) for host in hosts} == dict.fromkeys(hosts, 200)
    assert status(server, "evil.example.com:5000") == 403
    assert status(server, "172.32.0.1:5000") == 403  # not a private address
