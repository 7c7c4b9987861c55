"""The registry: the public names, their task kinds, config errors naming the field, and
the modules the registry loads (``registry._MODULES``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline.artifacts import DataSizes
from pipeline.errors import ConfigError
from pipeline.models import registry
from pipeline.models.base import LanguageModel, SelectModel, Seq2SeqModel
from pipeline.names import Task

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "pipeline" / "models"
NAMES = registry.names()


def test_every_name_has_one_task_and_the_papers_models_are_there() -> None:
    by_task = {task: registry.names(task) for task in Task}
    assert sorted(n for names in by_task.values() for n in names) == NAMES
    assert registry.names("select") == by_task[Task.SELECT]  # a task by its value
    for task, names in by_task.items():
        assert all(registry.spec(n).task == task for n in names)
    assert {"transformer", "unet", "hier", "hier_pp", "s2sa", "vhcr"} <= set(by_task[Task.GENERATE])
    assert {"hrt_last", "hrt_all", "ensemble", "with_none"} <= set(by_task[Task.SELECT])
    assert {"gpt", "congruent_gpt", "hgpt", "congruent_hgpt"} <= set(by_task[Task.LM])


@pytest.mark.parametrize("name", NAMES)
def test_model_class_matches_task(name: str) -> None:
    base = {
        Task.GENERATE: Seq2SeqModel,
        Task.SELECT: SelectModel,
        Task.LM: LanguageModel,
    }
    spec = registry.spec(name)
    sizes = DataSizes(vocab_size=64, n_acts=5)
    model = registry.build_from_config(name, registry.make_config(name, sizes))
    assert isinstance(model, base[spec.task])
    assert model.config.vocab_size == 64


def _registers_models(path: Path) -> bool:
    """Whether a module of ``pipeline/models`` calls ``register`` (as a decorator or not)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register":
            return True
    return False


def test_every_module_that_registers_a_model_is_loaded_by_the_registry() -> None:
    """``registry._MODULES`` (what ``names()`` imports) is exactly the modules that call
    ``register``: a model module left out would be no model at all, silently. The import
    contract lists the same modules (``tests/models/test_modules.py``)."""
    registering = sorted(p.stem for p in MODELS.glob("*.py") if _registers_models(p))
    assert {"hier", "unet", "rankers"} <= set(registering) and "registry" not in registering
    assert sorted(registry._MODULES) == registering, (
        "list each module that registers a model in _MODULES of pipeline/models/registry.py"
    )


def test_unknown_model_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError, match="choose one of") as err:
        registry.spec("unet3")
    assert err.value.key == "model"


def test_unknown_and_out_of_range_fields_are_named() -> None:
    with pytest.raises(ConfigError) as err:
        registry.make_config("transformer", 100, n_hedas=4)
    assert err.value.key == "transformer.n_hedas"
    with pytest.raises(ConfigError) as err:
        registry.make_config("gpt", 100, n_heads=7)
    assert err.value.key == "gpt.n_heads"
    assert "divide" in err.value.reason


def test_presets_cannot_be_overridden() -> None:
    with pytest.raises(ConfigError, match="fixed"):
        registry.make_config("congruent_gpt", 100, congruent=False)
