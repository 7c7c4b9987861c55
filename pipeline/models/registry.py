"""Models by name: ``names()`` lists them, ``build(name, vocab_size, **overrides)`` makes one.

Each model module registers its names with ``@register``; adding a model is one decorator
in its module plus its module in ``_MODULES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from torch import nn

from pipeline.errors import ConfigError
from pipeline.models.base import ModelConfig, TaskKind

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
    task: TaskKind
    config_cls: type[ModelConfig]
    builder: Callable[[Any], nn.Module]
    preset: tuple[tuple[str, Any], ...] = ()


_REGISTRY: dict[str, ModelSpec] = {}
_loaded = False


def register(
    name: str, task: TaskKind, config_cls: type[ModelConfig], **preset: Any
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


def names(task: TaskKind | str | None = None) -> list[str]:
    """Every registered model name (of one task kind if given), sorted."""
    _load()
    return sorted(n for n, s in _REGISTRY.items() if task is None or s.task == TaskKind(task))


def spec(name: str) -> ModelSpec:
    """The registration of ``name``; a ``ConfigError`` lists the valid names otherwise."""
    _load()
    if name not in _REGISTRY:
        raise ConfigError("model", f"unknown model {name!r}; choose one of {names()}")
    return _REGISTRY[name]


def make_config(name: str, vocab_size: int, **overrides: Any) -> ModelConfig:
    """The validated config of ``name`` with its paper defaults, preset and ``overrides``."""
    s = spec(name)
    fixed = dict(s.preset)
    clash = sorted(set(fixed) & set(overrides))
    if clash:
        raise ConfigError(f"{name}.{clash[0]}", f"is fixed to {fixed[clash[0]]!r} for {name}")
    try:
        return s.config_cls(vocab_size=vocab_size, **fixed, **overrides)
    except ValidationError as err:
        first = err.errors()[0]
        key, reason = ".".join(str(p) for p in first["loc"]), first["msg"]
        if not key:
            # cross-field validators raise ValueError("field: reason")
            reason = reason.removeprefix("Value error, ")
            field, sep, rest = reason.partition(": ")
            key, reason = (field, rest) if sep and field.isidentifier() else ("config", reason)
        raise ConfigError(f"{name}.{key}", reason) from None


def build(name: str, vocab_size: int, **overrides: Any) -> nn.Module:
    """Build model ``name`` at its paper's sizes, with ``overrides`` applied."""
    config = make_config(name, vocab_size, **overrides)
    return build_from_config(name, config)


def build_from_config(name: str, config: ModelConfig) -> nn.Module:
    """Build ``name`` from an already validated config (e.g. read from a checkpoint)."""
    model = spec(name).builder(config)
    model.config = config
    return model
