"""Import rules: the import-linter contracts hold (layers, model files independent of each
other, no cycles between sibling packages), they cover every model file, and no module
of ``pipeline`` is part of an import cycle (imports inside functions count)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

from pipeline.models import registry

REPO = Path(__file__).resolve().parents[2]
INDEPENDENCE = "no model file imports another model file"


def lint_imports() -> str:
    """The ``lint-imports`` of this venv (beside its Python), else the one on ``PATH``."""
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.is_file() else shutil.which("lint-imports")
    assert found, "lint-imports is not installed (pip install import-linter)"
    return found


def test_the_import_contracts_hold():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [lint_imports(), "--no-cache"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def test_the_independence_contract_names_every_model_file():
    """The contract lists its modules by hand; a newly registered model file must join it."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts = {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}
    assert contracts[INDEPENDENCE]["type"] == "independence"
    listed = set(contracts[INDEPENDENCE]["modules"])
    assert listed == {f"pipeline.models.{name}" for name in registry._MODULES}


def strongly_connected(graph: grimp.ImportGraph) -> list[set[str]]:
    """The strongly connected components (Tarjan, iterative) of ``graph``'s modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    imported = sorted(graph.find_modules_directly_imported_by(child))
                    work.append((child, iter(imported)))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def a_cycle(graph: grimp.ImportGraph, component: set[str]) -> list[str]:
    """One cycle through the first module of a strongly connected ``component``."""
    start = min(component)
    for imported in sorted(graph.find_modules_directly_imported_by(start) & component):
        back = graph.find_shortest_chain(importer=imported, imported=start)
        if back is not None:
            return [start, *back]
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def cycles_of(graph: grimp.ImportGraph) -> list[str]:
    """Each import cycle of ``graph`` (one per strongly connected component), as text."""
    return [
        " -> ".join(a_cycle(graph, component))
        for component in strongly_connected(graph)
        if len(component) > 1
    ]


def test_the_pipeline_import_graph_has_no_cycle():
    graph = grimp.build_graph("pipeline", cache_dir=None)
    assert len(graph.modules) > 50  # the whole package was read
    cycles = cycles_of(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_an_import_inside_a_function_counts(tmp_path, monkeypatch):
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic import b\n")
    (package / "b.py").write_text("def late():\n    from cyclic import a\n    return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclic", cache_dir=None)
    assert cycles_of(graph) == ["cyclic.a -> cyclic.b -> cyclic.a"]


def test_a_cycle_is_found_and_named():
    graph = grimp.ImportGraph()
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=importer, imported=imported)
    assert cycles_of(graph) == ["p.a -> p.b -> p.c -> p.a"]
    graph.remove_import(importer="p.c", imported="p.a")
    assert cycles_of(graph) == []
