"""What ``params.yaml`` refers to, checked against what exists, before any stage computes:
the only checker of params beyond their own sections (``pipeline.config``), and the entry
point every stage calls (:func:`load_checked`). It needs the model registry and the
corpora, so it lives above them, and ``pipeline.config`` stays a leaf.

- model names used as keys or values (``train.models.<m>``, ``tune.spaces.<m>``,
  ``evaluate.models.<m>``, the ``model`` of every run) are registered models;
- a run's corpus is in ``corpora:`` (so ``dvc repro`` tokenizes it) and has a
  ``tokenize.corpora`` entry; the model's task is one of the corpus's ``tasks``;
- model config overrides (``train.defaults.model``, ``train.models.<m>.model``,
  ``train.runs.<r>.overrides.model``) validate with the model's config class;
- every run's global ``batch_size`` divides by ``train.scale.num_workers``;
- ``select_by: multiwoz_score`` only for generate models on a task-oriented corpus;
- ``tune.spaces.<m>.model`` searches fields of that config; a tuned run has no
  ``overrides`` (which only train runs read: they would be silently ignored).
- ``word_vectors`` (``train.defaults``, ``train.models.<m>``, run overrides) names a file.

Every error is a ``ConfigError`` naming the dotted key and what to do; the ``check`` stage
(the first of ``dvc repro``) and every stage script fail on the same mistakes before any
work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.artifacts import DataSizes
from pipeline.config import Params, RunTarget, Selection, load_params, parse_params, run_key
from pipeline.config.validation import did_you_mean
from pipeline.data.corpora import CorpusSpec, corpus_spec
from pipeline.errors import ConfigError
from pipeline.models import registry
from pipeline.names import Task

# Stand in for the data's sizes before the data exists (a model not run on any corpus, or
# a corpus not tokenized yet): no config validator reads them, they only have to be valid.
_ANY_VOCAB = 1000
_ANY_ACTS = 40


def load_checked(path: str | Path = "params.yaml") -> Params:
    """``params.yaml`` read, validated and checked whole: what every stage starts from."""
    params = load_params(path)
    check_params(params)
    return params


def checked(raw: dict[str, Any]) -> Params:
    """A params mapping validated and checked whole (``load_checked`` of a mapping)."""
    params = parse_params(raw)
    check_params(params)
    return params


# --------------------------------------------------------------------------- the checks


def check_params(params: Params) -> None:
    """Check every name and cross-reference of ``params`` (module docstring); raises a
    ``ConfigError`` naming the first bad dotted key."""
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
        task = registry.spec(name).task
        if task is not Task.GENERATE:
            raise ConfigError(
                f"evaluate.models.{name}",
                f"{name} is a {task} model; decodings apply to generate models only: "
                "remove this entry",
            )
    _check_model_overrides(params)
    _check_batches(params)
    _check_spaces(params)
    _check_download_skip(params)
    _check_word_vectors(params)
    _check_lm_validation(params)


def _check_lm_validation(params: Params) -> None:
    """A corpus's language models keep the weights of the validation scored as their test
    is: ``tokenize.corpora.<c>.lm.validation`` equals the corpus's ``evaluate`` LM protocol
    (selection and the reported number on one protocol; a YAML anchor keeps them one)."""
    for name, corpus in params.tokenize.corpora.items():
        if Task.LM not in corpus.tasks:
            continue
        test = params.evaluate.for_corpus(name).lm
        if corpus.lm.validation != test:
            raise ConfigError(
                f"tokenize.corpora.{name}.lm.validation",
                f"{corpus.lm.validation.model_dump(mode='json')} is not the protocol {name}'s "
                f"language models are tested with ({test.model_dump(mode='json')}, "
                f"evaluate.corpora.{name}.lm or evaluate.lm): their weights would be chosen "
                "on another protocol than the one reported; give both the same settings",
            )


def _check_word_vectors(params: Params) -> None:
    """Every ``word_vectors`` given (``train.defaults``, ``train.models.<m>``,
    ``train.runs.<r>.overrides``) names an existing file; a relative path is from the
    working folder, the project root where stages run."""
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
    for corpus, splits in params.download.skip.items():
        where = f"download.skip.{corpus}"
        try:
            spec = _spec(params, corpus)
        except ConfigError as err:
            raise ConfigError(where, err.reason) from None
        has = sorted({f.split for f in spec.files if f.split is not None})
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


def _spec(params: Params, corpus: str) -> CorpusSpec:
    """The spec of ``corpus``: built in, or declared in its tokenize settings."""
    entry = params.tokenize.corpora.get(corpus)
    return corpus_spec(corpus, entry.source if entry is not None else None)


def _registered(key: str, name: str, known: list[str]) -> None:
    if name not in known:
        raise ConfigError(
            key,
            f"no model named {name!r}; {did_you_mean(name, known)}registered: {', '.join(known)}",
        )


def _check_run(params: Params, where: str, target: RunTarget, known: list[str]) -> None:
    _registered(f"{where}.model", target.model, known)
    corpus = target.corpus
    listed = list(params.corpora)
    if target.corpus not in params.corpora:
        raise ConfigError(
            f"{where}.corpus",
            f"{corpus!r} is not in corpora: {listed}, so no stage downloads or tokenizes "
            f"it: add it to corpora (with a tokenize.corpora.{corpus} entry) or remove "
            "this run",
        )  # (Params already requires a tokenize.corpora entry for each of corpora)
    task = registry.spec(target.model).task
    tasks = [t.value for t in params.corpus(corpus).tasks]
    if task.value not in tasks:
        raise ConfigError(
            where,
            f"{target.model} is a {task} model but {corpus} only yields {tasks}: add "
            f"{task} to tokenize.corpora.{corpus}.tasks or pick a model of those tasks",
        )
    _check_selection(params, target, task)


def _check_selection(params: Params, target: RunTarget, task: Task) -> None:
    """``select_by: multiwoz_score`` decodes responses and scores them against MultiWOZ's
    goals: a generate model on a task-oriented corpus only."""
    train, model, corpus = params.train, target.model, target.corpus
    select = train.run(model, corpus, target.variant).select_by
    if select != Selection.MULTIWOZ_SCORE:
        return
    if task is Task.GENERATE and _spec(params, corpus).task_oriented:
        return
    key = run_key(model, corpus, target.variant)
    raise ConfigError(
        _source_of(params, key, target, "select_by"),
        f"multiwoz_score scores MultiWOZ responses, but run {key} is a "
        f"{task} model on {corpus}: select it by valid_loss (set it per run under "
        "train.runs.<run>.overrides)",
    )


def _check_model_overrides(params: Params) -> None:
    """Every model's merged config overrides validate with its config class, for each
    run (at the run's corpus' sizes) and for each ``train.models`` entry."""
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
    acts = _ANY_ACTS if _spec(params, corpus).acts else None
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
    try:
        registry.make_config(model, sizes, **overrides)
    except ConfigError as err:
        field = err.key.removeprefix(f"{model}.")
        where = next((key for key, values in sources if field in values), sources[0][0])
        reason = err.reason
        if reason.startswith("unknown key"):
            fields = _config_fields(model)
            reason = (
                f"{model}'s config has no field {field!r}; {did_you_mean(field, fields)}"
                f"fields: {', '.join(fields)}"
            )
        raise ConfigError(f"{where}.{field}", reason) from None


def _config_fields(model: str) -> list[str]:
    """The config fields of ``model`` that params may set (not derived, not preset)."""
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


def _check_batches(params: Params) -> None:
    """Every run's global ``batch_size`` splits evenly over the workers (each takes
    ``batch_size / num_workers`` examples a step): found here, not when a tune trial or
    a training starts."""
    workers = params.train.scale.num_workers
    if workers <= 1:
        return
    for key, target in [*params.train.runs.items(), *params.tune.runs.items()]:
        knobs = params.train.run(target.model, target.corpus, target.variant)
        if knobs.batch_size % workers:
            source = _source_of(params, key, target, "batch_size")
            raise ConfigError(
                source,
                f"{knobs.batch_size} is the global batch of run {key} (all workers "
                f"together) and must divide by train.scale.num_workers={workers}: make it "
                f"{(knobs.batch_size // workers + 1) * workers}, or change num_workers",
            )


def _source_of(params: Params, key: str, target: RunTarget, knob: str) -> str:
    """The most specific params key that sets ``knob`` for run ``key``."""
    run = params.train.runs.get(key)
    if run is not None and knob in run.overrides.model_fields_set:
        return f"train.runs.{key}.overrides.{knob}"
    models = params.train.models
    if target.model in models and knob in models[target.model].model_fields_set:
        return f"train.models.{target.model}.{knob}"
    return f"train.defaults.{knob}"
