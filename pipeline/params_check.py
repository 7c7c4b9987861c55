"""What ``params.yaml`` refers to, checked against what exists, before any stage computes.

``pipeline.config`` checks each section's own keys and values; this module checks the names
and cross-references between sections, which need the model registry:

- model names used as keys or values (``train.models.<m>``, ``tune.spaces.<m>``,
  ``evaluate.models.<m>``, the ``model`` of every run) are registered models;
- a run's corpus is in ``corpora:`` (so ``dvc repro`` tokenizes it) and has a
  ``tokenize.corpora`` entry; the model's task is one of the corpus's ``tasks``;
- model config overrides (``train.defaults.model``, ``train.models.<m>.model``,
  ``train.runs.<r>.overrides.model``) validate with the model's config class;
- ``select_by: multiwoz_score`` only for generate models on a task-oriented corpus;
- ``tune.spaces.<m>.model`` searches fields of that config; a tuned run has no
  ``overrides`` (which only train runs read: they would be silently ignored).
- ``word_vectors`` (``train.defaults``, ``train.models.<m>``, run overrides) names a file.

Every error is a ``ConfigError`` naming the dotted key and what to do. ``parse_params``
calls :func:`check_params`, so every stage script and the ``check`` stage (the first stage
of ``dvc repro``) fail on the same mistakes before any work.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from pipeline.config import Params, RunTarget, Section, Selection, run_key
from pipeline.errors import ConfigError
from pipeline.models.base import DataSizes

# Stand in for the data's sizes before the data exists (a model not run on any corpus, or
# a corpus not tokenized yet): no config validator reads them, they only have to be valid.
_ANY_VOCAB = 1000
_ANY_ACTS = 40
_EXTRA = "Extra inputs are not permitted"


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"did you mean 'hier'? "`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def unknown_key_reason(loc: tuple[Any, ...]) -> str | None:
    """The reason for an unknown key at ``loc`` (a pydantic error location under
    ``Params``): the closest allowed key and the allowed ones; None if ``loc`` does not
    lead to a params section."""
    section = _section_at(Params, loc[:-1])
    if section is None:
        return None
    allowed = list(section.model_fields)
    hint = did_you_mean(str(loc[-1]), allowed)
    return f"unknown key; {hint}allowed here: {', '.join(allowed)}"


def _section_at(cls: type[BaseModel], path: tuple[Any, ...]) -> type[BaseModel] | None:
    """The params section class reached from ``cls`` along ``path`` (field names, mapping
    keys, tuple indices), or None."""
    annotation: Any = cls
    for part in path:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return None
            annotation = field.annotation
            continue
        annotation = _strip_optional(annotation)
        args = typing.get_args(annotation)
        origin = typing.get_origin(annotation)
        if origin is dict and len(args) == 2:
            annotation = args[1]
        elif origin is tuple and args:
            annotation = args[0]
        else:
            return None
        annotation = _strip_optional(annotation)
    annotation = _strip_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    return None


def _strip_optional(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


# --------------------------------------------------------------------------- the checks


def check_params(params: Params) -> None:
    """Check every name and cross-reference of ``params`` (module docstring); raises a
    ``ConfigError`` naming the first bad dotted key."""
    from pipeline.models import registry  # imports torch: only when params are checked

    known = registry.names()
    for section, names in (
        ("train.models", params.train.models),
        ("tune.spaces", params.tune.spaces),
        ("evaluate.models", params.evaluate.models),
    ):
        for name in names:
            _registered(f"{section}.{name}", name, known)
    for where, runs in (("train.runs", params.train.runs), ("tune.runs", params.tune.runs)):
        for key, target in runs.items():
            _check_run(params, f"{where}.{key}", target, known)
    for key, target in params.tune.runs.items():
        if "overrides" in target.model_fields_set:
            raise ConfigError(
                f"tune.runs.{key}.overrides",
                "a tuned run takes its knobs from train.defaults, "
                f"train.models.{target.model} and its search: move these keys to "
                f"train.models.{target.model}",
            )
    for name in params.evaluate.models:
        task = registry.spec(name).task.value
        if task != "generate":
            raise ConfigError(
                f"evaluate.models.{name}",
                f"{name} is a {task} model; decodings apply to generate models only: "
                "remove this entry",
            )
    _check_model_overrides(params)
    _check_spaces(params)
    _check_download_skip(params)
    _check_word_vectors(params)


def _check_word_vectors(params: Params) -> None:
    """Every ``word_vectors`` given (``train.defaults``, ``train.models.<m>``,
    ``train.runs.<r>.overrides``) names an existing file; a relative path is from the
    working folder, the project root where stages run."""
    from pathlib import Path

    train = params.train
    places = [
        ("train.defaults", train.defaults),
        *((f"train.models.{m}", run) for m, run in train.models.items()),
        *((f"train.runs.{r}.overrides", t.overrides) for r, t in train.runs.items()),
    ]
    for where, run in places:
        path = run.word_vectors if "word_vectors" in run.model_fields_set else None
        if path is not None and not Path(path).is_file():
            origin = "" if Path(path).is_absolute() else f" (relative to {Path.cwd()})"
            raise ConfigError(
                f"{where}.word_vectors",
                f"no such file {path!r}{origin}: point it at a FastText/word2vec .vec or "
                ".vec.gz file, or remove the key to start from random embeddings",
            )


def _check_download_skip(params: Params) -> None:
    """``download.skip.<c>`` names splits corpus ``c`` has files for; skipping the
    training file needs ``train_on: valid`` (else tokenize would find no training data)."""
    from pipeline.data.corpora import corpus_spec

    for corpus, splits in params.download.skip.items():
        where = f"download.skip.{corpus}"
        has = sorted({f.split for f in corpus_spec(corpus).files if f.split is not None})
        for split in splits:
            if split not in has:
                files = f"only {', '.join(has)}" if has else "no per-split files"
                raise ConfigError(where, f"{corpus} has {files}: remove {split!r}")
        configured = params.tokenize.corpora.get(corpus)
        if "train" in splits and (configured is None or configured.train_on != "valid"):
            raise ConfigError(
                where,
                f"without its training file, {corpus} can only train on its validation "
                f"dialogues: set tokenize.corpora.{corpus}.train_on: valid, or stop skipping train",
            )


def _registered(key: str, name: str, known: list[str]) -> None:
    if name not in known:
        raise ConfigError(
            key,
            f"no model named {name!r}; {did_you_mean(name, known)}registered: {', '.join(known)}",
        )


def _check_run(params: Params, where: str, target: RunTarget, known: list[str]) -> None:
    from pipeline.models import registry

    _registered(f"{where}.model", target.model, known)
    corpus = target.corpus.value
    listed = [c.value for c in params.corpora]
    if target.corpus not in params.corpora:
        raise ConfigError(
            f"{where}.corpus",
            f"{corpus!r} is not in corpora: {listed}, so no stage downloads or tokenizes "
            f"it: add it to corpora (with a tokenize.corpora.{corpus} entry) or remove "
            "this run",
        )  # (Params already requires a tokenize.corpora entry for each of corpora)
    task = registry.spec(target.model).task.value
    tasks = [t.value for t in params.corpus(corpus).tasks]
    if task not in tasks:
        raise ConfigError(
            where,
            f"{target.model} is a {task} model but {corpus} only yields {tasks}: add "
            f"{task} to tokenize.corpora.{corpus}.tasks or pick a model of those tasks",
        )
    _check_selection(params, where, target, task)


def _check_selection(params: Params, where: str, target: RunTarget, task: str) -> None:
    """``select_by: multiwoz_score`` decodes responses and scores them against MultiWOZ's
    goals: a generate model on a task-oriented corpus only."""
    from pipeline.data.corpora import corpus_spec

    train, model, corpus = params.train, target.model, target.corpus.value
    select = train.run(model, corpus, target.variant).select_by
    if select != Selection.MULTIWOZ_SCORE:
        return
    if task == "generate" and corpus_spec(corpus).task_oriented:
        return
    key = run_key(model, corpus, target.variant)
    run = train.runs.get(key)
    if run is not None and "select_by" in run.overrides.model_fields_set:
        source = f"{where}.overrides.select_by"
    elif model in train.models and "select_by" in train.models[model].model_fields_set:
        source = f"train.models.{model}.select_by"
    else:
        source = "train.defaults.select_by"
    raise ConfigError(
        source,
        f"multiwoz_score scores MultiWOZ responses, but run {key} is a "
        f"{task} model on {corpus}: select it by valid_loss (set it per run under "
        "train.runs.<run>.overrides)",
    )


def _check_model_overrides(params: Params) -> None:
    """Every model's merged config overrides validate with its config class, for each
    run (at the run's corpus' sizes) and for each ``train.models`` entry."""
    from pipeline.models import registry

    train = params.train
    for key, target in [*train.runs.items(), *params.tune.runs.items()]:
        own = train.runs[key].overrides.model if key in train.runs else {}
        sources = [
            (f"train.runs.{key}.overrides.model", own),
            (f"train.models.{target.model}.model", _model_overrides(params, target.model)),
            ("train.defaults.model", train.defaults.model),
        ]
        sizes = _planned_sizes(params, target.corpus)
        try:
            registry.data_values(target.model, sizes)
        except ConfigError as err:
            runs = "train.runs" if key in train.runs else "tune.runs"
            raise ConfigError(f"{runs}.{key}.corpus", err.reason) from None
        merged = train.run(target.model, target.corpus, target.variant).model
        _validate_config(target.model, sizes, merged, sources)
    for name in train.models:
        merged = {**train.defaults.model, **train.models[name].model}
        sources = [
            (f"train.models.{name}.model", train.models[name].model),
            ("train.defaults.model", train.defaults.model),
        ]
        _validate_config(name, DataSizes(_ANY_VOCAB, _ANY_ACTS), merged, sources)


def _planned_sizes(params: Params, corpus: str) -> DataSizes:
    """The data sizes a corpus will have, as far as params and its spec tell before it is
    tokenized: the configured vocabulary, and acts if the corpus has them (an act model
    on a corpus without acts fails here, before any download)."""
    from pipeline.data.corpora import corpus_spec

    acts = _ANY_ACTS if corpus_spec(str(corpus)).task_oriented else None
    return DataSizes(params.corpus(corpus).vocab.size or _ANY_VOCAB, acts)


def _model_overrides(params: Params, model: str) -> dict[str, Any]:
    entry = params.train.models.get(model)
    return entry.model if entry is not None else {}


def _validate_config(
    model: str, sizes: DataSizes, overrides: dict[str, Any], sources: list[tuple[str, dict]]
) -> None:
    """``registry.make_config`` of ``overrides``; a failure names the most specific of
    ``sources`` (``(dotted key, overrides set there)``, most specific first) that sets the
    offending field (the first source when none does: a cross-field rule)."""
    from pipeline.models import registry

    try:
        registry.make_config(model, sizes, **overrides)
    except ConfigError as err:
        field = err.key.removeprefix(f"{model}.")
        where = next((key for key, values in sources if field in values), sources[0][0])
        reason = err.reason
        if reason == _EXTRA:
            fields = _config_fields(model)
            reason = (
                f"{model}'s config has no field {field!r}; {did_you_mean(field, fields)}"
                f"fields: {', '.join(fields)}"
            )
        raise ConfigError(f"{where}.{field}", reason) from None


def _config_fields(model: str) -> list[str]:
    """The config fields of ``model`` that params may set (not derived, not preset)."""
    from pipeline.models import registry

    spec = registry.spec(model)
    fixed = {name for name, _ in spec.preset} | set(spec.config_cls.DATA_FIELDS)
    return [f for f in spec.config_cls.model_fields if f not in fixed]


def _check_spaces(params: Params) -> None:
    for model, space in params.tune.spaces.items():
        fields = _config_fields(model)
        for section, name in [("model", n) for n in space.model] + [
            ("per_head", n) for n in space.per_head
        ]:
            if name not in fields:
                raise ConfigError(
                    f"tune.spaces.{model}.{section}.{name}",
                    f"not a field of {model}'s config; {did_you_mean(name, fields)}"
                    f"choose among: {', '.join(fields)}",
                )
