"""dvc.yaml and the stage scripts agree: each stage declares exactly the params it reads.

Every ``stages/<name>.py`` exposes ``select_params(params, item)`` returning the only slice of
``params.yaml`` the stage passes on. Running it on a recording proxy yields the dotted keys it
reads; they must equal the stage's ``params:`` list (no undeclared reads, nothing stale),
except ``stages.RECORDING_PARAMS`` (``tracking``): where results are recorded, read by the
stages that log to MLflow but never a dependency, so changing it re-runs nothing.
The ``check`` stage depends on all of ``params.yaml`` as a file instead.

The slow tests run ``dvc`` in a copy of the project at the tiny profile: bad params stop
``dvc repro`` at ``check`` before any other stage, a valid change re-runs nothing but
``check``, and writing into a checked-out output leaves DVC's cache intact.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from pipeline.config import load_params
from stages import RECORDING_PARAMS
from tests.test_pipeline import project_files

REPO = Path(__file__).resolve().parents[1]
WHOLE_FILE = "params.yaml"


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
    recording = {p for p in log if any(covers(r, p) for r in RECORDING_PARAMS)}
    assert not {d for d in declared if any(covers(r, d) for r in RECORDING_PARAMS)}
    read = leaves(log - recording) - probed
    if WHOLE_FILE in stage["deps"]:
        # a file dep on all of params.yaml covers every read; a params: list would be stale
        assert declared == set()
        return
    undeclared = {p for p in read if not any(covers(d, p) for d in declared)}
    stale = {d for d in declared if not any(covers(d, p) for p in read)}
    assert (undeclared, stale) == (set(), set())


def test_recording_params_are_read_but_never_declared() -> None:
    """``tracking`` reaches every stage that logs to MLflow, and no stage depends on it:
    changing ``tracking.log_model`` must not re-run a training."""
    readers = set()
    for name, item, stage in stage_instances():
        log: set[str] = set()
        module = importlib.import_module(stage_module(name))
        module.select_params(Recorder(load_params(REPO / "params.yaml"), "", log, set()), item)
        if any(covers(r, p) for r in RECORDING_PARAMS for p in log):
            readers.add(name)
        assert not any(covers("tracking", p) for p in stage.get("params", [])), name
    assert {"tune", "train", "train_tuned", "evaluate", "evaluate_tuned", "report"} <= readers


@pytest.mark.parametrize(("name", "item", "stage"), INSTANCES)
def test_stage_depends_on_its_script(name: str, item: str | None, stage: dict[str, Any]) -> None:
    module = stage_module(name)
    assert f"{module.replace('.', '/')}.py" in stage["deps"]
    assert stage["cmd"].startswith(f"python -m {module}")


def test_no_stage_silences_its_progress() -> None:
    """Under ``dvc repro`` long stages show progress: a bar on a terminal, lines in a log
    (``pipeline.progress``); ``--no-progress`` is for scripts that want silence."""
    assert [name for name, _, stage in stage_instances() if "--no-progress" in stage["cmd"]] == []


# --------------------------------------------------------------------------- the check stage


def test_check_stage_comes_first_and_gates_every_download() -> None:
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    # `dvc repro` runs stages with no order between them in dvc.yaml's order: a run whose
    # corpus no stage produces has no path to `check`, so `check` must be listed first
    assert next(iter(spec)) == "check"
    check = spec["check"]
    assert WHOLE_FILE in check["deps"] and "params" not in check
    (out,) = check["outs"]
    assert out in spec["download"]["do"]["deps"]
    assert [name for name, stage in spec.items() if WHOLE_FILE in stage.get("deps", [])] == [
        "check"
    ]  # any other stage with the file dep would re-run on every params change


def _tiny_copy(root: Path) -> dict[str, str]:
    """A git-committed copy of the project at ``root`` with the tiny profile as its
    params.yaml and no dvc.lock; returns the environment to run dvc in."""
    for name in project_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    shutil.copy2(REPO / "profiles" / "tiny.yaml", root / "params.yaml")
    (root / "dvc.lock").unlink(missing_ok=True)
    git = ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.com"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "fresh clone"], cwd=root, check=True)
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "DVC_NO_ANALYTICS": "1",
        "OMP_NUM_THREADS": "1",
    }


def _dvc(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    dvc = str(Path(sys.executable).with_name("dvc"))
    return subprocess.run(
        [dvc, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )


def _ran(result: subprocess.CompletedProcess) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", result.stdout + result.stderr)


def _edit_params(root: Path, dotted: str, value: Any) -> None:
    raw = yaml.safe_load((root / "params.yaml").read_text())
    node = raw
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


BAD_PARAMS = [
    ("train.models.hierr", {"clip_norm": 0.5}, "train.models.hierr: no model named 'hierr'"),
    (
        "train.runs.transfomer-chitchat",
        {"model": "transfomer", "corpus": "chitchat"},
        "train.runs.transfomer-chitchat.model: no model named 'transfomer'",
    ),
    (
        "train.runs.transformer-ptb",
        {"model": "transformer", "corpus": "ptb"},
        "train.runs.transformer-ptb.corpus: 'ptb' is not in corpora",
    ),
    ("trainn", {"runs": {}}, "trainn: unknown key; did you mean 'train'?"),
]


@pytest.mark.slow
def test_bad_params_stop_dvc_repro_at_the_check_stage(tmp_path: Path) -> None:
    root = tmp_path / "hiertx"
    env = _tiny_copy(root)
    tiny = (root / "params.yaml").read_text()
    for key, value, message in BAD_PARAMS:
        (root / "params.yaml").write_text(tiny)
        _edit_params(root, key, value)
        result = _dvc(root, env, "repro")
        output = result.stdout + result.stderr
        assert result.returncode != 0, output
        assert _ran(result) == ["check"], output
        assert message in output and "failed to reproduce 'check'" in output
        assert not (root / "data" / "raw").exists()


@pytest.mark.slow
def test_valid_change_reruns_only_check_and_outputs_never_share_the_cache(
    tmp_path: Path,
) -> None:
    root = tmp_path / "hiertx"
    env = _tiny_copy(root)
    first = _dvc(root, env, "repro", "download@chitchat")
    assert first.returncode == 0, first.stdout + first.stderr
    assert _ran(first) == ["check", "download@chitchat"]

    # a valid change: check re-runs, its output stays the same, download is up to date
    _edit_params(root, "evaluate.n_samples", 3)
    second = _dvc(root, env, "repro", "download@chitchat")
    assert second.returncode == 0 and _ran(second) == ["check"], second.stdout

    # a checked-out output is a copy: writing into it (as a stage that rewrote a file in
    # place would; root ignores the read-only bit of DVC's hardlinks) leaves the cache whole
    shutil.rmtree(root / "data" / "raw" / "chitchat")
    assert _dvc(root, env, "checkout", "download@chitchat").returncode == 0
    for path in (root / "data" / "raw" / "chitchat").iterdir():
        os.chmod(path, 0o644)
        with path.open("r+b") as f:
            f.write(b"overwritten")
    objects = [p for p in (root / ".dvc" / "cache" / "files" / "md5").rglob("*") if p.is_file()]
    assert len(objects) >= 3  # data/params.checked, the raw files, their .dir listing
    for obj in objects:
        name = obj.parent.name + obj.name.removesuffix(".dir")
        assert hashlib.md5(obj.read_bytes()).hexdigest() == name, obj


def _imported_modules(path: Path) -> set[Path]:
    """The ``pipeline`` modules a file imports (at the top or inside functions)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.split(".")[0] != "pipeline":
                continue
            base = REPO / Path(*name.split("."))
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    found.add(candidate)
    return found


def _runs(script: Path) -> set[Path]:
    seen: set[Path] = set()
    todo = [script]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += _imported_modules(path)
    return seen


@pytest.mark.parametrize(("name", "item", "stage"), INSTANCES)
def test_a_stage_using_the_stage_contract_depends_on_it(name, item, stage) -> None:
    """A stage that reads or writes a record of ``pipeline/artifacts.py`` re-runs when the
    record's format changes (its outputs, or how it reads its inputs, change with it)."""
    script = REPO / f"{stage_module(name).replace('.', '/')}.py"
    if REPO / "pipeline" / "artifacts.py" in _runs(script):
        assert "pipeline/artifacts.py" in stage["deps"], name
