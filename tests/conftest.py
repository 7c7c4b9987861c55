"""Shared fixtures. Keep this minimal: each fixture here is used across test packages."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import projects, timing
from tests.batches import shared_data_dir

if TYPE_CHECKING:
    from tests.ray_head import SharedHead
    from tests.s3_server import S3Server

# pytester: tests/test_suite_rules.py runs these hooks on a small suite of its own
pytest_plugins = ("pytester",)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def on_ci() -> bool:
    """``$CI`` set (CI services set ``CI=true``), where a missing requirement fails."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real corpora mirror (``tests.batches.shared_data_dir``).

    Skips the test where it is missing, except on CI (``$CI`` set), where that is a failure.
    """
    path = shared_data_dir()
    if not (path / "MANIFEST.tsv").is_file():
        message = f"real corpora not found at {path}; set HIERTX_TEST_DATA to the mirror folder"
        if on_ci():
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def tokenized_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh copy at ``profiles/tiny.yaml`` in which ``dvc repro`` ran check, download
    and tokenize (``tests.projects.tokenized_tiny``): built once per test run, the xdist
    workers sharing it. Take a ``tests.projects.copy_tokenized`` of it; never write into it.
    """
    base = tmp_path_factory.getbasetemp()
    # a worker's basetemp is <the run's basetemp>/popen-gw<N>: the run's is shared by all
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return projects.tokenized_tiny(shared)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 API on 127.0.0.1 (moto in server mode, ``tests.s3_server``), one per
    process, for the tests of storage URIs; take ``s3`` in a test."""
    from tests.s3_server import running

    yield from running()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The session's S3 server, which pyarrow (and so Ray and the pipeline) reaches as S3
    during the test: ``AWS_ENDPOINT_URL`` and dummy credentials set in the environment."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


SHARED_HEAD = pytest.StashKey["SharedHead"]()


@pytest.fixture(scope="session")
def ray_head(request: pytest.FixtureRequest) -> Iterator[SharedHead]:
    """The session's Ray instance (``tests.ray_head``), started here; stopped after the last
    of the consecutive tests that use it (``pytest_runtest_teardown``), started again by
    ``on_ray_head`` for a later one."""
    from tests.ray_head import SharedHead

    head = request.config.stash[SHARED_HEAD] = SharedHead()
    head.join()
    try:
        yield head
    finally:
        head.stop()


@pytest.fixture
def on_ray_head(ray_head: SharedHead) -> Iterator[None]:
    """``$RAY_ADDRESS`` and its token name the session's Ray instance for the test: what it
    runs on Ray (``pipeline.cluster.ray_cluster``) joins that instead of starting its own.
    Mark such tests ``xdist_group("ray")``: one pytest-xdist worker runs them all, one after
    another, on one instance (the multi-node cluster tests are ``xdist_group("cluster")``,
    on another)."""
    from tests.ray_head import joining

    with joining(ray_head.join()):
        yield


def seed_random_state() -> None:
    """Python's, NumPy's and torch's global generators to one fixed seed."""
    import random

    import numpy
    import torch

    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every test's fixtures, then its body (:func:`pytest_runtest_call`), start from the
    same random state. The global generators are shared by every test in a process: a draw
    in one test shifts what every later test draws, so a test whose check holds only for
    some draws would pass or fail by its place in the queue. Reseeding at the call as well
    keeps the body's draws the same whether a module fixture was set up for it or reused."""
    seed_random_state()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """The test's body starts from the fixed seed too (:func:`pytest_runtest_setup`)."""
    seed_random_state()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the test's own teardown: the session's Ray head stops unless the next test
    uses it too."""
    result = yield
    head = item.config.stash.get(SHARED_HEAD, None)
    if head is not None and (nextitem is None or "ray_head" not in nextitem.fixturenames):
        head.stop()
    return result


def pytest_addoption(parser: pytest.Parser) -> None:
    timing.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """One torch/OpenMP thread per process unless ``$OMP_NUM_THREADS`` says otherwise:
    ``make test`` runs a worker per core and one more, and the subprocesses tests start
    inherit it.

    MLflow's settings (``store.configure_env``) from the start: every ``Tracker.start``
    sets them process-wide, as a stage's process wants, so without them here a test would
    run with or without them depending on whether a test before it started a tracker."""
    import torch

    from pipeline.tracking import store

    store.configure_env()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    config.pluginmanager.register(timing.Timing(config), "hiertx-timing")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """On CI a skip is a failure: a requirement missing there (a browser, PostgreSQL, the
    data mirror, the venv) would otherwise pass unnoticed, its guarantee unchecked. A test
    marked ``skip_on_ci_allowed(reason)`` may skip there: a requirement CI cannot have,
    stated where the test is and printed with its skip (``-rs``)."""
    report = yield
    allowed = item.get_closest_marker("skip_on_ci_allowed") is not None
    if report.skipped and on_ci() and not allowed and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, which CI (CI={os.environ['CI']}) does not allow: {reason}"
    return report


_SESSION: list[pytest.Session] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    _SESSION.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process with pytest's verdict, skipping the interpreter's teardown.

    Everything pytest reports is written by now. What is left is CPython finalising C
    extensions whose threads outlive the tests (Ray's gRPC, torch's thread pools, Arrow's
    memory maps): that teardown once crashed with SIGSEGV after a fully green run (CI of
    stop 17: "761 passed", then "Segmentation fault", exit 139), failing CI on no test.
    Only in the process pytest was started in: an xdist worker (``workerinput``) still
    answers its controller after this hook, and ends through execnet.
    """
    import sys

    if hasattr(config, "workerinput") or not _SESSION:
        return
    if os.environ.get("HIERTX_TEST_TEARDOWN") != "full":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(_SESSION[-1].exitstatus))
