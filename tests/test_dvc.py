"""dvc.yaml and the stage scripts agree: each stage declares exactly the params it reads.

Every ``stages/<name>.py`` exposes ``select_params(params, item)`` returning the only slice of
``params.yaml`` the stage passes on. Running it on a recording proxy yields the dotted keys it
reads; they must equal the stage's ``params:`` list (no undeclared reads, nothing stale).
"""

from __future__ import annotations

import enum
import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from pipeline.config import load_params

REPO = Path(__file__).resolve().parents[1]


class Recorder:
    """Wraps params; records the dotted path of every attribute or item read."""

    def __init__(self, value: Any, path: str, log: set[str], probed: set[str]) -> None:
        self._value, self._path, self._log, self._probed = value, path, log, probed

    def _child(self, value: Any, key: str) -> Any:
        path = f"{self._path}.{key}" if self._path else key
        self._log.add(path)
        if isinstance(value, BaseModel | dict):
            return Recorder(value, path, self._log, self._probed)
        return value

    def __getattr__(self, name: str) -> Any:
        return self._child(getattr(self._value, name), name)

    def __getitem__(self, key: Any) -> Any:
        name = key.value if isinstance(key, enum.Enum) else str(key)
        return self._child(self._value[key], name)

    def __contains__(self, key: Any) -> bool:
        # asking where a run is listed selects the stage (dvc.yaml's foreach), reads no value
        self._probed.add(self._path)
        return key in self._value


def covers(declared: str, path: str) -> bool:
    return path == declared or path.startswith(declared + ".")


def leaves(paths: set[str]) -> set[str]:
    return {p for p in paths if not any(q.startswith(p + ".") for q in paths)}


def _lookup(raw: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        raw = raw[part]
    return raw


def stage_instances() -> list[tuple[str, str | None, dict[str, Any]]]:
    """(stage name, foreach key or None, stage definition with ${...} substituted)."""
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    raw_params = yaml.safe_load((REPO / "params.yaml").read_text())
    out = []
    for name, stage in spec.items():
        if "foreach" not in stage:
            out.append((name, None, stage))
            continue
        items = stage["foreach"]
        if isinstance(items, str):  # ${dotted.key} of params.yaml
            items = _lookup(raw_params, items.strip("${}"))
        pairs = items.items() if isinstance(items, dict) else ((i, i) for i in items)
        for key, item in pairs:
            text = yaml.safe_dump(stage["do"]).replace("${key}", str(key))
            if isinstance(item, dict):
                for field, value in item.items():
                    text = text.replace(f"${{item.{field}}}", str(value))
            else:
                text = text.replace("${item}", str(item))
            out.append((name, str(key), yaml.safe_load(text)))
    return out


INSTANCES = [
    pytest.param(name, key, stage, id=f"{name}@{key}" if key else name)
    for name, key, stage in stage_instances()
]


def stage_module(name: str) -> str:
    """``train_tuned`` runs ``stages/train.py``, like ``train``."""
    return f"stages.{name.removesuffix('_tuned')}"


@pytest.mark.parametrize(("name", "item", "stage"), INSTANCES)
def test_stage_declares_exactly_the_params_it_reads(
    name: str, item: str | None, stage: dict[str, Any]
) -> None:
    module = importlib.import_module(stage_module(name))
    log: set[str] = set()
    probed: set[str] = set()
    module.select_params(Recorder(load_params(REPO / "params.yaml"), "", log, probed), item)
    declared = set(stage.get("params", []))
    read = leaves(log) - probed
    undeclared = {p for p in read if not any(covers(d, p) for d in declared)}
    stale = {d for d in declared if not any(covers(d, p) for p in read)}
    assert (undeclared, stale) == (set(), set())


@pytest.mark.parametrize(("name", "item", "stage"), INSTANCES)
def test_stage_depends_on_its_script(name: str, item: str | None, stage: dict[str, Any]) -> None:
    module = stage_module(name)
    assert f"{module.replace('.', '/')}.py" in stage["deps"]
    assert stage["cmd"].startswith(f"python -m {module}")
