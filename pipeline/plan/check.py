"""What ``params.yaml`` refers to, checked against what exists, before any stage computes:
the only checker of params beyond their own sections (``pipeline.config``), and the entry
point every stage calls (:func:`load_checked`). It needs the model registry and the
corpora, so it lives above them, and ``pipeline.config`` stays a leaf.

- model names used as keys or values (``train.models.<m>``, ``tune.spaces.<m>``,
  ``evaluate.models.<m>``, the ``model`` of every run) are registered models;
- a run's corpus is in ``corpora:`` (so ``dvc repro`` tokenizes it) and has a
  ``tokenize.corpora`` entry; the model's task is one of the corpus's ``tasks``;
- every run is checked as it will train, ``train.runs`` and ``tune.runs`` alike: its
  merged knobs (``train.defaults`` < ``train.models.<m>`` < its overrides) and model
  config, and for a tuned run its trials and its training from the best trial, at every
  extreme of its search space (``SearchSpace.corners``). The model config validates with
  the model's config class (a ``train.models.<m>`` entry alone only when no run merges
  it); the knobs keep the rules between them (``config.run_rules``: averaging against
  epochs, warm-up and max_steps; the schedule's keys against its kind; ``min_lr`` against
  ``lr``); ``compile: on`` names a model that can compile, and
  ``optimizer.embedding_lr_multiplier`` one with a token embedding;
- every run's global ``batch_size`` divides by ``train.scale.num_workers``, and its
  ``batch_tokens`` gives each worker at least a token;
- ``select_by: multiwoz_score`` only for generate models on a task-oriented corpus,
  ``select_by: mrr`` only for select models;
- ``tune.spaces.<m>.model`` searches fields of that config; a tuned run has no
  ``overrides`` (which only train runs read: they would be silently ignored).
- ``word_vectors`` (``train.defaults``, ``train.models.<m>``, run overrides) names a file.
- the storage of runs and checkpoints (``train.placement.storage_path``, else
  ``$HIERTX_STORAGE_PATH``) is a path or a URI of a scheme pyarrow opens, with a bucket
  (``cluster.check_storage``; the ``check`` stage also opens it: ``cluster.open_storage``).

Every error is a ``ConfigError`` naming the dotted key and what to do (a run's merged knob:
the run, and each level that contributed); the ``check`` stage
(the first of ``dvc repro``) and every stage script fail on the same mistakes before any
work.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import DataSizes
from pipeline.cluster import check_storage, storage_path
from pipeline.config import (
    CompileMode,
    Params,
    RunTarget,
    Selection,
    load_params,
    parse_params,
    run_key,
    sampled_model,
)
from pipeline.config.validation import did_you_mean
from pipeline.data.corpora import CorpusSpec, corpus_spec
from pipeline.errors import ConfigError
from pipeline.models import registry
from pipeline.models.base import TaskModel
from pipeline.names import Task
from pipeline.plan.knobs import check_knobs, runs_of

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
    _check_spaces(params)
    _check_model_overrides(params)
    _check_batches(params)
    check_knobs(params)
    _check_compile(params)
    _check_embedding_lr(params)
    _check_download_skip(params)
    _check_word_vectors(params)
    _check_lm_validation(params)
    check_storage(storage_path(params.train.placement, "."))


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
    goals: a generate model on a task-oriented corpus only. ``select_by: mrr`` ranks
    candidates: a select model only."""
    train, model, corpus = params.train, target.model, target.corpus
    select = train.run(model, corpus, target.variant).select_by
    if select is Selection.VALID_LOSS:
        return
    if select is Selection.MULTIWOZ_SCORE:
        if task is Task.GENERATE and _spec(params, corpus).task_oriented:
            return
        what = "multiwoz_score scores MultiWOZ responses"
    else:
        if task is Task.SELECT:
            return
        what = "mrr ranks a select model's candidates"
    key = run_key(model, corpus, target.variant)
    raise ConfigError(
        train.source(key, model, "select_by"),
        f"{what}, but run {key} is a {task} model on {corpus}: select it by valid_loss "
        "(set it per run under train.runs.<run>.overrides)",
    )


