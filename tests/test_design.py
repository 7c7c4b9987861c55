"""What the documentation cites exists: every repository path (``pipeline/...``,
``tests/...``, ``bench/...``, ``docs/...``, ``stages/...``, ``profiles/...``) written in a
tracked Python, Markdown, YAML or TOML file, and every module (or module attribute) named
in backticks (``pipeline.plan.code``, ``registry.names`` aside: only dotted names that
start at a package of the project). A renamed or deleted file fails here until whatever
cites it says where it went. Placeholders (``data/train/<key>``, ``stages/<name>.py``,
``tests/**``) are not paths.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.projects import project_files

REPO = Path(__file__).resolve().parents[1]
TOP = ("pipeline", "tests", "bench", "docs", "stages", "profiles")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})/[\w./<>*{{}}$-]*[\w>*}}])")
BACKTICKED = re.compile(r"`+([^`\n]+)`+")
DOTTED = re.compile(r"(?<![\w.])((?:pipeline|stages|bench|tests)(?:\.\w+)+)")
PLACEHOLDER = re.compile(r"[<>*{}$]")
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml")


def _texts() -> list[tuple[str, str]]:
    return [(f, (REPO / f).read_text()) for f in project_files() if f.endswith(SUFFIXES)]


def cited_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of every repository path ``text`` cites, placeholders left out."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATH.finditer(line):
            path = match.group(1).rstrip(".")
            if not PLACEHOLDER.search(path):
                found.append((number, path))
    return found


def cited_modules(text: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every project module or attribute named in backticks."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for span in BACKTICKED.finditer(line):
            found += [(number, m.group(1)) for m in DOTTED.finditer(span.group(1))]
    return found


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    """What a module defines or imports at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def module_exists(dotted: str) -> bool:
    """``a.b.c``: a module ``a/b/c``, or a module ``a/b`` (a package's ``__init__``)
    defining ``c`` at its top level; attributes of that attribute are not checked."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = REPO / Path(*parts[:end])
        module = next(
            (p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None
        )
        if module is not None:
            return end == len(parts) or parts[end] in _top_level_names(module)
    return False


def test_the_scanners_find_paths_and_modules_and_skip_placeholders() -> None:
    text = (
        "see ``pipeline/plan/code.py``, `docs/DESIGN.md`: tests/plan/ and data/train/x\n"
        "not stages/<name>.py nor tests/**, and ``pipeline.models.registry.names()``, "
        "``python -m bench.bench_study``, pipeline.cli unquoted\n"
    )
    assert cited_paths(text) == [
        (1, "pipeline/plan/code.py"), (1, "docs/DESIGN.md"), (1, "tests/plan"),
    ]  # fmt: skip
    assert cited_modules(text) == [(2, "pipeline.models.registry.names"), (2, "bench.bench_study")]
    assert module_exists("pipeline.models.registry.names") and module_exists("pipeline.plan")
    assert module_exists("pipeline.artifacts.Layout")  # re-exported by the package
    assert not module_exists("pipeline.eval.evaluate")
    assert not module_exists("pipeline.models.registry.nmaes")


@pytest.mark.parametrize("cite", ["paths", "modules"])
def test_every_cited_path_and_module_exists(cite: str) -> None:
    scan, exists = {
        "paths": (cited_paths, lambda p: (REPO / p).exists()),
        "modules": (cited_modules, module_exists),
    }[cite]
    missing = [
        f"{file}:{line}: {name}"
        for file, text in _texts()
        for line, name in scan(text)
        if not exists(name)
    ]
    assert missing == []
