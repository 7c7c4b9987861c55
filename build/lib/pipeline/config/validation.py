"""Pydantic's validation errors as the one error users see: a ``ConfigError`` naming the
dotted key and what to do. Every place that validates params or a model config turns its
``ValidationError`` into a ``ConfigError`` here, and nowhere else."""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from pipeline.errors import ConfigError

# Pydantic's wording for an unknown key, which ``config_error`` replaces with the allowed ones.
EXTRA_KEY = "extra_forbidden"
# Cross-field validators raise ``ValueError("field: reason")``: the field joins the key.
_FIELD_REASON = re.compile(r"([A-Za-z_][\w.-]*): (.*)", re.DOTALL)
# Pydantic's own reasons, reworded where ours say more.
_REASONS = {"finite_number": "must be a finite number"}


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"did you mean 'hier'? "`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def dotted(loc: Iterable[Any]) -> str:
    """A pydantic error location as a dotted key (validator frames left out)."""
    return ".".join(str(p) for p in loc if not str(p).startswith("function-"))


def config_error(
    err: ValidationError, prefix: str = "", root: type[BaseModel] | None = None
) -> ConfigError:
    """The first error of ``err`` as a ``ConfigError`` under ``prefix``. ``root`` is the
    model that was validated: an unknown key then lists the keys allowed where it stands."""
    first = err.errors()[0]
    key, reason = dotted(first["loc"]), first["msg"]
    if first["type"] in _REASONS:
        reason = _REASONS[first["type"]]
    if first["type"] == EXTRA_KEY and root is not None:
        reason = unknown_key_reason(root, first["loc"]) or reason
    match = _FIELD_REASON.fullmatch(reason.removeprefix("Value error, "))
    if match:
        key = f"{key}.{match[1]}" if key else match[1]
        reason = match[2]
    elif reason.startswith("Value error, "):
        reason = reason.removeprefix("Value error, ")
    key = ".".join(part for part in (prefix, key) if part)
    return ConfigError(key or prefix or "params", reason)


def unknown_key_reason(root: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """The reason for an unknown key at ``loc`` under ``root``: the closest allowed key and
    the allowed ones; None if ``loc`` does not lead to a model."""
    section = _model_at(root, loc[:-1])
    if section is None:
        return None
    allowed = list(section.model_fields)
    hint = did_you_mean(str(loc[-1]), allowed)
    return f"unknown key; {hint}allowed here: {', '.join(allowed)}"


def _model_at(cls: type[BaseModel], path: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class reached from ``cls`` along ``path`` (field names, mapping keys,
    tuple indices), or None."""
    annotation: Any = cls
    for part in path:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return None
            annotation = _strip_optional(field.annotation)
            continue
        args, origin = typing.get_args(annotation), typing.get_origin(annotation)
        if origin is dict and len(args) == 2:
            annotation = _strip_optional(args[1])
        elif origin is tuple and args:
            annotation = _strip_optional(args[0])
        else:
            return None
    annotation = _strip_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _strip_optional(annotation: Any) -> Any:
    """``X | None`` -> ``X``; ``Annotated[X, ...]`` -> ``X``."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
