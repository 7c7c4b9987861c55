"""One ``infra/local_cluster.sh`` cluster that several tests run their commands on.

The script starts its nodes in a private network namespace and runs one command there,
with ``RAY_ADDRESS`` and the cluster's token set; only that command (and what it starts)
reaches the nodes. :class:`LocalCluster` starts the script as a user runs it, with this
file as the command: a small server that runs, inside the namespace, the commands tests
outside ask for, each with the test's environment and the script's ``RAY_*`` variables,
as the test's command would have had as the script's own command. The cluster stays up
between tests; stopping the server ends the script, which stops its nodes.

Requests go through a folder: ``<id>.json`` (``{"args", "cwd", "env"}``, made whole by a
rename) starts a command; its output goes to ``<id>.log`` and its exit status, once it
ends, to ``<id>.rc``. ``ready`` (written by the server) holds the script's environment;
``stop`` (written by a test) ends the server once its commands have ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "infra" / "local_cluster.sh"
# what the script sets for its command: the cluster's address, token and namespace
CLUSTER_VARS = ("RAY_", "HIERTX_CLUSTER_")
POLL_S = 0.1
STRAGGLERS_S = 20.0  # how long a stopped node's orphaned helpers may take to exit
STACKS_S = 3.0  # for a stuck command's processes to print their stacks


def _write_whole(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.rename(path)


def serve(folder: Path, client_pid: int) -> None:
    """Run the commands asked for in ``folder`` until ``stop`` exists and all have ended,
    or until the process ``client_pid`` (the tests) is gone: a killed test run does not
    leave a cluster behind."""
    cluster_env = {k: v for k, v in os.environ.items() if k.startswith(CLUSTER_VARS)}
    running: dict[str, subprocess.Popen] = {}
    _write_whole(folder / "ready", json.dumps(dict(os.environ)))
    while True:
        for request in sorted(folder.glob("*.json")):
            name = request.stem
            if name in running or (folder / f"{name}.rc").exists():
                continue
            asked = json.loads(request.read_text())
            with open(folder / f"{name}.log", "w") as log:
                try:
                    running[name] = subprocess.Popen(
                        asked["args"], cwd=asked["cwd"], env=asked["env"] | cluster_env,
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    )  # fmt: skip
                except OSError as error:  # no such program: as a shell says it
                    log.write(f"{asked['args'][0]}: {error}\n")
                    _write_whole(folder / f"{name}.rc", "127")
        for name, process in list(running.items()):
            if (status := process.poll()) is not None:
                _write_whole(folder / f"{name}.rc", str(status))
                del running[name]
        orphaned = not alive(client_pid)
        if orphaned or ((folder / "stop").exists() and not running):
            for process in running.values():
                process.kill()
            sys.exit(1 if orphaned else 0)
        time.sleep(POLL_S)


def alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process on the machine."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            found[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):  # ended while being read
            continue
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parent(pid: int) -> int | None:
    return _parents().get(pid)


@dataclass
class Command:
    """A command the server runs in the cluster's namespace."""

    cluster: LocalCluster
    name: str

    def poll(self) -> int | None:
        """Its exit status, or None while it runs (an error once the cluster is gone)."""
        try:
            return int((self.cluster.folder / f"{self.name}.rc").read_text())
        except FileNotFoundError:
            self.cluster.check_up()
            return None

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while (status := self.poll()) is None:
            assert time.monotonic() < deadline, self._stuck(timeout_s)
            time.sleep(POLL_S)
        return status

    def _stuck(self, timeout_s: float) -> str:
        """What a command that ran past its time was doing: what runs in the cluster (a
        hang names the process it waits in) and its output's end, with the Python stacks
        that its stages and ``make repro``'s driver print on ``STACKS_SIGNAL``."""
        # imported here, in the tests' process: this file also runs as a script in the
        # cluster's namespace, outside the project's imports
        from pipeline.signals import STACKS_SIGNAL

        processes = self.cluster.processes()
        for pid in processes:
            if any(f"-m {m}" in cmdline(pid) for m in ("stages.", "pipeline.repro")):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, STACKS_SIGNAL)
        time.sleep(STACKS_S)
        running = sorted(cmdline(pid)[:300] for pid in processes)
        return (
            f"{self.name} ran past {timeout_s} s; its output ends:\n{self.output[-20000:]}\n"
            "the cluster's processes:\n" + "\n".join(filter(None, running))
        )

    @property
    def output(self) -> str:
        return (self.cluster.folder / f"{self.name}.log").read_text(errors="replace")


