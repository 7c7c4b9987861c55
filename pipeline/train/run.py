"""The train and tune stages' logic: params -> validated job -> fit / search -> outputs.

``train_run`` trains one model on one corpus (resuming an interrupted run of the same
params), exports the best weights to ``data/train/<model>-<corpus>/model.pt``, tracks it
in MLflow (params, metrics, vocabulary, checkpoint, samples, registered pyfunc) and
writes ``manifest.json`` beside it. ``tune_run`` searches its hyper-parameters and writes
``data/tune/<model>-<corpus>/best.json``, which ``train_run`` reads for tuned runs.
Everything the params can get wrong is checked before any compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import tracking
from pipeline.artifacts import (
    BEST_FILE,
    MODEL_FILE,
    VOCAB_FILE,
    Layout,
    MlflowRef,
    TrainedSeed,
    TuneRecord,
    load_model,
    save_model,
)
from pipeline.config import CorpusName, Params, RunParams, Task, run_key
from pipeline.data.loader import load_vocab
from pipeline.data.shards import read_manifest
from pipeline.errors import ConfigError
from pipeline.machine import code_version
from pipeline.models import registry
from pipeline.models.base import DataSizes, token_embeddings
from pipeline.models.word_vectors import DimensionError, WordVectors, read_word_vectors
from pipeline.serving import ServingSpec
from pipeline.train.distributed import fit, has_checkpoint, ray_cluster, storage_path
from pipeline.train.job import (
    ConfiguredModel,
    RegistryModel,
    data_fingerprint,
    model_config,
    per_rank_batch,
    run_name,
    shard_data,
    validation_score,
)
from pipeline.train.loop import TrainJob
from pipeline.train.tune import TrialSetup, search, search_exists

# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Plan:
    """A validated run: everything decided before compute starts."""

    model: str
    corpus: str
    task: Task
    params: RunParams
    config: dict[str, Any]
    sizes: DataSizes
    tuned_from: TuneRecord | None
    variant: str | None = None


def _task(params: Params, model: str, corpus: str, where: str) -> Task:
    task = registry.spec(model).task
    if CorpusName(corpus) not in params.tokenize.corpora:
        raise ConfigError(where, f"tokenize.corpora has no entry for {corpus!r}")
    tasks = [t.value for t in params.corpus(corpus).tasks]
    if task.value not in tasks:
        raise ConfigError(
            where, f"{model} is a {task.value} model but {corpus} only yields {tasks}"
        )
    return task


def plan_train(
    params: Params, model: str, corpus: str, layout: Layout, variant: str | None = None
) -> Plan:
    """Check a train run's params and inputs; apply the tune result if it is tuned."""
    key = run_key(model, corpus, variant)
    tuned = key in params.tune.runs
    if key not in params.train.runs and not tuned:
        raise ConfigError("train.runs", f"{key} is in neither train.runs nor tune.runs")
    task = _task(params, model, corpus, f"train.runs.{key}")
    run = params.train.run(model, corpus, variant)
    best = None
    if tuned:
        best = TuneRecord.read(layout.tune_out(key) / BEST_FILE)
        run = run.model_validate(
            {
                **run.model_dump(),
                "model": {**run.model, **best.config},
                "optimizer": {**run.optimizer.model_dump(), **best.optimizer},
            }
        )
    workers = max(params.train.scale.num_workers, 1)
    per_rank_batch(run.batch_size, workers, "batch_size")
    sizes = read_manifest(layout.shards(corpus)).data_sizes()
    config = model_config(model, sizes, run.model, f"train.models.{model}")
    return Plan(model, corpus, task, run, config.model_dump(mode="json"), sizes, best, variant)


# --------------------------------------------------------------------------- train


