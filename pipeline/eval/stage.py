"""The evaluate stage's logic: every trained seed of a run, scored on the test split.

``evaluate_run`` reads the run's :class:`~pipeline.artifacts.TrainRecord` (one entry per
seed), loads each seed's exported weights (``models.saved.load_model``), scores it with
the evaluator of its task (``eval.generation``, ``eval.selection``, ``eval.language``)
and writes, through the stage contract (``pipeline.artifacts``):

- ``metrics/<key>.json``: flat ``{metric: value}`` (names: ``eval.catalogue``); with
  several seeds each value is the mean over seeds and ``<metric>_ci95`` the half-width of
  its 95% Student-t interval (git-tracked DVC metrics);
- ``data/eval/<key>/seeds.json`` (:class:`~pipeline.artifacts.EvalRecord`): every seed's
  own metrics;
- ``data/eval/<key>/per_example.jsonl`` (:class:`~pipeline.artifacts.ExampleResult`): one
  row per test example per seed (``id`` = ``<dialogue id>#<turn>``), for paired bootstraps;
- ``data/eval/<key>/samples.md``: the first histories with their reference and generated
  responses.

The metrics of each seed are also logged to that seed's training run in MLflow (the ids
are in the train manifest), prefixed ``eval/``.

A seed is evaluated on ``ExecutionPolicy.for_evaluation`` of the run's precision (the train
record's, so a run trained in fp32 is tested in fp32, one trained in bf16 under bf16
autocast, and ``auto`` in bf16 on CUDA only), on CUDA at the largest test batch that fits
(``execution.Evaluation``: from 512 examples, halved on out-of-memory and the evaluation
started over; the size found carries over to the next seed). On CPU it is evaluated at
``evaluate.batch_size``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline import tracking
from pipeline.artifacts import (
    PER_EXAMPLE_FILE,
    SAMPLES_FILE,
    SEEDS_FILE,
    EvalRecord,
    Layout,
    SeedMetrics,
    TrainedSeed,
    read_train,
    write_examples,
    write_metrics,
)
from pipeline.cluster import PROJECT_ON_SHARED_FS, ray_cluster, require_shared, use_gpu
from pipeline.config import (
    CorpusParams,
    EvaluateParams,
    PlacementParams,
    Precision,
    TokenizeParams,
    TrackingParams,
    run_key,
)
from pipeline.data.corpora import corpus_spec
from pipeline.data.loader import load_vocab, open_split
from pipeline.data.splits import Split
from pipeline.eval.collect import Evaluator, SeedResult, aggregate, n_test_batches
from pipeline.eval.generation import GenerateEvaluator, embedding_vectors
from pipeline.eval.language import LMEvaluator
from pipeline.eval.selection import SelectEvaluator
from pipeline.execution import ExecutionPolicy, LargestBatch
from pipeline.gpu_share import gpu_lease
from pipeline.machine import cpu_threads, default_device
from pipeline.models import registry
from pipeline.models.saved import load_model
from pipeline.names import Task
from pipeline.progress import Mode, Reporter

MLFLOW_PREFIX = "eval/"


@dataclass(frozen=True)
class EvalSettings:
    """What the evaluate stage reads of params.yaml."""

    evaluate: EvaluateParams
    corpus: CorpusParams
    tracking: TrackingParams


def evaluate_run(
    settings: EvalSettings,
    model_name: str,
    corpus: str,
    root: str | Path = ".",
    progress: bool | Mode = False,
    variant: str | None = None,
) -> dict[str, float]:
    """Evaluate every seed of run ``<model>-<corpus>[-<variant>]``; writes
    ``metrics/<key>.json`` and ``data/eval/<key>/`` (module docstring) and returns the
    aggregated metrics. A run trained on Ray Train workers is evaluated on the cluster, a
    Ray task per seed with the resources one of its workers had (a GPU if it had one);
    one trained in-process, in this process. ``progress``: per seed, the test batches done
    of the total (``pipeline.progress``)."""
    start = time.perf_counter()
    layout = Layout(Path(root).resolve())
    key = run_key(model_name, corpus, variant)
    record = read_train(layout, key)
    vectors = _vectors(settings, model_name, corpus, layout)
    job = SeedEvaluation(
        settings, model_name, corpus, layout.root, key, progress, vectors, record.precision
    )
    if record.workers == 0 or record.placement is None:
        placement = record.placement or PlacementParams()
        with gpu_lease(placement), cpu_threads(placement.cpus_per_worker):  # as trained
            results = [job(seed) for seed in record.seeds]
    else:
        results = _on_cluster(job, record.seeds, record.placement)
    out = layout.eval_out(key)
    out.mkdir(parents=True, exist_ok=True)
    samples = out / SAMPLES_FILE
    samples.write_text(_samples_md(key, next((r.samples for r in results if r.samples), "")))
    per_seed, rows = [], []
    for seed, result in zip(record.seeds, results, strict=True):
        per_seed.append(
            SeedMetrics(seed=seed.seed, checkpoint=seed.checkpoint, metrics=result.metrics)
        )
        rows += result.examples.rows(seed.seed)
        if settings.tracking.enabled:
            _log_to_mlflow(seed, result.metrics, samples, layout.root)
    write_examples(out / PER_EXAMPLE_FILE, rows)
    wall = time.perf_counter() - start
    EvalRecord(model=model_name, corpus=corpus, seeds=per_seed, wall_s=wall).write(out / SEEDS_FILE)
    metrics = aggregate([s.metrics for s in per_seed])
    write_metrics(layout.metrics(key), metrics)
    return metrics


@dataclass(frozen=True)
class SeedEvaluation:
    """The evaluation of one trained seed: picklable, so a Ray task can run it where the
    seed's training ran (paths are absolute; ``vectors``: the embedding metrics' word
    vectors, built once by the driver; ``precision``: the run's, from its train record;
    ``batch``: the test batch size that fitted the device, carried from seed to seed)."""

    settings: EvalSettings
    model_name: str
    corpus: str
    root: Path
    key: str
    progress: bool | Mode
    vectors: Any
    precision: Precision = Precision.AUTO
    batch: LargestBatch = field(default_factory=LargestBatch, compare=False)

    def __call__(self, seed: TrainedSeed) -> SeedResult:
        layout = Layout(self.root)
        policy = ExecutionPolicy.for_evaluation(self.precision, default_device())
        task = registry.spec(self.model_name).task
        dataset = open_split(layout.shards(self.corpus), task, Split.TEST)
        evaluator = _evaluator(self, task, layout, policy)
        model = policy.place(load_model(layout.resolve(seed.checkpoint)))
        ev = self.settings.evaluate

        def attempt(size: int, limit: int | None) -> SeedResult:
            settings = ev.model_copy(update={"batch_size": size, "max_batches": limit})
            evaluate = dataclasses.replace(evaluator, settings=settings)
            bar = Reporter(
                f"evaluate {self.key} (seed {seed.seed})",
                n_test_batches(dataset, size, limit),
                unit="batch",
                units="batches",
                show=self.progress,
            )
            with torch.no_grad(), policy.autocast(), bar:
                return evaluate(model, dataset, bar, seed.seed)

        return policy.evaluation(ev.batch_size, ev.max_batches, largest=self.batch).run(
            attempt, model
        )


def _on_cluster(
    job: SeedEvaluation, seeds: list[TrainedSeed], placement: PlacementParams
) -> list[SeedResult]:
    """``job`` of every seed as Ray tasks, each with what one training worker had."""
    import ray

    gpus = placement.gpus_per_worker if use_gpu(placement) else 0
    with ray_cluster():
        data = Layout(job.root).data_dir  # the shards, the exported models, MultiWOZ's database
        require_shared(data, "project", "the models and test data are under", PROJECT_ON_SHARED_FS)
        task = ray.remote(_run_seed).options(num_cpus=placement.cpus_per_worker, num_gpus=gpus)
        return ray.get([task.remote(job, seed, placement.cpus_per_worker) for seed in seeds])


def _run_seed(job: SeedEvaluation, seed: TrainedSeed, cpus: float) -> SeedResult:
    with cpu_threads(cpus):
        return job(seed)


def _vectors(settings: EvalSettings, model_name: str, corpus: str, layout: Layout) -> Any:
    """The embedding metrics' word vectors of a generate model's corpus (None otherwise)."""
    if registry.spec(model_name).task is not Task.GENERATE:
        return None
    shards = layout.shards(corpus)
    return embedding_vectors(settings.evaluate, shards, load_vocab(shards))


def _evaluator(
    job: SeedEvaluation, task: Task, layout: Layout, policy: ExecutionPolicy
) -> Evaluator:
    """The evaluator of ``task`` on ``policy``."""
    settings = job.settings
    ev = settings.evaluate
    if task is Task.SELECT:
        return SelectEvaluator(ev, policy)
    if task is Task.LM:
        return LMEvaluator(ev, policy)
    spec = corpus_spec(job.corpus, settings.corpus.source)
    return GenerateEvaluator(
        settings=ev,
        vocab=load_vocab(layout.shards(job.corpus)),
        decodes=ev.decodes_for(job.model_name),
        vectors=job.vectors,
        max_length=settings.corpus.generate.max_response,
        policy=policy,
        multiwoz=_multiwoz_inputs(job.corpus, settings, layout.raw(job.corpus))
        if spec.task_oriented
        else None,
        bleu_tokenize=spec.bleu_tokenize,
    )


def _multiwoz_inputs(corpus_name: str, settings: EvalSettings, raw: Path) -> tuple[Any, Any]:
    from pipeline.data.formats import ParseStats
    from pipeline.data.tokenize import read_splits
    from pipeline.eval.multiwoz_db import MultiWozDB

    section = TokenizeParams(corpora={corpus_name: settings.corpus})
    dialogues = read_splits(corpus_name, raw, section, ParseStats()).get(Split.TEST, [])
    return dialogues, MultiWozDB.load(raw)


def _log_to_mlflow(seed: TrainedSeed, metrics: dict[str, float], samples: Path, root: Path):
    info = seed.mlflow
    if info is None:
        return
    ref = tracking.RunRef(
        tracking.resolve_uri(info.tracking_uri, root),  # records keep it relative
        info.run_id,
        info.experiment,
        seed.run_name,
        tracking.fallback_uri(root),
    )
    tracker = ref.attach()
    finite = {f"{MLFLOW_PREFIX}{k}": v for k, v in metrics.items() if math.isfinite(v)}
    tracker.log_metrics(finite, step=0)
    if samples.is_file():
        tracker.log_artifact(samples, MLFLOW_PREFIX.rstrip("/"))


def _samples_md(key: str, body: str) -> str:
    if not body:
        return f"# {key}\n\nNo generated samples (not a generate model).\n"
    return f"# {key}: test samples (first seed)\n\n{body}\n"
