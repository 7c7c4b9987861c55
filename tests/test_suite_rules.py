"""The rules ``make test`` runs the suite under (``tests/conftest.py``, ``tests/timing.py``),
checked on a small suite of their own run the way ``make test`` runs it (xdist, CI=true):
a skip on CI is a failure; a test over the time limit that ``OVER_A_MINUTE`` does not
declare fails the run, one it declares does not and starts first, the rest of its xdist
group right after it (``timing.keep_xdist_groups``: xdist 3.8 on pytest 9.2 would split
the group, pytest-dev/pytest-xdist#1386); a shared fixture over
the limit is named, not the test that set it up; every test's time and each file's total
are printed; only the process pytest was started in ends with ``os._exit``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests import conftest, timing

REPO = Path(__file__).resolve().parents[1]

SUITE = """
import time

import pytest

@pytest.fixture(scope="module")
def shared():
    time.sleep(1.1)

def test_quick(shared):
    pass

def test_skips():
    pytest.skip("no widget here")

@pytest.mark.skip_on_ci_allowed("CI has no widget license")
def test_skips_where_allowed():
    pytest.skip("no widget license")

def test_over_the_limit():
    time.sleep(1.1)

@pytest.mark.slow
@pytest.mark.xdist_group("heavy")
def test_declared():
    time.sleep(1.1)

@pytest.mark.xdist_group("heavy")
def test_grouped_with_it():
    pass
"""
# The project's hooks, as tests/conftest.py defines them, and one declared test.
CONFTEST = """
from tests import timing
from tests.conftest import (
    pytest_addoption, pytest_configure, pytest_runtest_makereport, pytest_sessionfinish,
    pytest_unconfigure,
)

timing.OVER_A_MINUTE["test_rules.py::test_declared"] = "a test of the rules"
"""


@pytest.fixture
def rules(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.RunResult:
    """The small suite under ``make test``'s options, on CI, in a pytest of its own."""
    pytester.makepyfile(test_rules=SUITE)
    pytester.makeconftest(CONFTEST)
    markers = "\n    slow: as the project's\n    skip_on_ci_allowed: as the project's\n"
    pytester.makeini(f"[pytest]\nmarkers ={markers}")
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", pythonpath)
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("HIERTX_TEST_TEARDOWN", raising=False)
    options = ["-n", "1", "--dist", "loadgroup", "--no-loadscope-reorder", "-v"]
    return pytester.runpytest_subprocess(
        *options,
        "-p",
        "no:cacheprovider",
        "--time-report",
        "--time-limit",
        "1",
        "--time-scale",
        "1",
    )


@pytest.mark.slow  # a pytest of its own with an xdist worker: a few seconds
def test_make_tests_rules_hold_on_a_small_suite(rules: pytest.RunResult) -> None:
    out = rules.stdout.str()
    assert rules.ret == pytest.ExitCode.TESTS_FAILED, out
    # the skip: failed, its reason given
    assert "skipped, which CI (CI=true) does not allow: Skipped: no widget here" in out
    rules.assert_outcomes(passed=4, failed=1, skipped=1)  # the declared skip stays a skip
    # the time limit: the undeclared slow test named with its phases, the declared one not
    over = out.split("not in tests/timing.py's OVER_A_MINUTE", 1)[1]
    assert re.search(r"test_rules.py::test_over_the_limit: 1\.\d s \(setup", over), out
    assert re.search(r"test_rules.py::shared \(a shared fixture\): 1\.\d s to set up", over)
    assert "test_declared" not in over and "\ntest_rules.py::test_quick:" not in over
    # the declared test started first on the worker, its xdist group with it
    started = re.findall(r"\[gw0\] \[\s*\d+%\] \w+ (test_rules.py::\w+)", out)
    assert started[:2] == ["test_rules.py::test_declared", "test_rules.py::test_grouped_with_it"]
    # every test's time, each file's total
    times = out.split("every test's time", 1)[1]
    for name in ("test_quick", "test_skips", "test_over_the_limit", "test_declared"):
        name += "@heavy" if name == "test_declared" else ""
        assert re.search(rf"\d+\.\d\d s  test_rules.py::{name}\b", times), name
    assert re.search(r"\d+\.\d s +6 tests  test_rules.py\n", times), out
    # the worker ended through execnet, not os._exit: no crashed or replaced worker
    assert "crashed" not in out and "replacing" not in out


def test_the_limit_is_in_reference_seconds_scaled_to_this_machine(monkeypatch) -> None:
    """A machine that runs the calibration workload 1.5x slower than the reference allows
    each test 1.5x the limit; a faster one never less than the limit."""

    class Config:
        def __init__(self, **options: float | None) -> None:
            self.options = {"time_report": False, "time_scale": None} | options

        def getoption(self, name: str) -> float | None:
            return self.options[name]

    timed = {"t/slow.py::test_80s": {"setup": 0.0, "call": 80.0, "teardown": 0.0}}
    reference = timing.REFERENCE_CALIBRATION_S
    for calibrated, over in [(reference * 1.5, []), (reference * 1.2, ["test_80s"])]:
        monkeypatch.setattr(timing, "calibrate", lambda calibrated=calibrated: calibrated)
        timed_here = timing.Timing(Config(time_limit=60.0))
        timed_here.phases.update(timed)
        assert [line.split("::")[1].split(":")[0] for line in timed_here.over_the_limit()] == over
    monkeypatch.setattr(timing, "calibrate", lambda: reference / 3)
    assert timing.Timing(Config(time_limit=60.0)).limit_here == 60.0
    fixed = timing.Timing(Config(time_limit=60.0, time_scale=2.0))
    assert fixed.limit_here == 120.0 and fixed.calibrated is None
    monkeypatch.setattr(timing, "calibrate", lambda: reference * 1.5)
    said = timing.Timing(Config(time_limit=60.0)).describe_limit()
    assert said.startswith("time limit: 60 s of the reference machine, 90 s here"), said