def _start_tracker(
    params: Params, plan: Plan, layout: Layout, name: str, stage: str, resumes: bool
) -> tracking.Tracker | tracking.NullTracker:
    """The stage's MLflow run. ``resumes``: the training (or search) goes on from a
    checkpoint of an earlier run of ``name``, finished or not, so that run, which holds the
    history before the checkpoint, goes on; otherwise a fresh run logs the whole history."""
    if not params.tracking.enabled:
        return tracking.NullTracker()
    root = layout.root
    shards = layout.relative(layout.shards(plan.corpus))
    inputs = tracking.dvc_input_hashes(root, [shards])
    tags = {
        tracking.TAG_MODEL: plan.model,
        tracking.TAG_CORPUS: plan.corpus,
        tracking.TAG_VARIANT: plan.variant or "",
        tracking.TAG_TASK: plan.task.value,
        tracking.TAG_STAGE: stage,
        tracking.TAG_GIT: code_version(root) or "unknown",
        **{f"{tracking.TAG_INPUT}.{path}": md5 for path, md5 in inputs.items()},
        **{f"hiertx.system.{k}": v for k, v in tracking.system_info().items()},
    }
    return tracking.Tracker.start(
        tracking.tracking_uri(root),
        tracking.fallback_uri(root),
        tracking.experiment_name(plan.task.value, plan.corpus, params.tracking.experiment_prefix),
        run_name=name,
        tags=tags,
        resume_key=name,
        reuse="any" if resumes else "never",
    )


def serving_spec(params: Params, plan: Plan) -> ServingSpec:
    corpus = params.corpus(plan.corpus)
    return ServingSpec(
        task=plan.task.value,
        max_history=corpus.generate.max_history,
        max_utterances=corpus.generate.max_utterances,
        max_response=corpus.generate.max_response,
        max_candidate=corpus.select.max_candidate,
        max_sentence=corpus.lm.max_sentence,
    )


def sample_generations(model_file: Path, shards: Path, task: Task, n: int, max_length: int) -> str:
    """Greedy responses of the exported model to the first ``n`` validation histories."""
    if task != Task.GENERATE or n == 0:
        return ""
    import torch

    from pipeline.data.loader import BatchLoader, open_split
    from pipeline.data.splits import Split
    from pipeline.decode import DecodeConfig, generate

    model = load_model(model_file)
    vocab = load_vocab(shards)
    loader = BatchLoader(open_split(shards, task, Split.VALID), n, shuffle=False, bucket=False)
    batch = next(iter(loader))
    with torch.no_grad():
        out = generate(model, batch, DecodeConfig(max_length=max_length))
    lines = []
    for i in range(batch.batch_size):
        ids = batch.history.input_ids[i][batch.history.input_mask[i]].tolist()
        lines += [
            f"## {batch.dialogue_id[i]}",
            f"history:   {vocab.decode(ids)}",
            f"reference: {vocab.decode(batch.target_ids[i].tolist())}",
            f"generated: {vocab.decode(out.tokens[i][: int(out.lengths[i])].tolist())}",
            "",
        ]
    return "\n".join(lines)


def train_run(
    params: Params,
    model: str,
    corpus: str,
    root: str | Path = ".",
    show_progress: bool = True,
    model_file: Path | None = None,
    variant: str | None = None,
) -> TrainedSeed:
    """Train (or resume) ``model`` on ``corpus`` (run ``variant``) and export its best
    weights to ``model_file`` (default ``data/train/<key>/model.pt``); returns the seed's
    record (``seeds.train_seeds`` writes the run's :class:`~pipeline.artifacts.TrainRecord`)."""
    layout = Layout(Path(root).resolve())
    key = run_key(model, corpus, variant)
    plan = plan_train(params, model, corpus, layout, variant)
    scale = params.train.scale
    shards = layout.shards(corpus)
    name = run_name(
        "train",
        model,
        corpus,
        plan.params.model_dump(mode="json"),
        plan.config,
        scale.num_workers,
        data_fingerprint(shards),
        *([variant] if variant else []),  # a variant never resumes another run's checkpoint
        # another vectors file at the same path starts afresh (its size: stat, not a hash)
        *([vectors_path(plan, layout).stat().st_size] if plan.params.word_vectors else []),
    )
    storage = storage_path(scale, layout.root)
    resumes = has_checkpoint(name, scale, storage)
    # a resumed run's checkpoint holds the embeddings it started from: no second read
    vectors = None if resumes else read_vectors(plan, layout)
    tracker = _start_tracker(params, plan, layout, name, "train", resumes)
    try:
        tracker.log_params(
            {
                "train": plan.params.model_dump(mode="json"),
                "model_config": plan.config,
                "scale": scale.model_dump(mode="json"),
                "tuned": plan.tuned_from is not None,
            }
        )
        if vectors is not None:
            coverage = vectors.coverage.as_dict()
            tracker.log_params({"word_vectors": coverage})
            tracker.log_metrics({f"word_vectors_{k}": v for k, v in coverage.items()}, step=0)
        job = TrainJob(
            name=name,
            model_name=model,
            model=RegistryModel(model, plan.config, vectors),
            data=shard_data(shards, plan.task.value, plan.params),
            params=plan.params,
            run_dir=storage,
            sink=tracker.sink,
            show_progress=show_progress,
            label=f"train {key} (seed {plan.params.seed})",
            validation_score=validation_score(
                plan.params, shards, layout.raw(corpus), corpus, params.corpus(corpus)
            ),
        )
        result = fit(job, scale, storage)
        if model_file is None:
            model_file = layout.train_out(key) / MODEL_FILE
        _export(result.load(), result.metrics, name, model_file)
        mlflow = None
        if isinstance(tracker, tracking.Tracker):
            mlflow = _track_final(params, plan, layout, tracker, model_file, result)
        tracker.end()
    except BaseException:
        tracker.end("FAILED")
        raise
    return TrainedSeed(
        seed=plan.params.seed,
        run_name=name,
        checkpoint=layout.relative(model_file),
        run_checkpoint=result.checkpoint
        if "://" in result.checkpoint
        else layout.relative(Path(result.checkpoint)),
        metrics=result.metrics,
        tuned_from=plan.tuned_from.model_dump(mode="json") if plan.tuned_from else None,
        mlflow=mlflow,
    )


