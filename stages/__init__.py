"""Thin DVC stage entry points: ``python -m stages.<name>``, one per stage of ``dvc.yaml``.

Each ``stages/<name>.py`` exposes ``select_params(params, item)``, the only slice of
``params.yaml`` the stage passes on; it must equal the stage's ``params:`` list in dvc.yaml
(tests/test_dvc.py), except :data:`UNDECLARED_PARAMS`, which stages read but do not declare.

Importing this package does nothing but define names. A stage run as ``python -m
stages.<name>`` calls :func:`ensure_project_interpreter` first, before it imports the
project (``if __name__ == "__main__":`` above its other imports), because DVC runs a
stage's ``cmd`` through a shell with the user's PATH, so its ``python`` is whichever comes
first there: without an activated venv that is a system or pyenv Python without the
project's packages (``ModuleNotFoundError: No module named 'rich'``). Then the stage
re-executes itself with the project's ``.venv/bin/python`` (saying so on stderr) or,
without one, exits with what to do. This covers ``dvc repro``, ``dvc repro -s STAGE`` and
``dvc exp run`` typed in any shell, and experiments DVC runs in a temporary copy of the
project (``<project>/.dvc/tmp/exps/...``, which has no ``.venv`` of its own).

This module, and a stage script up to that call, run before the interpreter's version is
known to be supported: they keep to syntax and modules old Pythons have.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# Settings that change where results are recorded (MLflow) or computed (which CPUs and
# GPUs, where checkpoints go), not what they are: the stages read them but do not list them
# under ``params:`` in dvc.yaml, so changing ``tracking.log_model`` or moving runs to GPUs
# (``train.placement``) re-runs nothing. ``tokenize.chunk_dialogues`` is how many
# dialogues tokenize encodes at a time: the shards are the same bytes at any value.
UNDECLARED_PARAMS = ("tracking", "train.placement", "tokenize.chunk_dialogues")

DISTRIBUTION = "hiertx"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Set in the environment of a re-executed stage: never re-execute twice.
REEXEC_ENV = "HIERTX_STAGE_REEXEC_FROM"


def missing_requirements() -> list[str]:
    """The distributions a stage needs that this interpreter lacks: ``hiertx`` itself, or
    its runtime requirements (extras left out); empty if everything is installed."""
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        return [DISTRIBUTION]
    try:
        requires = metadata.distribution(DISTRIBUTION).requires or []
    except metadata.PackageNotFoundError:
        return [DISTRIBUTION]
    missing = []
    for requirement in requires:
        if "extra ==" in requirement:  # dev tools: not needed to run a stage
            continue
        name = re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0]
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def project_pythons(root: Path = PROJECT_ROOT) -> list[Path]:
    """The venv Pythons that can run this project's stages: ``<root>/.venv`` and, for an
    experiment DVC runs in a temporary copy inside a project's ``.dvc/tmp``, the
    ``.venv`` of that enclosing project."""
    scripts, exe = ("Scripts", "python.exe") if os.name == "nt" else ("bin", "python")
    roots = [root, *(p for p in root.parents if (p / ".dvc").is_dir())]
    return [r / ".venv" / scripts / exe for r in roots if (r / ".venv" / scripts / exe).is_file()]


def _is_current(python: Path) -> bool:
    """Whether ``python`` belongs to the venv this process already runs in."""
    try:
        return python.parent.parent.resolve() == Path(sys.prefix).resolve()
    except OSError:
        return False


def advice(module: str, missing: list[str], tried: list[Path]) -> str:
    """The message of a stage that cannot run here: which interpreter, what is missing,
    what to do."""
    here = f"{sys.executable} (Python {sys.version.split()[0]})"
    lacks = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
    lines = [
        f"{module}: the Python that ran this stage, {here}, lacks {lacks}.",
        "DVC runs each stage's `python` from your PATH, and this project's packages are "
        "installed in its .venv.",
    ]
    if tried:
        lines.append(f"{tried[0]} lacks them too: run `make setup` in {PROJECT_ROOT}.")
    lines.append(
        "Run the pipeline with `make repro`, or run `make setup` once and then "
        "`source .venv/bin/activate` before `dvc repro` / `dvc exp run`."
    )
    return "\n".join(lines)


def ensure_project_interpreter(module: str) -> None:
    """Make sure stage ``module`` (``"stages.train"``), run as ``python -m <module>``, runs
    in an interpreter with hiertx installed: if this one lacks it, re-execute the stage
    with the project's ``.venv`` Python, same arguments; exit with :func:`advice` if there
    is none, or if that one lacks it too."""
    missing = missing_requirements()
    if not missing:
        from pipeline.signals import print_stacks_on_request  # the project is installed

        print_stacks_on_request()  # `kill -USR2 <pid>`: a stage that seems stuck says where
        return
    tried = [Path(os.environ[REEXEC_ENV])] if os.environ.get(REEXEC_ENV) else []
    if not tried:
        for python in project_pythons():
            if _is_current(python):
                tried.append(python)
                continue
            print(
                f"{module}: {sys.executable} lacks {missing[0]}; re-running with {python} "
                "(activate the venv to skip this step)",
                file=sys.stderr,
                flush=True,
            )
            env = dict(os.environ)
            env[REEXEC_ENV] = str(python)
            os.execve(str(python), [str(python), "-m", module, *sys.argv[1:]], env)
    sys.exit(advice(module, missing, tried))
