#!/usr/bin/env python3
"""The team MLflow server's entry point (infra/mlflow/Dockerfile): ``mlflow server`` on
the compose file's PostgreSQL, the password URL-escaped into the backend store URI.

A password as ``.env`` holds it (``p@ss:w/rd%``) pasted into
``postgresql+psycopg2://mlflow:PASSWORD@postgres:5432/mlflow`` splits the URI at its
``@``, ``:`` or ``/`` and fails to connect; escaped (``p%40ss%3Aw%2Frd%25``), SQLAlchemy
reads it back unchanged.

    hiertx-mlflow-serve [mlflow server options...]   # POSTGRES_PASSWORD from the environment
"""

from __future__ import annotations

import os
import sys
from urllib.parse import quote


def backend_store_uri(password: str, user: str = "mlflow", host: str = "postgres:5432") -> str:
    """The PostgreSQL URI with the user and password escaped for a URI's userinfo."""
    return f"postgresql+psycopg2://{quote(user, safe='')}:{quote(password, safe='')}@{host}/mlflow"


def main(argv: list[str]) -> None:
    uri = backend_store_uri(os.environ["POSTGRES_PASSWORD"])
    command = ["mlflow", "server", "--backend-store-uri", uri, *argv]
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