def vectors_path(plan: Plan, layout: Layout) -> Path:
    """The run's ``word_vectors`` file (a relative path is from the project root)."""
    assert plan.params.word_vectors is not None
    path = layout.root / plan.params.word_vectors  # an absolute path stays itself
    if not path.is_file():  # params_check says so first, for paths from the working folder
        raise ConfigError(f"train.models.{plan.model}.word_vectors", f"no such file {path}")
    return path


def read_vectors(plan: Plan, layout: Layout) -> WordVectors | None:
    """The run's pre-trained word vectors for its corpus' vocabulary (None without
    ``word_vectors``), read once here rather than by every worker. The model is built on
    the meta device (no memory, no compute) to learn its token embeddings' size, so a
    file of another dimension fails at its first line, naming the config field to set."""
    if plan.params.word_vectors is None:
        return None
    import torch

    key = f"train.models.{plan.model}"
    with torch.device("meta"):
        embeddings = token_embeddings(RegistryModel(plan.model, plan.config)())
    if not embeddings:
        raise ConfigError(
            f"{key}.word_vectors",
            f"{plan.model} has no token embedding to load word vectors into: unset it",
        )
    dims = sorted({e.embedding_dim for e in embeddings})
    path = vectors_path(plan, layout)
    try:
        if len(dims) > 1:
            raise ConfigError(
                f"{key}.word_vectors",
                f"{plan.model}'s token embeddings differ in size {dims}: one file cannot fill them",
            )
        vocab = load_vocab(layout.shards(plan.corpus))
        return read_word_vectors(path, vocab.tokens, dims[0])
    except DimensionError as err:
        fields = [f for f in ("d_embed", "d_sentence", "d_model") if plan.config.get(f) == dims[0]]
        where = f"{key}.model.{fields[0]}" if fields else f"{key}.word_vectors"
        raise ConfigError(where, str(err)) from None


def _export(state: dict[str, Any], metrics: dict[str, float], name: str, path: Path) -> Path:
    """The best weights (final ones if never evaluated better) with what rebuilds them."""
    weights = state.get("best_model") or state["model"]
    return save_model(
        path,
        state["model_name"],
        state["model_config"],
        state["task"],
        weights,
        metrics,
        run_name=name,
    )


def _track_final(
    params: Params,
    plan: Plan,
    layout: Layout,
    tracker: tracking.Tracker,
    model_file: Path,
    result: Any,
) -> MlflowRef:
    tracker.log_metrics(
        {f"final_{k}": v for k, v in result.metrics.items()}, int(result.metrics["steps"])
    )
    shards = layout.shards(plan.corpus)
    tracker.log_artifact(shards / VOCAB_FILE, "tokenizer")
    tracker.log_artifact(model_file, "checkpoint")
    samples = sample_generations(
        model_file,
        shards,
        plan.task,
        params.tracking.sample_generations,
        params.corpus(plan.corpus).generate.max_response,
    )
    if samples:
        tracker.log_text(samples, "samples/generations.txt")
    version = None
    registered = tracking.registered_model_name(plan.model, plan.corpus, plan.variant)
    if params.tracking.log_model:
        version = tracker.log_pyfunc(
            registered if params.tracking.register_model else None,
            checkpoint=model_file,
            vocab=shards / VOCAB_FILE,
            spec=serving_spec(params, plan),
        )
    return MlflowRef(
        tracking_uri=tracking.portable_uri(tracker.ref.uri, layout.root),
        experiment=tracker.ref.experiment,
        run_id=tracker.run_id,
        fallback=tracker.fell_back,
        checkpoint_uri=f"runs:/{tracker.run_id}/checkpoint/{MODEL_FILE}",
        registered_model=registered if version is not None else None,
        model_version=version,
    )


