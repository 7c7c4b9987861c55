"""Model files stay independent: a model file imports shared blocks, never another model."""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.models import registry

MODELS = Path(registry.__file__).parent


def model_modules() -> set[str]:
    """The modules that register a model (``registry._MODULES``)."""
    return set(registry._MODULES)


def test_no_model_file_imports_another_model_file():
    models = model_modules()
    offenders = []
    for name in sorted(models):
        tree = ast.parse((MODELS / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported = node.module.removeprefix("pipeline.models.")
                if imported in models - {name}:
                    offenders.append(f"{name}.py imports {node.module}")
    assert not offenders, offenders
