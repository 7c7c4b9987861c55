"""``python -m pipeline.repro --jobs 2`` stopped by SIGTERM (a Slurm cancel) or SIGHUP (a
closed terminal), on a toy DVC project with the real ``dvc``: the driver relays the stop
to every stage's process group as it relays Ctrl-C (issue 48).

The toy pipeline: two ``quiet@a``/``quiet@b`` stand-in stages that print nothing, write
their pid to ``pid-<item>``, and on SIGINT write ``stopped-<item>`` and exit (a stage
stopping cleanly); else they sleep for good. ``after`` depends on both, so both run under
``dvc repro -s`` side by side and ``after`` is left to the closing ``dvc repro``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_repro import env, make_project

ITEMS = ["a", "b"]
START_S = 60.0  # two DVC processes starting on a loaded 2-core machine
# the relay, the stages' exits and DVC's, on a loaded CI machine (15 s was too few there)
STOP_S = 40.0

DVC_YAML = """\
stages:
  quiet:
    foreach: [a, b]
    do:
      cmd: python quiet.py ${item}
      deps: [quiet.py]
      outs:  # a block list: "{" opens a mapping in a flow one
        - out/${item}.txt
  after:
    cmd: cat out/a.txt out/b.txt > out/after.txt
    deps: [out/a.txt, out/b.txt]
    outs: [out/after.txt]
"""

QUIET_PY = """\
import os, signal, sys, time

item = sys.argv[1]


def stop(signum, frame):
    with open(f"stopped-{item}", "w") as marker:
        marker.write(f"{signum}\\n")
    sys.exit(130)


signal.signal(signal.SIGINT, stop)
with open(f"pid-{item}.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(f"pid-{item}.tmp", f"pid-{item}")  # the handler is in place once this exists
while True:
    time.sleep(60)
"""


def default_stop_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP back to their default action (in the driver's child)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def stage_pids(project: Path, driver: subprocess.Popen[str]) -> dict[str, int]:
    """Each quiet stage's pid once both have started (and set their SIGINT handler)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and driver.poll() is None:
        if all((project / f"pid-{i}").exists() for i in ITEMS):
            return {i: int((project / f"pid-{i}").read_text()) for i in ITEMS}
        time.sleep(0.1)
    driver.kill()
    pytest.fail(f"the stages did not start: {driver.communicate()[0]}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"]
)
def test_a_signal_to_the_driver_stops_every_quiet_stage_cleanly(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """SIGTERM or SIGHUP to the driver: each stage gets the relayed SIGINT and stops through
    its handler, nothing of a stage is left running, and the driver exits 128 + the signal,
    as it does on Ctrl-C (SIGINT, relayed before issue 48 too: the same path).
    For SIGHUP the driver's stdout is closed first, as a hung-up terminal's is: its own
    "interrupted" line then fails to print, and the relay must still happen."""
    project = make_project(
        tmp_path / "p", DVC_YAML, {"quiet.py": QUIET_PY}, ("/pid-*", "/stopped-*")
    )
    driver = subprocess.Popen(
        [sys.executable, "-m", "pipeline.repro", "--jobs", "2"],
        cwd=project,
        env={**env(), "RAY_OVERRIDE_RESOURCES": '{"GPU": 0}'},  # no Ray instance, no torch
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # the stop signals as a terminal's foreground job has them: a test run started in the
        # background (`make test &`) hands its children SIGINT ignored (Python then installs
        # no KeyboardInterrupt handler), one started under `nohup` SIGHUP ignored, and the
        # driver keeps an inherited SIG_IGN by design
        preexec_fn=default_stop_signals,
    )
    pids = stage_pids(project, driver)
    groups = {i: os.getpgid(pid) for i, pid in pids.items()}
    try:
        assert all(alive(pid) for pid in pids.values())
        if sig == signal.SIGHUP:
            assert driver.stdout is not None
            driver.stdout.close()
        os.kill(driver.pid, sig)
        try:
            code = driver.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver did not exit within {STOP_S} s of {sig.name}")
        output = "" if sig == signal.SIGHUP else driver.communicate()[0]
        deadline = time.monotonic() + 3.0  # an unrelayed stop: give a stage every chance
        while time.monotonic() < deadline and not all(
            (project / f"stopped-{i}").exists() for i in ITEMS
        ):
            time.sleep(0.1)
        stopped = {i: (project / f"stopped-{i}").exists() for i in ITEMS}
        assert stopped == {i: True for i in ITEMS}, output
        assert {i: (project / f"stopped-{i}").read_text() for i in ITEMS} == {
            i: f"{int(signal.SIGINT)}\n" for i in ITEMS
        }
        assert [pid for pid in pids.values() if alive(pid)] == []
        assert {i: group(pgid) for i, pgid in groups.items()} == {i: [] for i in ITEMS}
        assert code == 128 + sig, output
        if sig != signal.SIGHUP:
            assert f"interrupted ({sig.name}): stopping quiet@a, quiet@b" in output
        log = json.loads((project / ".dvc/tmp/repro-times.json").read_text())
        assert sorted(r["stage"] for r in log["stages"]) == ["quiet@a", "quiet@b"]
        assert all(r["returncode"] != 0 for r in log["stages"]) and log["repro"] is None
    finally:  # what an unrelayed stop leaves behind
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pgid in groups.values():
            if group(pgid):
                os.killpg(pgid, signal.SIGKILL)