class LocalCluster:
    """``infra/local_cluster.sh OPTIONS -- python tests/infra/local_cluster.py FOLDER``,
    started in the background by :meth:`start`; commands by :meth:`popen` and
    :meth:`run`; :meth:`stop` ends it and checks that none of its processes is left."""

    def __init__(self, folder: Path, options: list[str], env: dict[str, str]) -> None:
        self.folder = folder
        self.options = options
        self.env = {k: v for k, v in env.items() if not k.startswith(CLUSTER_VARS)}
        self.process: subprocess.Popen | None = None
        self.cluster_env: dict[str, str] = {}
        self.lost_a_node = False  # a test killed one of its nodes
        self._count = 0

    def start(self, timeout_s: float = 600) -> LocalCluster:
        self.folder.mkdir(parents=True, exist_ok=True)
        server = [sys.executable, __file__, str(self.folder), str(os.getpid())]
        with open(self.folder / "script.log", "w") as log:
            self.process = subprocess.Popen(
                [str(SCRIPT), *self.options, "--", *server], cwd=REPO, env=self.env,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not (self.folder / "ready").exists():
            self.check_up()
            assert time.monotonic() < deadline, f"no cluster after {timeout_s} s:\n{self.log}"
            time.sleep(POLL_S)
        self.cluster_env = json.loads((self.folder / "ready").read_text())
        return self

    @property
    def log(self) -> str:
        """What the script printed (its nodes' start, its clean-up)."""
        return (self.folder / "script.log").read_text(errors="replace")

    @property
    def workdir(self) -> Path:
        """The script's own folder (its token, the nodes' logs and Ray's temp dir)."""
        return Path(self.cluster_env["RAY_AUTH_TOKEN_PATH"]).parent

    def check_up(self) -> None:
        assert self.process is not None and self.process.poll() is None, (
            f"infra/local_cluster.sh ended:\n{self.log[-4000:]}"
        )

    def popen(self, cwd: Path, env: dict[str, str], *args: str) -> Command:
        self._count += 1
        name = f"command-{self._count}"
        request = {"args": list(args), "cwd": str(cwd), "env": env}
        _write_whole(self.folder / f"{name}.json", json.dumps(request))
        return Command(self, name)

    def run(self, cwd: Path, env: dict[str, str], *args: str, timeout_s: float = 1200) -> str:
        """``args`` run in the cluster; their output (asserted to succeed)."""
        command = self.popen(cwd, env, *args)
        status = command.wait(timeout_s)
        assert status == 0, f"{' '.join(args)} failed ({status}):\n{command.output[-6000:]}"
        return command.output

    def processes(self) -> set[int]:
        """The processes under the script: its nodes' and the commands'."""
        assert self.process is not None
        parents = _parents()
        found, new = set(), {self.process.pid}
        while new:
            found |= new
            new = {pid for pid, ppid in parents.items() if ppid in new} - found
        return found

    def stop(self, timeout_s: float = 120) -> list[str]:
        """End the server, then the script; the command lines of the script's processes
        (the nodes', Ray's workers') still alive afterwards: none, if it cleaned up."""
        assert self.process is not None
        started = self.processes()
        (self.folder / "stop").touch()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGTERM)  # the script's own clean-up
            self.process.wait(timeout_s)
        assert self.process.returncode == 0, f"the script ended badly:\n{self.log[-4000:]}"
        workdir = str(self.workdir)
        # A node's orphans end on their own once their parent is gone (the dashboard's
        # multiprocessing forkserver and resource tracker read EOF): a few seconds' grace.
        deadline = time.monotonic() + STRAGGLERS_S
        while True:
            left = {p for p in started if alive(p)}
            left |= {int(p.parent.name) for p in Path("/proc").glob("[0-9]*/cmdline")
                     if workdir in cmdline(int(p.parent.name))}  # fmt: skip
            left = {p for p in left if alive(p)}
            if not left or time.monotonic() > deadline:
                return sorted(cmdline(p) for p in left)
            time.sleep(0.5)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]))
