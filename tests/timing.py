"""The suite's time, kept visible and bounded (a plugin ``tests/conftest.py`` registers).

- ``--time-report``: after the run, every test's time (set-up + call + teardown, slowest
  first) and each test file's total, gathered from the reports in the process that
  started the xdist workers.
- ``--time-limit S``: the run fails where a test outside :data:`OVER_A_MINUTE` took more
  than ``S`` seconds, or a shared (module- or session-scoped) fixture took more than ``S``
  to set up. A test's own time leaves out the shared fixtures it happened to set up first
  (or to wait for, built by another worker): those are checked on their own, by name, so
  the verdict does not depend on which test ran first.
- Under xdist, the tests of :data:`OVER_A_MINUTE` start first, in its order (the longest
  last to start is what makes a parallel run long); in one process the order is pytest's.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

# Each test allowed over the limit, by node id (or a prefix of ids: a file, a test with its
# parameters), with what it proves that a shorter test could not. Longest first: the order
# xdist starts them in. Every one is marked ``slow`` (checked at collection). A shared
# fixture is named "<file>::<fixture>".
OVER_A_MINUTE: dict[str, str] = {}
# The reports' user property holding the seconds a test spent setting up shared fixtures.
SHARED = "shared_fixture_setup_s"

PHASES = ("setup", "call", "teardown")
REPO = Path(__file__).resolve().parents[1]


def declared(nodeid: str) -> str | None:
    """The :data:`OVER_A_MINUTE` entry that covers ``nodeid``, if any."""
    for key in OVER_A_MINUTE:
        if nodeid == key or nodeid.startswith((f"{key}[", f"{key}::")):
            return key
    return None


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class Timing:
    """Times each shared fixture's set-up where it runs (every process), and collects each
    test's phases from the reports (in the controller under xdist, where every worker's
    reports arrive) to report or enforce at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.limit: float | None = config.getoption("time_limit")
        self.report = bool(config.getoption("time_report"))
        self.phases: dict[str, dict[str, float]] = defaultdict(dict)
        self.fixtures: dict[str, tuple[float, str]] = {}  # name -> (seconds, first user)
        self.started = time.monotonic()
        self._setting_up: pytest.Item | None = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list) -> None:
        unmarked = [
            item.nodeid
            for item in items
            if declared(item.nodeid) and item.get_closest_marker("slow") is None
        ]
        if unmarked:
            raise pytest.UsageError(
                "tests/timing.py's OVER_A_MINUTE lists tests not marked slow (mark them "
                f"@pytest.mark.slow): {', '.join(unmarked)}"
            )
        if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike
            order = {key: i for i, key in enumerate(OVER_A_MINUTE)}
            rank = {item.nodeid: order.get(declared(item.nodeid), len(order)) for item in items}
            items.sort(key=lambda item: rank[item.nodeid])

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        self._setting_up = item
        try:
            return (yield)
        finally:
            self._setting_up = None

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        started = time.perf_counter()
        try:
            return (yield)
        finally:
            item = self._setting_up
            if fixturedef.scope != "function" and item is not None:
                seconds = time.perf_counter() - started
                name = f"{fixture_file(fixturedef)}::{fixturedef.argname}"
                item.user_properties.append((SHARED, {name: seconds}))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if _is_worker(self.config):
            return
        self.phases[report.nodeid][report.when] = report.duration
        if report.when == "setup":
            for key, value in report.user_properties:
                if key == SHARED:
                    for name, seconds in value.items():
                        self.phases[report.nodeid]["shared"] = (
                            self.phases[report.nodeid].get("shared", 0.0) + seconds
                        )
                        if seconds > self.fixtures.get(name, (0.0, ""))[0]:
                            self.fixtures[name] = (seconds, report.nodeid)

    def over_the_limit(self) -> list[str]:
        if self.limit is None:
            return []
        lines = []
        for nodeid, phases in self.phases.items():
            own = sum(phases.get(p, 0.0) for p in PHASES) - phases.get("shared", 0.0)
            if own > self.limit and declared(nodeid) is None:
                parts = ", ".join(f"{p} {phases[p]:.1f} s" for p in PHASES if p in phases)
                if shared := phases.get("shared", 0.0):
                    parts += f"; not counted: {shared:.1f} s setting up shared fixtures"
                lines.append(f"{nodeid}: {own:.1f} s ({parts})")
        for name, (seconds, first) in self.fixtures.items():
            if seconds > self.limit and declared(name) is None:
                lines.append(f"{name} (a shared fixture): {seconds:.1f} s to set up, for {first}")
        return sorted(lines)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not _is_worker(self.config) and self.over_the_limit() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if _is_worker(self.config):
            return
        write = terminalreporter.write_line
        totals = {
            nodeid: sum(phases.get(p, 0.0) for p in PHASES)
            for nodeid, phases in self.phases.items()
        }
        if self.report and totals:
            terminalreporter.write_sep("=", "every test's time (set-up + call + teardown)")
            for nodeid, total in sorted(totals.items(), key=lambda kv: -kv[1]):
                shared = self.phases[nodeid].get("shared", 0.0)
                note = f"  ({shared:.1f} s setting up shared fixtures)" if shared >= 0.1 else ""
                write(f"{total:8.2f} s  {nodeid}{note}")
            per_file: dict[str, list[float]] = defaultdict(list)
            for nodeid, total in totals.items():
                per_file[nodeid.split("::")[0]].append(total)
            terminalreporter.write_sep("=", "time per test file (its tests' times summed)")
            for path, times in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
                write(f"{sum(times):8.1f} s  {len(times):4d} tests  {path}")
            workers = getattr(self.config.option, "numprocesses", None) or 1
            write(
                f"{sum(totals.values()):8.1f} s  {len(totals):4d} tests in all, "
                f"{time.monotonic() - self.started:.1f} s of wall time on {workers} worker(s)"
            )
        over = self.over_the_limit()
        if over:
            terminalreporter.write_sep(
                "=", f"FAILED: over {self.limit:g} s and not in tests/timing.py's OVER_A_MINUTE"
            )
            for line in over:
                write(line, red=True)
            write(
                "make the test faster (share a fixture, shrink its sizes), or declare it in "
                "OVER_A_MINUTE with what it proves"
            )


def fixture_file(fixturedef) -> str:
    """Where a fixture is defined, relative to the repository (as node ids spell files)."""
    path = Path(fixturedef.func.__code__.co_filename)
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return path.name


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("hiertx timing")
    group.addoption(
        "--time-report",
        action="store_true",
        help="print every test's time and each test file's total at the end",
    )
    group.addoption(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail the run where a test outside tests/timing.py's OVER_A_MINUTE takes longer",
    )
