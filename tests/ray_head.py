"""One Ray instance shared by the tests that run Ray in their own process (Ray Train, Tune).

Starting a Ray instance costs about 20 s on 2 cores; joining a running one about a second.
So a head node is started once per test session (per pytest-xdist worker), as a user
starts one (``ray start --head --block``), and each such test joins it through
``$RAY_ADDRESS``, as a stage joins a cluster (``pipeline.cluster.ray_cluster``), and leaves
it when it ends. It runs only while tests need it (:class:`SharedHead`): an idle head costs
about 4 CPU-seconds a minute on 2 cores, which the session's other tests would pay.
The instance is private to the session: its own temp dir (it records no address in
``/tmp/ray``), its own token, ports picked free, every socket on 127.0.0.1; it ends with
the process that started it, even one killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.cluster import free_port

STARTED = "Ray runtime started."  # what `ray start` prints once its node is registered
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # in the child, before exec: SIGTERM when the tests end
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def ray_head(num_cpus: int = 2, timeout_s: float = 300) -> Iterator[dict[str, str]]:
    """A running head node for the block: the environment that joins it (``RAY_ADDRESS``
    and its token)."""
    # short: Ray's socket paths under it must fit in 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="hiertx-ray-"))
    token = folder / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    port = free_port()
    join = {
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | join
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by every Ray process: loopback only
    ray = str(Path(sys.executable).parent / "ray")
    log = folder / "head.log"
    with open(log, "w") as out:
        head = subprocess.Popen(
            [ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={port}", f"--num-cpus={num_cpus}", f"--temp-dir={folder / 'ray'}",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={free_port()}", "--disable-usage-stats"],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while STARTED not in log.read_text(errors="replace"):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the shared Ray head did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield join
    finally:
        head.terminate()  # `ray start --block` stops its node's processes
        try:
            head.wait(10)
        except subprocess.TimeoutExpired:  # slow to stop after Tune (~35 s): nothing to keep
            os.killpg(head.pid, signal.SIGKILL)  # its node's processes too
            head.wait()
        shutil.rmtree(folder, ignore_errors=True)


class SharedHead:
    """A :func:`ray_head` that runs while tests need it: :meth:`join` starts it (again, if
    it was stopped), :meth:`stop` ends it (``tests/conftest.py`` does after the last of the
    consecutive tests that ask for it)."""

    def __init__(self) -> None:
        self._running: contextlib.ExitStack | None = None
        self._join: dict[str, str] = {}

    def join(self) -> dict[str, str]:
        """The environment that joins the head, started if it is not running."""
        if self._running is None:
            running = contextlib.ExitStack()
            self._join = running.enter_context(ray_head())
            self._running = running
        return self._join

    def stop(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            running.close()


@contextlib.contextmanager
def joining(join: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``join`` for the block, so that ``ray_cluster`` joins the
    head. Ray read its auth settings (``RAY_AUTH_*``) when this process imported it: they
    are read again at both ends, as Ray does when it turns token auth on itself."""
    from ray._raylet import AuthenticationTokenLoader, Config

    def reread() -> None:  # the config before the token cache (Ray's own order)
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()

    with pytest.MonkeyPatch.context() as env:
        for key, value in join.items():
            env.setenv(key, value)
        reread()
        try:
            yield
        finally:
            env.undo()
            reread()
