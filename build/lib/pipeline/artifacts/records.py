"""The typed records stages write for each other (JSON, versioned), and their readers.

==============================================  ============================  ==========
file                                            record                        written by
==============================================  ============================  ==========
``data/sources/<corpus>.json``                  :class:`SourceDeclaration`    check
``data/raw/<corpus>/SOURCES.json``              :class:`DownloadRecord`       download
``data/shards/<corpus>/manifest.json``          :class:`TokenizeRecord`       tokenize
``data/tune/<key>/best.json``                   :class:`TuneRecord`           tune
``data/train/<key>/manifest.json``              :class:`TrainRecord`          train
``data/eval/<key>/seeds.json``                  :class:`EvalRecord`           evaluate
``data/eval/<key>/per_example.jsonl``           :class:`ExampleResult` lines  evaluate
``metrics/<key>.json``                          flat ``{metric: value}``      evaluate
==============================================  ============================  ==========

``<key>`` is ``<model>-<corpus>`` (``config.run_key``). Each JSON record carries
``schema_version``; a reader refuses any other version (rerun the stage that wrote it).
``metrics/<key>.json`` stays a flat mapping because that is DVC's metrics format
(``dvc metrics show``, ``dvc exp show``); it lives outside the git-ignored ``data/`` so git
holds it. Non-finite floats are written as JSON ``null`` (JSON has no NaN).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    computed_field,
    model_validator,
)

from pipeline.artifacts.layout import MANIFEST_FILE, Layout
from pipeline.config import CorpusParams, CorpusSource, PlacementParams, Precision
from pipeline.errors import DataError
from pipeline.names import OnError, Task

# --------------------------------------------------------------------------- records


def _json_safe(value: Any) -> Any:
    """NaN and inf are not JSON: written as ``null``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _atomic_write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_json(path: Path, content: Any) -> Path:
    """Write a JSON value atomically (temp file + rename), non-finite floats as null."""
    return _atomic_write_text(
        path, json.dumps(_json_safe(content), indent=2, sort_keys=True) + "\n"
    )


def read_json(path: Path, missing: str) -> Any:
    """A JSON file's value; ``missing`` says what to do when the file is absent."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(path, missing) from None
    except json.JSONDecodeError as err:
        raise DataError(path, f"not valid JSON ({err.msg})", err.lineno) from None


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "record"
    return f"{where}: {first['msg']}"


class Record(BaseModel):
    """A JSON file one stage writes for others: frozen, unknown fields rejected, versioned.

    Subclasses set ``WRITTEN_BY`` (the stage to rerun when the file is stale) and bump
    ``SCHEMA_VERSION`` whenever a field changes meaning or goes away.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    SCHEMA_VERSION: ClassVar[int] = 1
    WRITTEN_BY: ClassVar[str] = ""

    schema_version: int = 1

    @model_validator(mode="after")
    def _known_version(self) -> Self:
        if self.schema_version != self.SCHEMA_VERSION:
            raise ValueError(f"schema version {self.schema_version} is not {self.SCHEMA_VERSION}")
        return self

    @classmethod
    def read(cls, path: Path) -> Self:
        """The record in ``path``; a ``DataError`` naming the file if it is missing, not
        JSON, of another schema version or lacks a field."""
        rerun = f"run the {cls.WRITTEN_BY} stage (dvc repro)"
        raw = read_json(path, f"missing: {rerun}")
        if not isinstance(raw, dict):
            raise DataError(path, f"not a {cls.__name__} (expected a JSON object)")
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise DataError(
                path, f"not a valid {cls.__name__} ({_first_error(err)}); {rerun} again"
            ) from None

    def write(self, path: Path) -> Path:
        """Write atomically: a reader sees the previous file or this one, never half."""
        return write_json(path, self.model_dump(mode="json"))


class SourceDeclaration(Record):
    """Where corpus ``corpus`` comes from (``data/sources/<corpus>.json``): its declared
    source (None: a built-in corpus, whose spec knows its files). The check stage writes
    one per corpus of ``corpora:``; the corpus's download stage depends on it, so changing
    a declaration re-runs that corpus's download and nothing else."""

    WRITTEN_BY: ClassVar[str] = "check"

    corpus: str
    source: CorpusSource | None = None


class VerifiedFile(BaseModel):
    """A downloaded file: where from, its verified sha256 and size, whether that digest
    was pinned in the corpus spec (else trusted on first use), what extracting it made."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str
    sha256: str
    bytes: int
    pinned: bool
    extracted: list[str] = []


class DownloadRecord(Record):
    """What a download run verified (``data/raw/<corpus>/SOURCES.json``), by path in the
    corpus folder; rewritten after each file so an interrupted run keeps what it checked.
    ``package``: the PyPI distribution a bundled corpus came from; ``declared``: the source
    of a corpus declared in params (its format and files), so that ``read_corpus`` reads the
    folder without the params; ``split_files``: which file holds which split."""

    WRITTEN_BY: ClassVar[str] = "download"

    corpus: str
    package: str | None = None
    files: dict[str, VerifiedFile] = {}
    declared: CorpusSource | None = None
    split_files: dict[str, str] = {}


class ShardFile(BaseModel):
    """One Arrow shard, relative to the corpus folder, with what verifies it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str
    rows: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class DataSizes:
    """The sizes a model takes from its corpus, never from params or constants: the
    vocabulary and, for corpora with dialogue acts, the act inventory (the tokenize
    record's ``data_sizes()``; ``registry.make_config`` fills a config's ``DATA_FIELDS``
    from them)."""

    vocab_size: int
    n_acts: int | None = None