# --------------------------------------------------------------------------- tune


def plan_tune(params: Params, model: str, corpus: str, layout: Layout) -> Plan:
    key = run_key(model, corpus)
    if key not in params.tune.runs:
        raise ConfigError("tune.runs", f"{key} is not listed (add it to tune it)")
    task = _task(params, model, corpus, f"tune.runs.{key}")
    space = params.tune.spaces[model]
    fields = registry.spec(model).config_cls.model_fields
    searchable = sorted(set(fields) - set(registry.spec(model).config_cls.DATA_FIELDS))
    for name in space.model:
        if name not in searchable:
            raise ConfigError(
                f"tune.spaces.{model}.model.{name}",
                f"not a field of {model}'s config; choose among {searchable}",
            )
    run = params.train.run(model, corpus)
    per_rank_batch(run.batch_size, max(params.train.scale.num_workers, 1), "batch_size")
    sizes = read_manifest(layout.shards(corpus)).data_sizes()
    config = model_config(model, sizes, run.model, f"train.models.{model}")
    return Plan(model, corpus, task, run, config.model_dump(mode="json"), sizes, None)


def tune_run(
    params: Params, model: str, corpus: str, root: str | Path = ".", show_progress: bool = True
) -> TuneRecord:
    """Search ``model``'s hyper-parameters on ``corpus``; writes and returns the best
    trial's record (``data/tune/<key>/best.json``)."""
    layout = Layout(Path(root).resolve())
    plan = plan_tune(params, model, corpus, layout)
    scale, tune_params = params.train.scale, params.tune
    shards = layout.shards(corpus)
    search_knobs = tune_params.model_dump(mode="json", exclude={"runs", "spaces", "concurrency"})
    space = tune_params.spaces[model]
    name = run_name(
        "tune",
        model,
        corpus,
        plan.params.model_dump(mode="json"),
        search_knobs,
        space.model_dump(mode="json"),
        scale.num_workers,
        data_fingerprint(shards),
    )
    storage = storage_path(scale, layout.root)
    parent = _start_tracker(params, plan, layout, name, "tune", search_exists(name, storage))
    try:
        parent.log_params(
            {
                "train": plan.params.model_dump(mode="json"),
                "tune": search_knobs,
                "space": space.model_dump(mode="json"),
            }
        )
        setup = TrialSetup(
            model_name=model,
            model_factory=ConfiguredModel(plan.sizes, f"tune.spaces.{model}"),
            data=shard_data(shards, plan.task.value, plan.params),
            validation_score=validation_score(
                plan.params, shards, layout.raw(corpus), corpus, params.corpus(corpus)
            ),
            base=plan.params,
            tune=tune_params,
            scale=scale,
            storage=storage,
            parent=parent.ref,
            tags={
                tracking.TAG_MODEL: model,
                tracking.TAG_CORPUS: corpus,
                tracking.TAG_STAGE: "tune",
            },
        )
        with ray_cluster():
            result = search(name, setup, space, show_progress, f"tune {run_key(model, corpus)}")
        best = result.record(
            model=model,
            corpus=corpus,
            search=name,
            parent_run_id=parent.run_id,
        )
        # Ray's verdict: a trial it reports completed is FINISHED, one that errored (or
        # never reported) FAILED
        parent.end_children(result.trial_status, default="FAILED")
        best_metrics = {"best_valid_loss": result.valid_loss}
        if result.valid_score is not None:
            best_metrics["best_valid_score"] = result.valid_score
        parent.log_metrics(best_metrics, step=0)
        parent.log_dict(best.model_dump(mode="json"), BEST_FILE)
        parent.end()
    except BaseException:
        parent.end("FAILED")
        raise
    best.write(layout.tune_out(run_key(model, corpus)) / BEST_FILE)
    return best
