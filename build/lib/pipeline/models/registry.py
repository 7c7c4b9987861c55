"""Models by name: ``names()`` lists them, ``build(name, sizes, **overrides)`` makes one.

Each model module registers its names with :func:`register` (on its builder, as a decorator
or called) and is listed in ``_MODULES``; docs/DESIGN.md, "How to add a model", lists every
edit. ``sizes`` are the data's (:class:`~pipeline.artifacts.DataSizes`, from the tokenize
record): a config's ``DATA_FIELDS`` come from them and nowhere else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from torch import nn

from pipeline.artifacts import DataSizes
from pipeline.config.validation import config_error
from pipeline.errors import ConfigError
from pipeline.models.base import ModelConfig
from pipeline.names import Task

_MODULES = (
    "transformer",
    "unet",
    "hier",
    "rnn",
    "highway",
    "rankers",
    "gpt",
    "hgpt",
)


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: its task, its config class (with paper defaults), its builder,
    and fixed config values that distinguish it from siblings sharing a class."""

    name: str
    task: Task
    config_cls: type[ModelConfig]
    builder: Callable[[Any], nn.Module]
    preset: tuple[tuple[str, Any], ...] = ()


_REGISTRY: dict[str, ModelSpec] = {}
_loaded = False


def register(
    name: str, task: Task, config_cls: type[ModelConfig], **preset: Any
) -> Callable[[Callable[[Any], nn.Module]], Callable[[Any], nn.Module]]:
    """Register ``builder(config) -> nn.Module`` under ``name``; ``preset`` fixes config
    fields for this name (``register("unet_linear", ..., UNetConfig, linear_skip=True)``)."""

    def wrap(builder: Callable[[Any], nn.Module]) -> Callable[[Any], nn.Module]:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} registered twice")
        _REGISTRY[name] = ModelSpec(name, task, config_cls, builder, tuple(preset.items()))
        return builder

    return wrap


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in _MODULES:
            importlib.import_module(f"pipeline.models.{module}")
        _loaded = True


def names(task: Task | str | None = None) -> list[str]:
    """Every registered model name (of one task kind if given), sorted."""
    _load()
    return sorted(n for n, s in _REGISTRY.items() if task is None or s.task == Task(task))


def spec(name: str) -> ModelSpec:
    """The registration of ``name``; a ``ConfigError`` lists the valid names otherwise."""
    _load()
    if name not in _REGISTRY:
        raise ConfigError("model", f"unknown model {name!r}; choose one of {names()}")
    return _REGISTRY[name]


def data_values(name: str, sizes: DataSizes | int) -> dict[str, Any]:
    """The config values ``name`` takes from the data (``ModelConfig.DATA_FIELDS``); an int
    is a vocabulary size alone. A size the model needs and the data lacks (acts on a
    corpus without them) is a ``ConfigError``."""
    if isinstance(sizes, int):
        sizes = DataSizes(vocab_size=sizes)
    values = {field: getattr(sizes, field) for field in spec(name).config_cls.DATA_FIELDS}
    if values.get("n_acts", 0) is None:
        raise ConfigError(
            f"{name}.n_acts",
            f"{name} reads the dialogue acts of its corpus, and this corpus has none: "
            "train it on a corpus with acts (multiwoz, multiwoz21)",
        )
    return values


def make_config(name: str, sizes: DataSizes | int, **overrides: Any) -> ModelConfig:
    """The validated config of ``name`` with its paper defaults, preset, the data's sizes
    (``sizes``: a :class:`DataSizes`, or a vocabulary size alone) and ``overrides``."""
    s = spec(name)
    fixed = dict(s.preset)
    clash = sorted(set(fixed) & set(overrides))
    if clash:
        raise ConfigError(f"{name}.{clash[0]}", f"is fixed to {fixed[clash[0]]!r} for {name}")
    data = data_values(name, sizes)
    taken = sorted(set(data) & set(overrides))
    if taken:
        raise ConfigError(
            f"{name}.{taken[0]}", "comes from the data (the tokenize record): remove it"
        )
    try:
        return s.config_cls(**data, **fixed, **overrides)
    except ValidationError as err:
        raise config_error(err, name, s.config_cls) from None


def build(name: str, sizes: DataSizes | int, **overrides: Any) -> nn.Module:
    """Build model ``name`` at its paper's sizes for data of ``sizes``, with ``overrides``."""
    config = make_config(name, sizes, **overrides)
    return build_from_config(name, config)


def build_from_config(name: str, config: ModelConfig) -> nn.Module:
    """Build ``name`` from an already validated config (e.g. read from a checkpoint)."""
    model = spec(name).builder(config)
    model.config = config
    return model
