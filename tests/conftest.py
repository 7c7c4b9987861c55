"""Shared fixtures. Keep this minimal: each fixture here is used across test packages."""

from __future__ import annotations

import os
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
