"""The packages the check cannot start without, checked with the standard library alone
before anything else is imported, so that a machine that lacks one is told in one line
(its name, and what to do) instead of a traceback from deep in an import."""

from __future__ import annotations

import importlib.util

# import name -> the distribution pip installs (the bare GPU machine of issue 32 has all
# but pydantic; transformers is optional: the HF peer rows are skipped without it).
REQUIRED = {
    "torch": "torch",
    "numpy": "numpy",
    "pyarrow": "pyarrow",
    "pydantic": "pydantic",
    "yaml": "PyYAML",
}
HOW = (
    "pip install {names}; a machine without internet: the GPU kit's run.sh installs the "
    'wheels it carries (README, "On a GPU, one command")'
)


def missing_packages() -> list[str]:
    """The distributions of ``REQUIRED`` whose module cannot be found here."""
    return [dist for module, dist in REQUIRED.items() if importlib.util.find_spec(module) is None]


def missing_line(names: list[str], needed_by: str = "") -> str:
    """The one line the check stops with when ``names`` are not installed."""
    by = f" (imported by {needed_by})" if needed_by else ""
    return f"python -m bench.gpu_check: {', '.join(names)} not installed{by}; " + HOW.format(
        names=" ".join(names)
    )
