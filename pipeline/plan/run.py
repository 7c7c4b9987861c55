"""The run plan: one frozen value that says everything a training (or a search) will do,
built once per run and seed from checked params and the data's records.

    params.yaml --load_checked--> Params --RunRequest.of--> RunRequest (the stage's slice)
        --plan_training(+ tokenize record, tune record)--> RunPlan --for_seed--> RunPlan

A :class:`RunRequest` is what a stage reads of params for run ``<key>``, and only that
(``dvc.yaml`` declares the same keys: ``tests/test_dvc.py``). A :class:`RunPlan` adds what
the data decides (vocabulary and act inventory sizes, the data fingerprint), the tune
result of a tuned run, the validated model config (typed, never a dict), where it runs and
stores, and its identity. Seeds are ``model_copy``s of the first seed's plan. It is
picklable and self-contained: a Ray task can take a plan and train it.

The identity (:class:`RunIdentity`) is everything that decides the result: the merged
knobs, the model config, the number of workers, the data's fingerprint, the variant, the
size of a word-vectors file, and the code (``plan.code``). Its digest names the run's
checkpoint folder and MLflow run: the same identity resumes, any change starts fresh.
Placement (CPUs and GPUs per worker, strategy, storage, failures) is not part of it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SerializeAsAny

from pipeline.artifacts import (
    BEST_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    DataSizes,
    Layout,
    TokenizeRecord,
    TuneRecord,
)
from pipeline.cluster import storage_path
from pipeline.config import (
    CorpusParams,
    Params,
    PlacementParams,
    RunParams,
    SearchSpace,
    TrackingParams,
    TuneParams,
    knob_sources,
    merge_params,
    parse_run_key,
    tuned_knobs,
)
from pipeline.data.resample import draws_key
from pipeline.data.streams import stream_key
from pipeline.errors import ConfigError
from pipeline.models import registry
from pipeline.models.base import ModelConfig
from pipeline.names import Task
from pipeline.plan.code import code_fingerprint, stage_code

SEED_STRIDE = 1000  # seed i of a run trains with seed + 1000 i (workers add their rank)
SEARCH_KNOBS = (
    "trials",
    "concurrency",
    "epochs_per_trial",
    "grace_period",
    "reduction_factor",
    "seed",
    "cpus_per_trial",
)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class RunRequest(_Frozen):
    """What params say about run ``key``: the slice its train (or tune) stage reads.
    ``knobs`` are merged (defaults < models.<model> < the run's overrides); ``placement``
    and ``tracking`` say where it runs and is recorded, not what it computes (not DVC
    dependencies: ``stages.UNDECLARED_PARAMS``)."""

    key: str
    model: str
    corpus: str
    variant: str | None
    tuned: bool
    knobs: RunParams
    space: SearchSpace | None
    search: TuneParams | None
    workers: int
    corpus_params: CorpusParams
    placement: PlacementParams
    tracking: TrackingParams
    sources: dict[str, str] = {}  # knob (dotted) -> the params key that sets it, for errors

    @classmethod
    def of(cls, params: Params, key: str, search: bool = False) -> RunRequest:
        """Run ``key`` of ``train.runs`` or ``tune.runs`` (with ``search``, the tune
        stage's: the search knobs too)."""
        parse_run_key(key)
        tuned = key in params.tune.runs
        if not tuned and key not in params.train.runs:
            raise ConfigError("train.runs", f"no run {key!r} in train.runs or tune.runs")
        train, tune = params.train, params.tune
        target = (tune.runs if tuned else train.runs)[key]
        model, corpus, variant = target.model, target.corpus, target.variant
        knobs = train.defaults
        models = train.models
        if model in models:
            knobs = merge_params(knobs, models[model])
        if not tuned:
            knobs = merge_params(knobs, target.overrides)
        sources = knob_sources(train, key, model)
        if tuned:  # the search chooses these
            sources |= {
                f"optimizer.{k}": f"tune.spaces.{model}.optimizer.{k}"
                for k in tune.spaces[model].optimizer
            }
        return cls(
            key=key,
            model=model,
            corpus=corpus,
            variant=variant,
            tuned=tuned,
            knobs=knobs,  # type: ignore[arg-type]  # merge_params keeps the type
            space=tune.spaces[model] if tuned else None,
            search=TuneParams.model_construct(**{k: getattr(tune, k) for k in SEARCH_KNOBS})
            if search
            else None,
            workers=train.scale.num_workers,
            corpus_params=params.tokenize.corpora[corpus],
            placement=train.placement,
            tracking=params.tracking,
            sources=sources,
        )


class RunIdentity(_Frozen):
    """What decides a training's (or a search's) result; its digest names the run."""

    stage: Literal["train", "tune"]
    model: str
    corpus: str
    variant: str | None
    knobs: dict[str, Any]
    config: dict[str, Any]
    search: dict[str, Any] | None
    workers: int
    data: str
    vectors_bytes: int | None
    code: str

    @property
    def digest(self) -> str:
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:10]

    @property
    def name(self) -> str:
        """``<stage>-<model>-<corpus>-<digest>``: the Ray run and MLflow resume key."""
        return f"{self.stage}-{self.model}-{self.corpus}-{self.digest}"


class RunPlan(_Frozen):
    """One training of one seed, decided before any compute (module docstring)."""

    stage: Literal["train", "tune"]
    key: str
    model: str
    corpus: str
    variant: str | None
    task: Task
    knobs: RunParams
    config: SerializeAsAny[ModelConfig]
    sizes: DataSizes
    corpus_params: CorpusParams
    workers: int
    placement: PlacementParams
    tracking: TrackingParams
    root: Path
    storage: str
    data: str
    code: str
    word_vectors: Path | None = None
    vectors_bytes: int | None = None  # the file's size when planned: another file, another run
    tuned_from: TuneRecord | None = None
    space: SearchSpace | None = None
    search: TuneParams | None = None
    seed_index: int = 0
    sources: dict[str, str] = {}  # knob -> the params key that sets it (errors; no identity)

    @property
    def layout(self) -> Layout:
        return Layout(self.root)

    @property
    def shards(self) -> Path:
        return self.layout.shards(self.corpus)

    @property
    def raw(self) -> Path:
        return self.layout.raw(self.corpus)

    @property
    def seeds(self) -> list[int]:
        """Every seed of the run, the first seed's plan's ``knobs.seed`` first."""
        base = self.knobs.seed - SEED_STRIDE * self.seed_index
        return [base + SEED_STRIDE * i for i in range(self.knobs.seeds)]

    @property
    def model_file(self) -> Path:
        """Where this seed's weights are exported (``seed-<i>/`` with several seeds)."""
        out = self.layout.train_out(self.key)
        return (out / f"seed-{self.seed_index}" if self.knobs.seeds > 1 else out) / MODEL_FILE

    @property
    def label(self) -> str:
        """How progress lines name it."""
        return f"{self.stage} {self.key}" + (
            f" (seed {self.knobs.seed})" if self.stage == "train" else ""
        )

    def identity(self) -> RunIdentity:
        return RunIdentity(
            stage=self.stage,
            model=self.model,
            corpus=self.corpus,
            variant=self.variant,
            knobs=self.knobs.model_dump(mode="json"),
            config=self.config.model_dump(mode="json"),
            search=None
            if self.search is None
            else {
                **self.search.model_dump(mode="json", exclude={"runs", "spaces", "concurrency"}),
                "space": self.space.model_dump(mode="json") if self.space else None,
            },
            workers=self.workers,
            data=self.data,
            vectors_bytes=self.vectors_bytes,
            code=self.code,
        )

    @property
    def name(self) -> str:
        return self.identity().name

    @property
    def dvc_stage(self) -> str:
        """The DVC stage that runs it (``train@<key>``, ``train_tuned@<key>``, ``tune@<key>``)."""
        tuned = self.stage == "train" and self.tuned_from is not None
        return f"{'train_tuned' if tuned else self.stage}@{self.key}"

    @property
    def restart(self) -> str:
        """What starts this run over, its checkpoints discarded."""
        folder = f"{self.storage.rstrip('/')}/{self.name}"
        remove = f"delete {folder}" if "://" in folder else f"rm -r {folder}"
        return f"{remove} && dvc repro {self.dvc_stage}"

    def for_seed(self, index: int) -> RunPlan:
        """This run's plan for seed ``index`` (seed ``seed + 1000 index``)."""
        seed = self.seeds[index]
        return self.model_copy(
            update={"knobs": self.knobs.model_copy(update={"seed": seed}), "seed_index": index}
        )


def plan_training(request: RunRequest, root: str | Path) -> RunPlan:
    """The plan of seed 0 of a train stage's run: the tune result merged for a tuned run,
    the model config validated at the data's sizes; ``ConfigError``/``DataError`` before
    any compute."""
    layout = Layout(Path(root).resolve())
    knobs, tuned_from = request.knobs, None
    if request.tuned:
        tuned_from = TuneRecord.read(layout.tune_out(request.key) / BEST_FILE)
        knobs = tuned_knobs(knobs, tuned_from.config, tuned_from.optimizer)
    return _plan("train", request, layout, knobs, tuned_from)


def plan_search(request: RunRequest, root: str | Path) -> RunPlan:
    """The plan of a tune stage's search (its base knobs; each trial samples the rest)."""
    if request.search is None or request.space is None:
        raise ConfigError("tune.runs", f"{request.key} is not a tuned run: add it to tune.runs")
    return _plan("tune", request, Layout(Path(root).resolve()), request.knobs, None)


def _plan(
    stage: Literal["train", "tune"],
    request: RunRequest,
    layout: Layout,
    knobs: RunParams,
    tuned_from: TuneRecord | None,
) -> RunPlan:
    record = TokenizeRecord.read(layout.shards(request.corpus) / MANIFEST_FILE)
    sizes = record.data_sizes()
    try:
        config = registry.make_config(request.model, sizes, **knobs.model)
    except ConfigError as err:
        where = f"train.models.{request.model}.model"
        raise err.under(where, replacing=request.model) from None
    vectors = _vectors_file(knobs, layout, request.model) if stage == "train" else None
    return RunPlan(
        stage=stage,
        key=request.key,
        model=request.model,
        corpus=request.corpus,
        variant=request.variant,
        task=registry.spec(request.model).task,
        knobs=knobs,
        config=config,
        sizes=sizes,
        corpus_params=request.corpus_params,
        workers=request.workers,
        placement=request.placement,
        tracking=request.tracking,
        root=layout.root,
        storage=storage_path(request.placement, layout.root),
        data=record.fingerprint() + draws_key(record) + stream_key(request.corpus_params.lm),
        code=code_fingerprint(layout.root, stage_code(stage)),
        word_vectors=vectors,
        vectors_bytes=vectors.stat().st_size if vectors is not None else None,
        tuned_from=tuned_from,
        space=request.space,
        search=request.search,
        sources=request.sources,
    )


def _vectors_file(knobs: RunParams, layout: Layout, model: str) -> Path | None:
    """The run's ``word_vectors`` file (a relative path is from the project root)."""
    if knobs.word_vectors is None:
        return None
    path = layout.root / knobs.word_vectors  # an absolute path stays itself
    if not path.is_file():  # the params check says so first, for paths from the working folder
        raise ConfigError(f"train.models.{model}.word_vectors", f"no such file {path}")
    return path