def test_a_declared_test_must_be_marked_slow(pytester: pytest.Pytester, monkeypatch) -> None:
    """``OVER_A_MINUTE`` lists what ``make test-fast`` (``-m "not slow"``) leaves out."""
    monkeypatch.setitem(timing.OVER_A_MINUTE, "test_unmarked.py::test_long", "unmarked")
    monkeypatch.setenv("HIERTX_TEST_TEARDOWN", "full")  # an in-process pytest: no os._exit
    pytester.makepyfile(test_unmarked="def test_long():\n    pass\n")
    pytester.makeconftest(CONFTEST.split("\ntiming.OVER_A_MINUTE")[0])
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "not marked slow" in result.stderr.str() + result.stdout.str()


def test_declared_covers_a_test_its_parameters_and_a_file() -> None:
    entries = {"t/a.py::test_x": "", "t/b.py": ""}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(timing, "OVER_A_MINUTE", entries)
        assert timing.declared("t/a.py::test_x") == "t/a.py::test_x"
        assert timing.declared("t/a.py::test_x[gpt]") == "t/a.py::test_x"
        assert timing.declared("t/b.py::test_y") == "t/b.py"
        assert timing.declared("t/a.py::test_xy") is None
        assert timing.declared("t/bc.py::test_y") is None


def test_only_the_process_pytest_started_in_ends_with_os_exit(monkeypatch) -> None:
    """An xdist worker (a config with ``workerinput``) returns from ``pytest_unconfigure``
    and ends through execnet; the controller ends with the session's verdict."""

    class Exited(Exception):
        pass

    def exit_(status: int) -> None:
        raise Exited(status)

    class Session:
        exitstatus = 3

    class Config:
        pass

    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.delenv("HIERTX_TEST_TEARDOWN", raising=False)
    monkeypatch.setattr(conftest, "_SESSION", [Session()])
    worker = Config()
    worker.workerinput = {"workerid": "gw0"}
    conftest.pytest_unconfigure(worker)  # returns
    with pytest.raises(Exited) as exited:
        conftest.pytest_unconfigure(Config())
    assert exited.value.args == (3,)


def test_every_declared_slow_test_exists() -> None:
    """A renamed or deleted test leaves no entry behind in ``OVER_A_MINUTE``."""
    stale = []
    for key in timing.OVER_A_MINUTE:
        path, _, name = key.partition("::")
        source = REPO / path
        function = f"def {name.split('[')[0]}("
        if not source.is_file() or (name and function not in source.read_text()):
            stale.append(key)
    assert not stale


def test_the_order_plugins_act_only_when_asked(pytester: pytest.Pytester) -> None:
    """``make test-order``'s plugins (``tests/order.py``): pytest-reverse and
    pytest-random-order leave the order of ``make test`` and ``make test-fast`` alone; asked,
    they reverse it, or shuffle it the same way for the same seed."""
    names = [f"test_{i}" for i in range(8)]
    pytester.makepyfile(test_few="".join(f"def {name}():\n    pass\n" for name in names))

    def order(*options: str) -> list[str]:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--co", "-q", *options)
        return [line.split("::")[1] for line in result.outlines if "::" in line]

    assert order() == names
    assert order("--reverse") == names[::-1]
    seeded = ("--random-order-bucket=module", "--random-order-seed=1")
    shuffled = order(*seeded)
    assert sorted(shuffled) == names and shuffled != names and order(*seeded) == shuffled


# A test that reads MLflow's settings, and one that starts a tracker (which sets them).
ENV_SUITE = """
import os

from pipeline.tracking import store

def test_reads_the_settings():
    assert {name: os.environ.get(name) for name in store.ENV_DEFAULTS} == store.ENV_DEFAULTS

def test_starts_a_tracker():
    store.configure_env()  # as Tracker.start does
"""


def test_mlflow_settings_are_the_same_before_and_after_a_tracker_starts(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``store.configure_env`` sets MLflow's settings process-wide: the project's
    ``pytest_configure`` sets them first, so a test sees them whether or not a test before
    it started a tracker (in pytest's order and reversed)."""
    from pipeline.tracking import store

    pytester.makepyfile(test_env=ENV_SUITE)
    pytester.makeconftest("from tests.conftest import pytest_addoption, pytest_configure\n")
    for order in ([], ["--reverse"]):
        for name in store.ENV_DEFAULTS:  # a process no tracker has started in
            monkeypatch.delenv(name, raising=False)
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *order)
        result.assert_outcomes(passed=2)


def test_the_killed_node_test_runs_after_its_modules_other_tests() -> None:
    """The multi-node module's tests share one cluster, and the killed-node test costs it a
    node: xdist runs a group's tests in the order ``OVER_A_MINUTE`` sorts them (a test it
    does not list after those it does), so that test must rank after every other."""
    path = "tests/infra/test_cluster_repro.py"
    tests = re.findall(r"^def (test_\w+)\(", (REPO / path).read_text(), re.MULTILINE)
    listed = [key.partition("::")[2] for key in timing.OVER_A_MINUTE if key.startswith(path)]
    in_order = [name for name in listed if name in tests]
    assert sorted(in_order) == sorted(tests)  # every one listed: none sorts after them
    assert in_order[-1] == "test_a_killed_worker_node_resumes_to_the_serial_weights"
