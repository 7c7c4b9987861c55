"""Shared fixtures. Keep this minimal: each fixture here is used across test packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import projects
from tests.batches import shared_data_dir

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real corpora mirror (``tests.batches.shared_data_dir``).

    Skips the test where it is missing, except on CI (``$CI`` set), where that is a failure.
    """
    path = shared_data_dir()
    if not (path / "MANIFEST.tsv").is_file():
        message = f"real corpora not found at {path}; set HIERTX_TEST_DATA to the mirror folder"
        if os.environ.get("CI"):
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


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process with pytest's verdict, skipping the interpreter's teardown.

    Everything pytest reports is written by now. What is left is CPython finalising C
    extensions whose threads outlive the tests (Ray's gRPC, torch's thread pools, Arrow's
    memory maps): that teardown once crashed with SIGSEGV after a fully green run (CI of
    stop 17: "761 passed", then "Segmentation fault", exit 139), failing CI on no test.
    """
    import sys

    if _EXIT_STATUS and os.environ.get("HIERTX_TEST_TEARDOWN") != "full":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
