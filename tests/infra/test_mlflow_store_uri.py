"""The team MLflow server reaches its PostgreSQL whatever the password holds.

``infra/mlflow/docker-compose.yaml`` pasted ``$POSTGRES_PASSWORD`` into
``postgresql+psycopg2://mlflow:PASSWORD@postgres:5432/mlflow``: a password with ``@``,
``:``, ``/`` or ``%`` (what a password generator gives) split the URI elsewhere, and the
server could not connect. The image's entry point (``infra/mlflow/serve.py``) escapes it;
SQLAlchemy, which MLflow's store uses, reads back the very password.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

MLFLOW = Path(__file__).resolve().parents[2] / "infra" / "mlflow"
PASSWORDS = ["p@ss:w/rd%", "a%40b", "x@postgres:5432/other", "plain", "sp ace#?&="]


def serve() -> Any:
    spec = importlib.util.spec_from_file_location("mlflow_serve", MLFLOW / "serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("password", PASSWORDS)
def test_the_password_reaches_postgres_unchanged(password: str) -> None:
    url = make_url(serve().backend_store_uri(password))
    assert (url.drivername, url.username, url.password) == (
        "postgresql+psycopg2",
        "mlflow",
        password,
    )
    assert (url.host, url.port, url.database) == ("postgres", 5432, "mlflow")


def test_the_server_starts_through_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    service = yaml.safe_load((MLFLOW / "docker-compose.yaml").read_text())["services"]["mlflow"]
    assert "hiertx-mlflow-serve" in service["command"]
    assert "POSTGRES_PASSWORD@" not in service["command"]  # no URI pasted together here
    assert service["environment"]["POSTGRES_PASSWORD"] == "${POSTGRES_PASSWORD}"
    dockerfile = (MLFLOW / "Dockerfile").read_text()
    assert "COPY serve.py /usr/local/bin/hiertx-mlflow-serve" in dockerfile
    assert (MLFLOW / "serve.py").read_text().startswith("#!/usr/bin/env python3\n")
    module = serve()
    ran: list[list[str]] = []
    monkeypatch.setattr(module.os, "execvp", lambda file, args: ran.append(args))
    monkeypatch.setenv("POSTGRES_PASSWORD", "p@ss:w/rd%")
    module.main(["--host", "0.0.0.0", "--port", "5000"])
    assert ran[0][:3] == ["mlflow", "server", "--backend-store-uri"]
    assert make_url(ran[0][3]).password == "p@ss:w/rd%"
    assert ran[0][4:] == ["--host", "0.0.0.0", "--port", "5000"]
