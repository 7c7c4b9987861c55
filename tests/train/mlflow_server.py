"""A real ``mlflow server`` on 127.0.0.1 that tests can stop and start again (same port,
same database and artifact folder), as a server that dies and comes back."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base: str, path: str, body: dict | None = None) -> dict:
    """One request to the server's REST API (what the MLflow UI reads)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


class MlflowServer:
    def __init__(
        self,
        folder: Path,
        backend: str | None = None,
        artifacts: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``backend``: the server's store (a ``postgresql+psycopg2://`` URI, as ``infra/mlflow``
        deploys it); a sqlite file in ``folder`` by default. ``artifacts``: where the server
        puts the artifacts it proxies (``--artifacts-destination``: a bucket's URI, with
        ``env`` reaching the bucket); a folder in ``folder`` by default."""
        self.folder = folder
        self.backend = backend or f"sqlite:///{folder / 'server.db'}"
        self.artifacts = artifacts or str(folder / "artifacts")
        self.env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> None:
        env = {**os.environ, **self.env, "MLFLOW_DISABLE_TELEMETRY": "true"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
             "--port", str(self.port),
             "--backend-store-uri", self.backend,
             "--artifacts-destination", self.artifacts, "--workers", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() ends its workers too
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("mlflow server did not start")
            time.sleep(1)

    def stop(self) -> None:
        """Stop the server and wait until its port refuses connections."""
        if self.process is None:
            return
        try:
            group = os.getpgid(self.process.pid)
        except ProcessLookupError:  # it died on its own (a server that did not start)
            self.process.wait()
            self.process = None
            return
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # uvicorn's workers may outlive the parent briefly
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.5)
