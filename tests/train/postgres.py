"""A real PostgreSQL server for one test (Debian's ``postgresql`` binaries): a fresh
cluster in a temporary folder, on 127.0.0.1 and a free port, as ``infra/mlflow`` backs its
MLflow server. ``initdb`` refuses to run as root, so as root the cluster belongs to the
``postgres`` user the Debian package creates."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.train.mlflow_server import free_port

SBIN = os.pathsep.join(["/usr/sbin", "/sbin"])


def _bin_path() -> str:
    """PATH, then Debian's ``/usr/lib/postgresql/<version>/bin`` (newest first), where its
    ``postgresql`` package puts ``initdb`` and ``pg_ctl`` without linking them onto PATH."""
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    return os.pathsep.join([os.environ.get("PATH", ""), *map(str, versions)])


def _tool(name: str) -> str:
    return shutil.which(name, path=_bin_path()) or name


def _runuser() -> str | None:
    """util-linux's ``runuser`` (in /usr/sbin, which a user's PATH may lack)."""
    return shutil.which("runuser", path=os.pathsep.join([os.environ.get("PATH", ""), SBIN]))


def available() -> str | None:
    """Why no server can be started here, or None."""
    if any(shutil.which(tool, path=_bin_path()) is None for tool in ("initdb", "pg_ctl")):
        return (
            "PostgreSQL's initdb/pg_ctl are neither on PATH nor in /usr/lib/postgresql/*/bin "
            "(Debian: apt install postgresql)"
        )
    if os.geteuid() == 0 and _runuser() is None:
        return "running as root without runuser to start PostgreSQL as its own user"
    try:
        import psycopg2  # noqa: F401  (the driver infra/mlflow's store URI names)
    except ImportError:
        return "psycopg2 is not installed (pip install -e '.[dev]')"
    return None


class Postgres:
    """A cluster in a folder of its own under the system's temporary folder (a test's
    ``tmp_path`` lies under a root-only folder the ``postgres`` user cannot enter)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="hiertx-postgres-"))
        self.data = self.folder / "pgdata"
        self.port = free_port()
        self.uri = f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/mlflow"

    def _run(self, *args: str) -> None:
        as_owner = [str(_runuser()), "-u", "postgres", "--"] if os.geteuid() == 0 else []
        command = [_tool(args[0]), *args[1:]]
        subprocess.run([*as_owner, *command], check=True, capture_output=True, text=True)

    def start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust")
        options = f"-h 127.0.0.1 -p {self.port} -k {self.folder}"
        log = str(self.folder / "postgres.log")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", log, "-w", "start")
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "mlflow")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)
