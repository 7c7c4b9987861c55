"""Shared fixtures. Keep this minimal: each fixture here is used across test packages."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

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
def ray_head() -> Iterator[dict[str, str]]:
    """The session's Ray instance (``tests.ray_head``): the environment that joins it."""
    from tests.ray_head import ray_head as started

    with started() as join:
        yield join


@pytest.fixture
def on_ray_head(ray_head: dict[str, str]) -> Iterator[None]:
    """``$RAY_ADDRESS`` and its token name the session's Ray instance for the test: what it
    runs on Ray (``pipeline.cluster.ray_cluster``) joins that instead of starting its own.
    Mark such tests ``xdist_group("cluster")``: one pytest-xdist worker runs them all."""
    from tests.ray_head import joining

    with joining(ray_head):
        yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` on pytest >= 9.2: pytest-xdist (3.8) groups an item by appending
    ``@<group>`` to ``item._nodeid``, which pytest 9.2 no longer reads (its node ids are
    structured: ``item._id``), so each ``xdist_group`` was silently spread over all workers.
    Where xdist's suffix did not take, it is set here, as xdist sets it."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers only
        return
    from _pytest.nodeid import NodeId

    for item in items:
        marks = item.iter_markers("xdist_group")
        groups = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        )
        suffix = f"@{'_'.join(groups)}"
        if groups and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)  # type: ignore[attr-defined]


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
