"""Every module of the library, the stages and the benchmarks imports.

A name one branch renamed and another merged branch still imports (``gpu_share`` importing
``cluster._free_port`` after it became ``free_port``) breaks every stage that imports the
module, yet only the tests that happen to run such a stage notice, minutes later; this
catches it in seconds, naming the module."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def modules() -> list[str]:
    found = []
    for package in ("pipeline", "stages", "bench"):
        found.append(package)
        prefix = f"{package}."
        for info in pkgutil.walk_packages([str(REPO / package)], prefix):
            found.append(info.name)
    return sorted(found)


@pytest.mark.parametrize("name", modules())
def test_module_imports(name: str) -> None:
    importlib.import_module(name)