def _check_model_overrides(params: Params) -> None:
    """Every run's merged model config validates with its config class, at the run's
    corpus' sizes (a tuned run's at every corner of its search space); a
    ``train.models`` entry that no run merges validates on its own."""
    train = params.train
    merged_by_a_run = set()
    for where, key, target in runs_of(params):
        merged_by_a_run.add(target.model)
        sizes = _planned_sizes(params, target.corpus)
        try:
            registry.data_values(target.model, sizes)
        except ConfigError as err:
            raise ConfigError(f"{where}.corpus", err.reason) from None
        for config, sources, label in _run_configs(params, key, target):
            _validate_config(target.model, sizes, config, sources, label)
    for name in train.models:
        if name in merged_by_a_run:
            continue
        merged = {**train.defaults.model, **train.models[name].model}
        sources = [
            _Source(f"train.models.{name}.model", train.models[name].model),
            _Source("train.defaults.model", train.defaults.model),
        ]
        _validate_config(name, DataSizes(_ANY_VOCAB, _ANY_ACTS), merged, sources)


@dataclass(frozen=True)
class _Source:
    """A level of model config overrides: its dotted key, the fields it sets, and what a
    message adds to each (a search's extreme: ``" (the search's low)"``)."""

    key: str
    values: dict[str, Any]
    notes: dict[str, str] = field(default_factory=dict)

    def names(self, name: str) -> str:
        return f"{self.key}.{name} = {self.values[name]!r}{self.notes.get(name, '')}"


