"""A run plan's :class:`~pipeline.train.loop.TrainJob`: the model and data factories.

They are small picklable values (names, a typed config, paths, numbers): Ray ships them to
workers, which build the model through the registry and open their slice of the Arrow
shards themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import nn

from pipeline.artifacts import DataSizes
from pipeline.config import RunParams, Selection
from pipeline.data.batch import Batch
from pipeline.data.loader import BatchLoader, open_split
from pipeline.data.splits import Split
from pipeline.data.streams import LMFeed
from pipeline.errors import ConfigError
from pipeline.eval.validation_score import MultiWozValidationScore, RankingValidationScore
from pipeline.models import registry
from pipeline.models.base import ModelConfig
from pipeline.models.word_vectors import WordVectors, copy_into, token_embeddings
from pipeline.names import Task
from pipeline.plan import RunPlan
from pipeline.train.context import MetricSink
from pipeline.train.loop import TrainJob


@dataclass(frozen=True)
class RegistryModel:
    """Builds registered model ``name`` from its validated config.

    ``word_vectors`` (a fresh run's, read once by the driver: ``training.read_vectors``)
    are copied into the model's token embeddings right after it is built, so the first
    step starts from them; a resumed run's checkpoint then overwrites every weight anyway."""

    name: str
    config: ModelConfig
    word_vectors: WordVectors | None = field(default=None, compare=False, repr=False)

    def __call__(self) -> nn.Module:
        model = registry.build_from_config(self.name, self.config)
        if self.word_vectors is not None:
            for embedding in token_embeddings(model):
                copy_into(embedding, self.word_vectors)
        return model


@dataclass(frozen=True)
class ConfiguredModel:
    """``(name, trial knobs) -> RegistryModel`` for a tune trial: the sampled config
    validated at the corpus's ``sizes`` (a ``ConfigError`` for an invalid combination)."""

    sizes: DataSizes

    def __call__(self, name: str, params: RunParams) -> RegistryModel:
        try:
            config = registry.make_config(name, self.sizes, **params.model)
        except ConfigError as err:
            raise err.under(f"tune.spaces.{name}.model", replacing=name) from None
        return RegistryModel(name, config)


class ShardBatches:
    """A ``BatchLoader`` as the loop's ``EpochData``: skipping consumed batches costs no
    collation (the epoch's plan is a list of example indices)."""

    def __init__(self, loader: BatchLoader) -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def iter_from(self, start: int) -> Iterator[Batch]:
        dataset = self.loader.dataset
        for indices in self.loader.batches()[start:]:
            yield self.loader.collate([dataset[i] for i in indices])


@dataclass(frozen=True)
class ShardData:
    """Each rank's train and valid batches from the shards of one corpus and task.

    ``batch_size`` is global (examples per optimizer step over all ranks); each rank takes
    ``batch_size // world_size`` (the params check requires that it divides). With
    ``batch_tokens`` (global too) the training batches are planned by tokens instead, each
    rank's batch within ``batch_tokens // world_size`` padded tokens. ``feed``: how a
    language model reads its splits (its unit, the run's ``lm`` params: stream segments,
    streamed validation, ``data.streams``); a batch is then ``batch_size`` windows.
    """

    root: str
    task: Task
    batch_size: int
    eval_batch_size: int
    seed: int
    batch_tokens: int | None = None
    feed: LMFeed | None = None

    def __call__(self, rank: int, world_size: int) -> tuple[ShardBatches, ShardBatches]:
        if self.batch_size % world_size:
            raise ValueError(f"batch_size {self.batch_size} does not divide by {world_size}")
        tokens = None
        if self.batch_tokens is not None:
            tokens = self.batch_tokens // world_size
            if tokens < 1:
                raise ValueError(f"batch_tokens {self.batch_tokens} is < {world_size} workers")
        train = BatchLoader(
            open_split(self.root, self.task, Split.TRAIN, self.feed),
            self.batch_size // world_size,
            seed=self.seed,
            rank=rank,
            world_size=world_size,
            batch_tokens=tokens,
        )
        return ShardBatches(train), self.valid(rank, world_size, self.eval_batch_size)

    def valid(self, rank: int, world_size: int, batch_size: int) -> ShardBatches:
        """The valid split's batches for ``rank``, ``batch_size`` (global) examples each,
        in file order grouped by length."""
        return ShardBatches(
            BatchLoader(
                open_split(self.root, self.task, Split.VALID, self.feed),
                max(1, batch_size // world_size),
                shuffle=False,
                seed=self.seed,
                rank=rank,
                world_size=world_size,
            )
        )


def shard_data(plan: RunPlan, knobs: RunParams | None = None) -> ShardData:
    """The plan's data factory (``knobs``: a trial's, when they differ from the plan's)."""
    knobs = knobs or plan.knobs
    builder = registry.spec(plan.model).builder
    unit = getattr(builder, "stream_unit", None) if plan.task is Task.LM else None
    return ShardData(
        root=str(plan.shards),
        task=plan.task,
        batch_size=knobs.batch_size,
        eval_batch_size=knobs.validation_batch_size,
        seed=knobs.seed,
        batch_tokens=knobs.batch_tokens,
        feed=None if unit is None else LMFeed(unit, plan.corpus_params.lm),
    )


def validation_score(plan: RunPlan) -> MultiWozValidationScore | RankingValidationScore | None:
    """The score a run selects on (``select_by``); None when it is the loss."""
    knobs = plan.knobs
    if knobs.select_by is Selection.MRR:
        return RankingValidationScore(shards=str(plan.shards))
    if knobs.select_by is not Selection.MULTIWOZ_SCORE:
        return None
    return MultiWozValidationScore(
        shards=str(plan.shards),
        raw=str(plan.raw),
        corpus=plan.corpus,
        corpus_params=plan.corpus_params,
    )


def train_job(
    plan: RunPlan,
    sink: Callable[[], MetricSink | None] | None,
    show_progress: bool,
    vectors: WordVectors | None = None,
) -> TrainJob:
    """The loop's job of a plan, its metrics going to ``sink``."""
    return TrainJob(
        name=plan.name,
        model_name=plan.model,
        model=RegistryModel(plan.model, plan.config, vectors),
        data=shard_data(plan),
        params=plan.knobs,
        run_dir=plan.storage,
        sink=sink,
        show_progress=show_progress,
        label=plan.label,
        validation_score=validation_score(plan),
        restart=plan.restart,
        knob_sources=plan.sources,
    )
