"""dvc.yaml and the stage scripts agree: each stage declares exactly the params it reads.

Every ``stages/<name>.py`` exposes ``select_params(params, item)`` returning the only slice of
``params.yaml`` the stage passes on (the train and tune stages: a ``RunRequest``). Running it
on recording params yields the dotted keys it reads; they must equal the stage's ``params:``
list (no undeclared reads, nothing stale), except ``stages.UNDECLARED_PARAMS``
(``tracking``, ``train.placement``): where results are recorded and where runs are placed,
read by the stages but never a dependency, so changing them re-runs nothing.
The ``check`` stage depends on all of ``params.yaml`` as a file instead.

The slow tests run ``dvc`` in a copy of the project at the tiny profile: bad params stop
``dvc repro`` at ``check`` before any other stage, a valid change re-runs nothing but
``check``, and writing into a checked-out output leaves DVC's cache intact.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import itertools
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from pipeline.config import load_params
from stages import UNDECLARED_PARAMS
from tests.projects import (
    DVC,
    copy_tokenized,
    edit_params,
    fresh_copy,
    ran_in_order,
    venv_env,
)

REPO = Path(__file__).resolve().parents[1]
WHOLE_FILE = "params.yaml"


class Reads:
    """What a stage's ``select_params`` reads of params: the dotted path of every field or
    item it takes (``log``), of every section or mapping it uses whole (``whole``: passed
    on in what it returns, a method called on it, a dump, a copy, a merge, its keys
    listed), and of every mapping
    it only asks whether it holds a key (``probed``: asking where a run is listed selects
    the stage, dvc.yaml's foreach, and reads no value).

    :meth:`watch` gives the params as values of their own types (recording copies of
    sections, a recording ``dict`` for mappings), so a stage builds typed values from them
    (a ``RunRequest``, a ``TokenizeParams``) as it does from the real params.
    """

    def __init__(self) -> None:
        self.log: set[str] = set()
        self.whole: set[str] = set()
        self.probed: set[str] = set()
        self._paths: dict[int, tuple[Any, str]] = {}  # id -> (the copy, kept alive; path)

    def watch(self, value: Any, path: str = "") -> Any:
        if isinstance(value, BaseModel):
            copy = value.model_copy()
            object.__setattr__(copy, "__class__", _recording(type(value)))
        elif isinstance(value, dict):
            copy = _RecordingDict(value)
        else:
            return value
        self._paths[id(copy)] = (copy, path)
        _READS[id(copy)] = self
        return copy

    def child(self, parent: Any, key: str, value: Any) -> Any:
        path = self.path(parent)
        path = f"{path}.{key}" if path else key
        self.log.add(path)
        return self.watch(value, path)

    def path(self, watched: Any) -> str:
        return self._paths[id(watched)][1]

    def passed_on(self, value: Any) -> None:
        """Every watched section or mapping inside ``value`` (what ``select_params``
        returned) is used whole: the stage hands all of it on."""
        if id(value) in self._paths and self._paths[id(value)][0] is value:
            self.whole.add(self.path(value))
        if isinstance(value, BaseModel):
            inner = list(object.__getattribute__(value, "__dict__").values())
        elif isinstance(value, dict):
            inner = list(dict.values(value))
        elif isinstance(value, list | tuple):
            inner = list(value)
        else:
            return
        for item in inner:
            self.passed_on(item)

    def read(self) -> set[str]:
        """The params read: the leaves of ``log`` and what was used whole, less what was
        only probed."""
        return (leaves(self.log) | self.whole) - self.probed

    def forget(self) -> None:
        for key in self._paths:
            _READS.pop(key, None)
        self._paths.clear()


_READS: dict[int, Reads] = {}  # the watched copies still recording, by id


def _name(key: Any) -> str:
    return key.value if isinstance(key, enum.Enum) else str(key)


class _RecordingDict(dict):
    """A params mapping that records the items read (a copy: pydantic validates it, and
    ``{**d}`` unpacks it, like a dict)."""

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        reads = _READS.get(id(self))
        return value if reads is None else reads.child(self, _name(key), value)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if super().__contains__(key) else default

    def items(self) -> Any:
        return [(key, self[key]) for key in super().__iter__()]

    def values(self) -> Any:
        return [self[key] for key in super().__iter__()]

    def _whole(self) -> None:
        reads = _READS.get(id(self))
        if reads is not None:
            reads.whole.add(reads.path(self))

    def keys(self) -> Any:
        self._whole()
        return super().keys()

    def __iter__(self) -> Any:
        self._whole()
        return super().__iter__()

    def __len__(self) -> int:
        self._whole()
        return super().__len__()

    def __contains__(self, key: Any) -> bool:
        reads = _READS.get(id(self))
        if reads is not None:
            reads.probed.add(reads.path(self))
        return super().__contains__(key)


@cache
def _recording(cls: type[BaseModel]) -> type[BaseModel]:
    """``cls`` with reads recorded (for a copy :meth:`Reads.watch` made): a field's read
    returns the field watched; any other attribute but Python's own (a method, a
    property, ``model_dump``, ``model_fields_set``) uses the section whole."""

    def __getattribute__(self: BaseModel, name: str) -> Any:
        value = object.__getattribute__(self, name)
        reads = _READS.get(id(self))
        if reads is None or name.startswith("__"):
            return value
        if name in type(self).model_fields:
            return reads.child(self, name, value)
        reads.whole.add(reads.path(self))
        return value

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})


def select(name: str, item: str | None) -> Reads:
    """What the stage script of ``name`` reads of the shipped params.yaml for ``item``."""
    module = importlib.import_module(stage_module(name))
    reads = Reads()
    try:
        reads.passed_on(module.select_params(reads.watch(load_params(REPO / "params.yaml")), item))
    finally:
        reads.forget()
    return reads


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


def test_the_recording_params_see_reads_whole_uses_and_probes() -> None:
    """The recorder itself: a field read, a section passed on whole (validated into a
    model of the stage's), a section merged, a mapping only probed."""
    from pipeline.config import TokenizeParams, merge_params

    reads = Reads()
    params = reads.watch(load_params(REPO / "params.yaml"))
    assert "nowhere" not in params.train.runs
    batch = params.train.defaults.batch_size
    knobs = merge_params(params.train.defaults, params.train.models["hier"])
    out = TokenizeParams(corpora={"chitchat": params.tokenize.corpora["chitchat"]})
    reads.passed_on((out, knobs, batch))
    read = reads.read()
    reads.forget()
    assert isinstance(out.corpora["chitchat"], BaseModel) and knobs.batch_size == batch
    assert {"train.defaults", "train.models.hier", "tokenize.corpora.chitchat"} <= read
    assert "train.runs" not in read and "train.runs" in reads.probed
    assert not {p for p in read if p.startswith(("download", "evaluate", "tune", "tracking"))}
    assert not any(covers(p, "tokenize.corpora.ptb") for p in read)  # one corpus, not all


@pytest.mark.parametrize(("name", "item", "stage"), INSTANCES)
def test_stage_declares_exactly_the_params_it_reads(
    name: str, item: str | None, stage: dict[str, Any]
) -> None:
    reads = select(name, item)
    declared = set(stage.get("params", []))
    assert not {d for d in declared if any(covers(r, d) for r in UNDECLARED_PARAMS)}
    read = {p for p in reads.read() if not any(covers(r, p) for r in UNDECLARED_PARAMS)}
    if WHOLE_FILE in stage["deps"]:
        # a file dep on all of params.yaml covers every read; a params: list would be stale
        assert declared == set()
        return
    undeclared = {p for p in read if not any(covers(d, p) for d in declared)}
    stale = {d for d in declared if not any(covers(d, p) for p in read)}
    assert (undeclared, stale) == (set(), set())


def test_undeclared_params_are_read_but_never_declared() -> None:
    """``tracking`` reaches every stage that logs to MLflow and ``train.placement`` every
    stage that trains, and no stage depends on them: changing ``tracking.log_model`` or
    moving runs to GPUs must not re-run a training."""
    readers: dict[str, set[str]] = {r: set() for r in UNDECLARED_PARAMS}
    for name, item, stage in stage_instances():
        log = select(name, item).log
        for undeclared in UNDECLARED_PARAMS:
            if any(covers(undeclared, p) for p in log):
                readers[undeclared].add(name)
            assert not any(covers(undeclared, p) for p in stage.get("params", [])), name
    assert {"tune", "train", "train_tuned", "evaluate", "evaluate_tuned", "report"} <= readers[
        "tracking"
    ]
    assert {"tune", "train", "train_tuned"} <= readers["train.placement"]


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
    (out,) = check["outs"]  # the corpora's source declarations, one file per corpus
    (folder,) = out if isinstance(out, dict) else (out,)
    assert f"{folder}/${{item}}.json" in spec["download"]["do"]["deps"]
    assert [name for name, stage in spec.items() if WHOLE_FILE in stage.get("deps", [])] == [
        "check"
    ]  # any other stage with the file dep would re-run on every params change


# --------------------------------------------------------------------------- the README's DAG


def _reach(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The transitive closure of ``edges``: every (a, b) with a path from a to b."""
    closure = set(edges)
    while more := {(a, d) for a, b in closure for c, d in closure if b == c} - closure:
        closure |= more
    return closure


def test_the_readme_diagram_is_the_stage_graph_of_dvc_yaml() -> None:
    """The README's ``mermaid`` flowchart has a node per stage kind (``train@run`` ->
    ``train``); what depends on what in it is what ``dvc dag`` says of the default params,
    up to edges implied by others (``download -> evaluate`` by ``download -> tokenize ->
    train -> evaluate``)."""
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        graph = repo.index.graph  # edges from a stage to the stages it depends on
        real = {(d.addressing.split("@")[0], s.addressing.split("@")[0]) for s, d in graph.edges}
    (block,) = re.findall(r"```mermaid\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    drawn = set()
    for line in block.splitlines()[1:]:
        nodes = [re.sub(r"\[.*\]", "", part).strip() for part in line.split("-->")]
        drawn |= set(itertools.pairwise(nodes))
    assert {n for e in drawn for n in e} == {n for e in real for n in e}
    assert _reach(drawn) == _reach(real)


def _dvc(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DVC, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )


def _ran(result: subprocess.CompletedProcess) -> list[str]:
    return ran_in_order(result.stdout + result.stderr)


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
    fresh_copy(root)  # nothing downloaded yet: none may be after a refused check
    env = venv_env(tmp_path / "mlflow.db")
    tiny = (root / "params.yaml").read_text()
    for key, value, message in BAD_PARAMS:
        (root / "params.yaml").write_text(tiny)
        edit_params(root, key, value)
        result = _dvc(root, env, "repro")
        output = result.stdout + result.stderr
        assert result.returncode != 0, output
        assert _ran(result) == ["check"], output
        assert message in output and "failed to reproduce 'check'" in output
        assert not (root / "data" / "raw").exists()


@pytest.mark.slow
def test_valid_change_reruns_only_check_and_outputs_never_share_the_cache(
    tokenized_tiny: Path, tmp_path: Path
) -> None:
    """In a copy where ``dvc repro tokenize@chitchat`` ran exactly check, download and
    tokenize (``tests.projects.tokenized_tiny`` asserts that of its fresh copy)."""
    root = tmp_path / "hiertx"
    copy_tokenized(tokenized_tiny, root)
    env = venv_env(tmp_path / "mlflow.db")
    first = _dvc(root, env, "repro", "tokenize@chitchat")
    assert first.returncode == 0 and _ran(first) == [], first.stdout + first.stderr

    # a valid change: check re-runs, its declarations stay the same, nothing else re-runs
    edit_params(root, "evaluate.n_samples", 3)
    second = _dvc(root, env, "repro", "tokenize@chitchat")
    assert second.returncode == 0 and _ran(second) == ["check"], second.stdout

    # a checked-out output is a copy: writing into it (as a stage that rewrote a file in
    # place would; root ignores the read-only bit of DVC's hardlinks) leaves the cache whole
    shards = root / "data" / "shards" / "chitchat"
    shutil.rmtree(shards)
    assert _dvc(root, env, "checkout", "tokenize@chitchat").returncode == 0
    written = [path for path in shards.rglob("*") if path.is_file()]
    assert written
    for path in written:
        os.chmod(path, 0o644)
        with path.open("r+b") as f:
            f.write(b"overwritten")
    objects = [p for p in (root / ".dvc" / "cache" / "files" / "md5").rglob("*") if p.is_file()]
    assert len(objects) > len(written)  # the shards, vocabulary, manifest and .dir listing
    for obj in objects:
        name = obj.parent.name + obj.name.removesuffix(".dir")
        assert hashlib.md5(obj.read_bytes()).hexdigest() == name, obj


def _imported_modules(path: Path) -> set[Path]:
    """The ``pipeline`` modules a file imports (at the top or inside functions; a package
    by its ``__init__.py``)."""
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


ARTIFACTS = REPO / "pipeline" / "artifacts"


def _uses_the_stage_contract(script: Path) -> bool:
    return any(path.is_relative_to(ARTIFACTS) for path in _runs(script))


def test_the_stage_contract_is_found_in_what_a_stage_imports() -> None:
    assert _uses_the_stage_contract(REPO / "stages" / "train.py")
    assert not _uses_the_stage_contract(REPO / "stages" / "__init__.py")


@pytest.mark.parametrize(("name", "item", "stage"), INSTANCES)
def test_a_stage_using_the_stage_contract_depends_on_it(name, item, stage) -> None:
    """A stage that reads or writes a record of ``pipeline/artifacts/`` re-runs when the
    record's format changes (its outputs, or how it reads its inputs, change with it)."""
    script = REPO / f"{stage_module(name).replace('.', '/')}.py"
    if _uses_the_stage_contract(script):
        assert any(covers(dep, "pipeline/artifacts") for dep in stage["deps"]), name