def _run_configs(
    params: Params, key: str, target: RunTarget
) -> Iterator[tuple[dict[str, Any], list[_Source], str]]:
    """The model config overrides run ``key`` trains with (a tuned run's at each corner
    of its search space), each with its levels, most specific first, and a label."""
    train, model = params.train, target.model
    own = train.runs[key].overrides.model if key in train.runs else {}
    sources = [
        _Source(f"train.runs.{key}.overrides.model", own),
        _Source(f"train.models.{model}.model", _model_overrides(params, model)),
        _Source("train.defaults.model", train.defaults.model),
    ]
    merged = train.run(model, target.corpus, target.variant).model
    if key not in params.tune.runs:
        yield merged, sources, f"run {key}"
        return
    for sample, taken in params.tune.spaces[model].corners():
        config = sampled_model(sample)
        searched = _Source(
            f"tune.spaces.{model}.model",
            {k: v for k, v in config.items() if k not in sample.get("per_head", {})},
            {k: f" (the search's {taken[f'model.{k}']})" for k in sample.get("model", {})},
        )
        heads = sample.get("per_head", {})
        per_head = _Source(
            f"tune.spaces.{model}.per_head",
            {k: config[k] for k in heads},
            {k: f" (the search's {taken[f'per_head.{k}']} x n_heads)" for k in heads},
        )
        yield {**merged, **config}, [searched, per_head, *sources], f"tuned run {key}"


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
    model: str,
    sizes: DataSizes,
    overrides: dict[str, Any],
    sources: list[_Source],
    run: str = "",
) -> None:
    """``registry.make_config`` of ``overrides``; a failure names the most specific of
    ``sources`` (most specific first) that sets the offending field (the first source
    when none does: a cross-field rule), ``run`` and each level that sets another field
    the reason names (a rule between fields: flex and the dropout in effect)."""
    try:
        registry.make_config(model, sizes, **overrides)
    except ConfigError as err:
        field_name = err.key.removeprefix(f"{model}.")
        where = next((s.key for s in sources if field_name in s.values), sources[0].key)
        reason = err.reason
        if reason.startswith("unknown key"):
            fields = _config_fields(model)
            reason = (
                f"{model}'s config has no field {field_name!r}; "
                f"{did_you_mean(field_name, fields)}fields: {', '.join(fields)}"
            )
        else:
            also = [
                next(s for s in sources if other in s.values).names(other)
                for other in _config_fields(model)
                if other != field_name
                and re.search(rf"\b{other}\b", reason)
                and any(other in s.values for s in sources)
            ]
            given = next((s for s in sources if field_name in s.values), None)
            if given is not None and given.notes.get(field_name):
                also.insert(0, given.names(field_name))
            if also:
                reason = f"{reason} (with {'; '.join(also)})"
            # a value a search draws beats any level's: the fix is in the search space
            searched = [
                f"{s.key}.{other}"
                for other in _config_fields(model)
                if (other == field_name or re.search(rf"\b{other}\b", err.reason))
                and (s := next((s for s in sources if other in s.values), None)) is not None
                and s.notes.get(other)
            ]
            if searched:
                reason += f"; the search draws {', '.join(searched)}: narrow or drop it there"
        if run:
            reason = f"{run}: {reason}"
        raise ConfigError(f"{where}.{field_name}", reason) from None


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
    ``batch_size / num_workers`` examples a step), and its ``batch_tokens`` leaves each
    worker at least a token (each plans its batches within ``batch_tokens //
    num_workers``): found here, not when a tune trial or a training starts."""
    workers = params.train.scale.num_workers
    if workers <= 1:
        return
    for _, key, target in runs_of(params):
        knobs = params.train.run(target.model, target.corpus, target.variant)
        if knobs.batch_size % workers:
            raise ConfigError(
                params.train.source(key, target.model, "batch_size"),
                f"{knobs.batch_size} is the global batch of run {key} (all workers "
                f"together) and must divide by train.scale.num_workers={workers}: make it "
                f"{(knobs.batch_size // workers + 1) * workers}, or change num_workers",
            )
        if knobs.batch_tokens is not None and knobs.batch_tokens < workers:
            raise ConfigError(
                params.train.source(key, target.model, "batch_tokens"),
                f"{knobs.batch_tokens} is the global token budget of run {key} (all workers "
                f"together), split over train.scale.num_workers={workers}: each worker "
                f"would plan its batches within {knobs.batch_tokens // workers} tokens. Make "
                "it a multiple of the workers large enough for several of the longest "
                "examples on each (16384 on a GPU), or leave it out to batch by batch_size",
            )


def _check_compile(params: Params) -> None:
    """``compile: on`` (or ``reduce-overhead``) only for a model that compiles whole
    (``supports_compile``; ``auto`` leaves the others eager): the others break the
    compiled graph at every step and recompile as shapes change (hrt_last took minutes a
    step)."""
    for _, key, target in runs_of(params):
        knobs = params.train.run(target.model, target.corpus, target.variant)
        if knobs.compile in (CompileMode.AUTO, CompileMode.OFF):
            continue
        why = _why_eager(params, key, target)
        if why is None:
            continue
        raise ConfigError(
            params.train.source(key, target.model, "compile"),
            f"run {key}: {target.model} cannot be compiled whole (compile: "
            f"{knobs.compile.value}): {why}. Set compile: auto (it trains this model eagerly "
            "and compiles the others on CUDA) or off, for this model under "
            f"train.models.{target.model}.compile",
        )


def _check_embedding_lr(params: Params) -> None:
    """``optimizer.embedding_lr_multiplier`` other than 1 only for a model with one token
    embedding (its class's ``token_embedding``: the LMs), which the multiplier's group
    holds."""
    for _, key, target in runs_of(params):
        knobs = params.train.run(target.model, target.corpus, target.variant)
        multiplier = knobs.optimizer.embedding_lr_multiplier
        builder = registry.spec(target.model).builder
        if multiplier == 1.0 or (
            isinstance(builder, type) and builder.token_embedding is not TaskModel.token_embedding
        ):
            continue
        raise ConfigError(
            params.train.source(key, target.model, "optimizer.embedding_lr_multiplier"),
            f"run {key}: {target.model} has no single token embedding to train at "
            f"{multiplier:g} x lr; set it to 1 (its default) for this model, under "
            f"train.models.{target.model}.optimizer",
        )


def _why_eager(params: Params, key: str, target: RunTarget) -> str | None:
    """Why the model of run ``key`` does not compile whole (its class's
    ``supports_compile = False`` and ``eager_reason``), or None where it does."""
    builder = registry.spec(target.model).builder
    if isinstance(builder, type):  # the model's class says it
        cls = builder
    else:  # a wrapper (ensemble, with_none): its members decide, so it is built to see them
        config, _, _ = next(_run_configs(params, key, target))
        model = registry.build(target.model, _planned_sizes(params, target.corpus), **config)
        cls = next(
            (type(m) for m in model.modules() if getattr(type(m), "supports_compile", 1) is False),
            type(model),
        )
    if getattr(cls, "supports_compile", True) is not False:
        return None
    return getattr(cls, "eager_reason", f"{cls.__name__} sets supports_compile = False")
