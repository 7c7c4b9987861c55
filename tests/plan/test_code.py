"""The training code's list (``pipeline.plan.code``) is what the train and tune stages import
and what ``dvc.yaml`` declares as their code: a module missing from it would change results
without changing a run's identity (an edit resumed with the older code's checkpoint), and a
dvc.yaml that lists other code re-runs a stage the identity says is unchanged, or not."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest
import yaml

from pipeline.plan.code import stage_code

REPO = Path(__file__).resolve().parents[2]
# Imported by the stages but computing nothing a run keeps: the --help text, the check
# that the stage runs in the project's interpreter, which GPU of the machine a run takes
# (placement, like train.placement, is not part of a run's identity) and when a process
# stops on a signal (a stopped run resumes to the weights it would have had:
# tests/train/test_loop.py).
NOT_TRAINING = {
    "pipeline/helpformat.py",
    "pipeline/gpu_share.py",
    "pipeline/signals.py",
    "stages/__init__.py",
}
# dvc.yaml's stages that train, and the stage script each runs.
TRAINING_STAGES = {"tune": "tune", "train": "train", "train_tuned": "train"}


def _file(module: str) -> str:
    """``pipeline.plan.code`` -> ``pipeline/plan/code.py`` (a package: its ``__init__.py``)."""
    path = Path(*module.split("."))
    return str(path / "__init__.py") if (REPO / path).is_dir() else f"{path}.py"


def _covered(file: str, paths: tuple[str, ...]) -> bool:
    return any(file == p or file.startswith(p + "/") for p in paths)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """The import graph ``lint-imports`` checks, imports inside functions included."""
    return grimp.build_graph("pipeline", "stages")


@pytest.mark.parametrize("stage", sorted(TRAINING_STAGES))
def test_dvc_yaml_declares_the_training_code_as_the_stages_code(stage: str) -> None:
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]["do"]
    code = [dep for dep in spec["deps"] if not dep.startswith("data/")]
    assert code == list(stage_code(TRAINING_STAGES[stage])), (
        f"dvc.yaml's {stage} deps and pipeline/plan/code.py's TRAINING_CODE differ"
    )


@pytest.mark.parametrize("script", ["train", "tune"])
def test_the_training_code_is_what_the_stage_imports(script: str, graph) -> None:
    module = f"stages.{script}"
    imported = {_file(m) for m in graph.find_upstream_modules(module) | {module}}
    paths = stage_code(script)
    assert sorted(f for f in imported - NOT_TRAINING if not _covered(f, paths)) == []
    assert [p for p in paths if not any(_covered(f, (p,)) for f in imported)] == []  # stale
    assert not any(_covered(f, paths) for f in NOT_TRAINING)