class TokenizeSettings(BaseModel):
    """The params a tokenized folder was built with: typed, so a renamed section fails
    when the record is read rather than changing what readers find."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    on_error: OnError
    shard_rows: int
    corpus: CorpusParams


class TokenizeRecord(Record):
    """What a tokenize run wrote (``data/shards/<corpus>/manifest.json``), written last: a
    folder without one is incomplete.

    ``shards[task][split]`` lists a split's files, ``pools[split]`` its select candidate
    pool; ``vocab_words`` the vocabulary's word types (``<unk>`` and ``<eos>`` included,
    the model-only specials ``<pad> <bos> <sep>`` not: Mikolov's PTB gives 10,000);
    ``target_tokens[task][split]`` the tokens a model is scored on (``ExampleTable.
    scored_tokens``: what a perplexity averages over); ``n_acts``/``act_names`` the act
    inventory (MultiWOZ) the act vectors index;
    ``skipped`` counts what was left out (``skipped_by_reason`` the malformed records by
    what was wrong with them); ``sources`` the download record of the raw
    files (None for a corpus read without a download); ``params`` the settings the
    examples were built with.
    """

    WRITTEN_BY: ClassVar[str] = "tokenize"
    SCHEMA_VERSION: ClassVar[int] = 2  # 1: no vocab_words, no target_tokens
    schema_version: int = 2

    corpus: str
    vocab_hash: str
    vocab_size: int
    vocab_words: int
    shards: dict[str, dict[str, list[ShardFile]]]
    target_tokens: dict[str, dict[str, int]]
    pools: dict[str, ShardFile] = {}
    n_acts: int | None = None
    act_names: list[str] | None = None
    skipped: dict[str, int] = {}
    skipped_by_reason: dict[str, int] = {}
    warnings: list[str] = []
    sources: DownloadRecord | None = None
    params: TokenizeSettings | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_counts(cls, raw: Any) -> Any:
        # ``counts`` is derived from ``shards`` and written only for readers' eyes
        if isinstance(raw, dict) and "counts" in raw:
            raw = {k: v for k, v in raw.items() if k != "counts"}
        return raw

    def rows(self, task: str, split: str) -> int:
        """Examples of one task and split (0 when there are none)."""
        return sum(s.rows for s in self.shards.get(str(task), {}).get(str(split), []))

    @computed_field  # type: ignore[prop-decorator]
    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """``{task: {split: rows}}``."""
        return {t: {s: self.rows(t, s) for s in splits} for t, splits in self.shards.items()}

    def fingerprint(self) -> str:
        """A hash of the vocabulary and every shard's bytes: equal fingerprints, equal data
        (run names include it, so a re-tokenized corpus starts fresh runs)."""
        files = [f.sha256 for splits in self.shards.values() for fs in splits.values() for f in fs]
        files += [p.sha256 for p in self.pools.values()]
        return hashlib.sha256(" ".join([self.vocab_hash, *sorted(files)]).encode()).hexdigest()

    def data_sizes(self) -> DataSizes:
        """The sizes a model built for this corpus takes from its data."""
        return DataSizes(vocab_size=self.vocab_size, n_acts=self.n_acts)


class TuneRecord(Record):
    """The best trial of a search (``data/tune/<key>/best.json``): the model and optimizer
    values a tuned run trains with, and how the search went."""

    WRITTEN_BY: ClassVar[str] = "tune"

    model: str
    corpus: str
    search: str
    config: dict[str, Any]
    optimizer: dict[str, Any]
    valid_loss: float
    trial_id: str
    trials: int
    errored_trials: int
    valid_score: float | None = None  # the best trial's, when it was selected on a score
    parent_run_id: str | None = None


class MlflowRef(BaseModel):
    """Where a trained seed is recorded in MLflow (``tracking_uri`` project-relative when
    the store is inside the project: ``tracking.portable_uri``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tracking_uri: str
    experiment: str
    run_id: str
    fallback: bool = False
    checkpoint_uri: str
    registered_model: str | None = None
    model_version: str | None = None


WALL_SECONDS = "wall_s"  # train metric of a seed: seconds its training took


class TrainedSeed(BaseModel):
    """One trained model of a run: the exported weights, its Ray run and train metrics."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int
    run_name: str
    checkpoint: str
    run_checkpoint: str
    metrics: dict[str, float | None]
    tuned_from: TuneRecord | None = None
    mlflow: MlflowRef | None = None
    stop_reason: str | None = Field(
        default=None, description="what ended training: epochs, max_steps or early_stopping"
    )
    averaged_steps: int | None = Field(
        default=None,
        description="the optimizer steps its weight average covers (train.averaging); None: "
        "no averaging configured, 0: averaging never began (the run stopped before it)",
    )

    @property
    def averaging_never_began(self) -> bool:
        """Averaging was configured, and the run stopped before its first averaged step:
        its weights are the live ones."""
        return self.averaged_steps == 0

    def metric(self, name: str) -> float:
        """A train metric (NaN when absent or written as null)."""
        value = self.metrics.get(name)
        return math.nan if value is None else float(value)


class TrainRecord(Record):
    """What a train run wrote (``data/train/<key>/manifest.json``): one entry per seed."""

    WRITTEN_BY: ClassVar[str] = "train"
    SCHEMA_VERSION: ClassVar[int] = 2  # 1: the first seed's fields at the top level
    schema_version: int = 2

    model: str
    corpus: str
    task: Task
    seeds: list[TrainedSeed]
    workers: int = Field(default=0, description="Ray Train workers per seed; 0: in-process")
    placement: PlacementParams | None = Field(
        default=None, description="where the workers ran (CPUs/GPUs each): evaluate asks the same"
    )
    machine: str | None = Field(default=None, description="pipeline.machine.describe()")
    commit: str | None = Field(default=None, description="pipeline.machine.code_version()")
    precision: Precision = Field(
        default=Precision.AUTO,
        description="train.*.precision of the run: evaluate autocasts as it trained",
    )

    @model_validator(mode="after")
    def _has_seeds(self) -> Self:
        if not self.seeds:
            raise ValueError("seeds: at least one trained seed")
        return self


def read_train(layout: Layout, key: str) -> TrainRecord:
    """Run ``key``'s train record; the error lists the runs that have one."""
    path = layout.train_out(key) / MANIFEST_FILE
    if not path.is_file():
        runs = ", ".join(layout.trained_runs()) or "none"
        raise DataError(
            path,
            f"no trained run {key!r} (runs trained: {runs}); "
            f"run the train stage first: dvc repro train@{key}",
        )
    return TrainRecord.read(path)


class SeedMetrics(BaseModel):
    """One seed's test metrics."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int
    checkpoint: str
    metrics: dict[str, float | None]


class EvalRecord(Record):
    """Every seed's test metrics (``data/eval/<key>/seeds.json``)."""

    WRITTEN_BY: ClassVar[str] = "evaluate"

    model: str
    corpus: str
    seeds: list[SeedMetrics]
    wall_s: float | None = Field(default=None, description="seconds for every seed's evaluation")


class ExampleResult(BaseModel):
    """One test example scored by one seed (a line of ``per_example.jsonl``): what paired
    bootstraps and length analyses need. ``nll_sum`` over ``n_tokens`` target tokens;
    generate: ``reference`` and ``hypotheses`` by decoding label (``greedy``, ``beam5``,
    ...); select: the 1-based ``rank`` of the true response."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int
    id: str
    nll_sum: float
    n_tokens: int
    history_tokens: int
    reference: str | None = None
    hypotheses: dict[str, str] = {}
    rank: int | None = None

    @property
    def loss(self) -> float:
        """Mean token NLL of this example (nats)."""
        return self.nll_sum / self.n_tokens if self.n_tokens else math.nan


def write_examples(path: Path, rows: Iterable[ExampleResult]) -> Path:
    """Write ``per_example.jsonl`` atomically."""
    lines = (json.dumps(_json_safe(r.model_dump(mode="json"))) + "\n" for r in rows)
    return _atomic_write_text(path, "".join(lines))


def read_examples(path: Path) -> tuple[ExampleResult, ...]:
    """The rows of a ``per_example.jsonl``; a bad row is a ``DataError`` naming its line."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise DataError(path, "missing; run the evaluate stage (dvc repro)") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(ExampleResult.model_validate(json.loads(line)))
        except json.JSONDecodeError as err:
            raise DataError(path, f"not valid JSON ({err.msg})", number) from None
        except ValidationError as err:
            raise DataError(path, f"bad row ({_first_error(err)})", number) from None
    if not rows:
        raise DataError(path, "no examples")
    return tuple(rows)


def write_metrics(path: Path, metrics: Mapping[str, float]) -> Path:
    """Write a flat ``{metric: value}`` (DVC's metrics format)."""
    return write_json(path, dict(metrics))


def read_metrics(path: Path) -> dict[str, float]:
    """A flat metrics file; ``null`` (a non-finite value) reads as NaN."""
    raw = read_json(path, "missing; run the evaluate stage (dvc repro)")
    if not isinstance(raw, dict):
        raise DataError(path, "expected a JSON object of metrics")
    bad = sorted(k for k, v in raw.items() if v is not None and not isinstance(v, int | float))
    if bad:
        raise DataError(path, f"metrics must be numbers; {bad} are not")
    return {k: math.nan if v is None else float(v) for k, v in raw.items()}
