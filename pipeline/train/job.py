"""The production model and data factories of a :class:`~pipeline.train.loop.TrainJob`.

They are small picklable values (names, paths, numbers): Ray ships them to workers, which
build the model through the registry and open their slice of the Arrow shards themselves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from pipeline.artifacts import MANIFEST_FILE, TokenizeRecord
from pipeline.config import CorpusParams, RunParams, Selection
from pipeline.data.batch import Batch
from pipeline.data.loader import BatchLoader, open_split
from pipeline.data.resample import draws_key
from pipeline.data.splits import Split
from pipeline.errors import ConfigError
from pipeline.eval.validation_score import MultiWozValidationScore
from pipeline.models import registry
from pipeline.models.base import DataSizes, ModelConfig, token_embeddings
from pipeline.models.word_vectors import WordVectors, copy_into


@dataclass(frozen=True)
class RegistryModel:
    """Builds registered model ``name`` from a validated config dict (``model_dump``).

    ``word_vectors`` (a fresh run's, read once by the driver: ``run.train_run``) are
    copied into the model's token embeddings right after it is built, so the first step
    starts from them; a resumed run's checkpoint then overwrites every weight anyway."""

    name: str
    config: dict[str, Any]
    word_vectors: WordVectors | None = field(default=None, compare=False, repr=False)

    def __call__(self) -> nn.Module:
        cfg = registry.spec(self.name).config_cls.model_validate(self.config)
        model = registry.build_from_config(self.name, cfg)
        if self.word_vectors is not None:
            for embedding in token_embeddings(model):
                copy_into(embedding, self.word_vectors)
        return model


def model_config(
    name: str, sizes: DataSizes, overrides: dict[str, Any], key: str = "train"
) -> ModelConfig:
    """The validated config of model ``name`` for data of ``sizes``; a bad override raises
    a ``ConfigError`` naming ``<key>.model.<field>`` (``key``: where overrides came from)."""
    try:
        return registry.make_config(name, sizes, **overrides)
    except ConfigError as err:
        field_name = err.key.removeprefix(f"{name}.")
        raise ConfigError(f"{key}.model.{field_name}", err.reason) from None


@dataclass(frozen=True)
class ConfiguredModel:
    """``(name, params) -> RegistryModel`` with ``params.model`` validated for a corpus of
    ``sizes`` (a ``ConfigError`` for an invalid combination)."""

    sizes: DataSizes
    key: str = "train"

    def __call__(self, name: str, params: RunParams) -> RegistryModel:
        config = model_config(name, self.sizes, params.model, self.key)
        return RegistryModel(name, config.model_dump(mode="json"))


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
            yield dataset.collate([dataset[i] for i in indices])


@dataclass(frozen=True)
class ShardData:
    """Each rank's train and valid batches from the shards of one corpus and task.

    ``batch_size`` is global (examples per optimizer step over all ranks); each rank takes
    ``batch_size // world_size``.
    """

    root: str
    task: str
    batch_size: int
    eval_batch_size: int
    seed: int

    def __call__(self, rank: int, world_size: int) -> tuple[ShardBatches, ShardBatches]:
        per_rank = per_rank_batch(self.batch_size, world_size, "batch_size")
        eval_per_rank = max(1, self.eval_batch_size // world_size)
        train = BatchLoader(
            open_split(self.root, self.task, Split.TRAIN),
            per_rank,
            shuffle=True,
            seed=self.seed,
            rank=rank,
            world_size=world_size,
        )
        valid = BatchLoader(
            open_split(self.root, self.task, Split.VALID),
            eval_per_rank,
            shuffle=False,
            seed=self.seed,
            rank=rank,
            world_size=world_size,
        )
        return ShardBatches(train), ShardBatches(valid)


def per_rank_batch(batch_size: int, world_size: int, key: str) -> int:
    """``batch_size / world_size``; a ``ConfigError`` if it does not divide."""
    if batch_size % world_size:
        raise ConfigError(
            f"train.{key}",
            f"{batch_size} is global (all workers together) and must divide by "
            f"train.scale.num_workers={world_size}",
        )
    return batch_size // world_size


def validation_score(
    params: RunParams, shards: Path, raw: Path, corpus: str, corpus_params: CorpusParams
) -> MultiWozValidationScore | None:
    """The score a run selects on (``params.select_by``); None when it is the loss."""
    if params.select_by != Selection.MULTIWOZ_SCORE:
        return None
    return MultiWozValidationScore(
        shards=str(shards.resolve()),
        raw=str(raw.resolve()),
        corpus=corpus,
        corpus_params=corpus_params,
        batch_size=params.eval_batch_size or params.batch_size,
        max_batches=params.max_eval_batches or params.max_batches_per_epoch,
    )


def shard_data(root: Path, task: str, params: RunParams) -> ShardData:
    return ShardData(
        root=str(root.resolve()),
        task=task,
        batch_size=params.batch_size,
        eval_batch_size=params.eval_batch_size or params.batch_size,
        seed=params.seed,
    )


def data_fingerprint(root: Path) -> str:
    """What identifies a tokenized corpus folder's data (``TokenizeRecord.fingerprint``,
    plus the per-epoch draws' params when they are on: they change the training batches,
    not the shards); ``none`` for a folder not tokenized yet."""
    if not (root / MANIFEST_FILE).is_file():
        return "none"
    record = TokenizeRecord.read(root / MANIFEST_FILE)
    return record.fingerprint() + draws_key(record)


def params_hash(*parts: Any) -> str:
    """A short stable hash of JSON-able values (run names: a change starts a fresh run)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def run_name(stage: str, model: str, corpus: str, *hashed: Any) -> str:
    """``<stage>-<model>-<corpus>-<hash of hashed>``: the same params resume the same run,
    changed ones start a fresh one."""
    return f"{stage}-{model}-{corpus}-{params_hash(*hashed)}"
