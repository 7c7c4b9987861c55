"""Typed, validated parameters: ``params.yaml`` -> frozen pydantic models, one per stage.

Every model forbids unknown keys, so a typo fails before any work, and errors name the
dotted key (``tokenize.generate.max_history: Input should be greater than 0``). Names and
cross-references (models, corpora, config fields) are checked by ``pipeline.params_check``,
which ``parse_params`` runs too.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.errors import ConfigError


class Section(BaseModel):
    """Base of every params section: frozen, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class CorpusName(enum.StrEnum):
    CHITCHAT = "chitchat"
    PTB = "ptb"
    PERSONACHAT = "personachat"
    MULTIWOZ = "multiwoz"
    MULTIWOZ21 = "multiwoz21"
    CORNELL = "cornell"
    DSTC7 = "dstc7"


class OnError(enum.StrEnum):
    RAISE = "raise"
    SKIP = "skip"


# --------------------------------------------------------------------------- data


class DownloadParams(Section):
    """``download``: where corpora come from."""

    mirror: str | None = Field(
        default=None,
        description="A directory or file:// URL standing in for the internet: a URL's "
        "file name is looked up there (tests and offline users).",
    )
    retries: int = Field(default=4, ge=0, le=20)
    timeout_s: float = Field(default=60.0, gt=0)


class SplitParams(Section):
    """Seeded split by dialogue for corpora without an official one."""

    seed: int = 13
    valid: float = Field(default=0.1, ge=0, lt=1)
    test: float = Field(default=0.1, ge=0, lt=1)

    @model_validator(mode="after")
    def _fractions(self) -> SplitParams:
        if self.valid + self.test >= 1:
            raise ValueError("valid + test must leave a training split (sum < 1)")
        return self


class VocabParams(Section):
    kind: Literal["word", "bpe"] = "word"
    size: int = Field(default=20000, ge=16)
    min_freq: int = Field(default=1, ge=1)
    lowercase: bool = True


class GenerateParams(Section):
    max_history: int = Field(default=150, gt=0, description="most recent history tokens kept")
    max_utterances: int = Field(default=10, gt=0)
    max_response: int = Field(default=30, gt=0)
    delexicalize: bool = Field(default=False, description="MultiWOZ: replace slot values")


class SelectParams(Section):
    n_candidates_train: int = Field(default=10, ge=2, description="1 positive + negatives")
    n_candidates_eval: int = Field(default=100, ge=2)
    max_candidate: int = Field(default=30, gt=0)


class LMParams(Section):
    sentences_per_document: int = Field(default=10, gt=0)
    max_sentence: int = Field(default=50, gt=0)


class Task(enum.StrEnum):
    GENERATE = "generate"
    SELECT = "select"
    LM = "lm"


class CorpusParams(Section):
    """How one corpus is turned into examples."""

    tasks: tuple[Task, ...] = (Task.GENERATE,)
    vocab: VocabParams = VocabParams()
    split: SplitParams = SplitParams()
    generate: GenerateParams = GenerateParams()
    select: SelectParams = SelectParams()
    lm: LMParams = LMParams()
    max_dialogues: int | None = Field(
        default=None, gt=0, description="keep only the first N dialogues per split (tiny runs)"
    )

    @model_validator(mode="after")
    def _tasks(self) -> CorpusParams:
        if not self.tasks:
            raise ValueError("tasks: name at least one of generate, select, lm")
        return self


class TokenizeParams(Section):
    """``tokenize``: examples and shards."""

    on_error: OnError = OnError.RAISE
    shard_rows: int = Field(default=50_000, gt=0)
    corpora: dict[CorpusName, CorpusParams] = Field(default_factory=dict)


# --------------------------------------------------------------------------- train


class OptimizerKind(enum.StrEnum):
    ADAM = "adam"
    ADAMW = "adamw"


class OptimizerParams(Section):
    """Adam or AdamW (decoupled weight decay)."""

    kind: OptimizerKind = OptimizerKind.ADAM
    lr: float = Field(default=1e-4, gt=0, description="peak learning rate")
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = Field(default=1e-9, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("each beta must lie in [0, 1)")
        return betas


class ScheduleKind(enum.StrEnum):
    NONE = "none"
    LINEAR_WARMUP = "linear_warmup"
    NOAM = "noam"


class ScheduleParams(Section):
    """Learning-rate schedule: constant; linear warm-up to ``lr`` then constant; or Noam
    (warm-up then inverse square root decay), scaled so that its peak equals ``lr``."""

    kind: ScheduleKind = ScheduleKind.NONE
    warmup_steps: int = Field(default=1000, gt=0)


class Precision(enum.StrEnum):
    AUTO = "auto"  # bf16 autocast on GPU, fp32 on CPU
    FP32 = "fp32"
    BF16 = "bf16"


class RunParams(Section):
    """The knobs of one training run. ``train.defaults`` holds them all; ``train.models.<m>``
    and ``train.runs.<run>.overrides`` hold only the keys they change (merged in that order
    by ``TrainParams.run``)."""

    seed: int = Field(default=1234, ge=0, description="base seed; worker r uses seed + r")
    batch_size: int = Field(
        default=32, gt=0, description="global: examples per optimizer step over all workers"
    )
    eval_batch_size: int | None = Field(default=None, gt=0, description="default: batch_size")
    epochs: int = Field(default=30, gt=0)
    max_steps: int | None = Field(default=None, gt=0, description="stop after this many steps")
    max_batches_per_epoch: int | None = Field(
        default=None, gt=0, description="tiny runs: cut every epoch (train and valid) short"
    )
    eval_every: int | None = Field(
        default=None, gt=0, description="also evaluate every N steps (always at epoch end)"
    )
    max_eval_batches: int | None = Field(
        default=None,
        gt=0,
        description="validation batches per evaluation (the first N of the valid split); "
        "null = max_batches_per_epoch, or the whole split",
    )
    patience: int | None = Field(
        default=5, gt=0, description="evaluations without improvement before stopping"
    )
    min_delta: float = Field(default=0.0, ge=0, description="smallest improvement that counts")
    clip_norm: float | None = Field(default=1.0, gt=0, description="max gradient norm")
    optimizer: OptimizerParams = OptimizerParams()
    schedule: ScheduleParams = ScheduleParams()
    precision: Precision = Precision.AUTO
    checkpoint_every: int | None = Field(
        default=None, gt=0, description="also checkpoint every N steps (always at epoch end)"
    )
    log_every: int = Field(default=10, gt=0, description="steps between logged train metrics")
    seeds: int = Field(
        default=1,
        ge=1,
        le=100,
        description="models trained per run, seed i with seed + 1000 * i (mean +- CI)",
    )
    model: dict[str, Any] = Field(
        default_factory=dict, description="model config overrides (fields of its config)"
    )


def merge_params(base: Section, override: Section) -> Section:
    """``base`` updated with the fields ``override`` was given explicitly (its
    ``model_fields_set``): nested sections merge recursively, mappings are updated."""
    update: dict[str, Any] = {}
    for name in override.model_fields_set:
        new, old = getattr(override, name), getattr(base, name)
        if isinstance(new, Section) and isinstance(old, Section):
            new = merge_params(old, new)
        elif isinstance(new, dict) and isinstance(old, dict):
            new = {**old, **new}
        update[name] = new
    return type(base).model_validate({**base.model_dump(), **update})


class RunTarget(Section):
    """One model trained (or tuned) on one corpus; its key in ``runs`` is
    ``<model>-<corpus>`` (the DVC stage name suffix and output folder)."""

    model: str = Field(min_length=1)
    corpus: CorpusName
    overrides: RunParams = Field(
        default_factory=RunParams, description="keys of this run that differ (train runs only)"
    )

    @property
    def key(self) -> str:
        return run_key(self.model, self.corpus)


def run_key(model: str, corpus: str) -> str:
    """The name of a (model, corpus) run: ``hier-multiwoz``."""
    return f"{model}-{corpus}"


def _check_run_keys(runs: dict[str, RunTarget], where: str) -> None:
    for key, target in runs.items():
        if key != target.key:
            raise ValueError(f"{where}.{key}: must be named {target.key!r} (<model>-<corpus>)")


class PlacementStrategy(enum.StrEnum):
    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


class ScaleParams(Section):
    """Where training runs: in-process (``num_workers: 0``) or on Ray Train workers."""

    num_workers: int = Field(default=0, ge=0, description="0 = local, in-process, no Ray")
    use_gpu: bool | None = Field(default=None, description="null = use GPUs if present")
    cpus_per_worker: float = Field(default=1.0, gt=0)
    gpus_per_worker: float = Field(default=1.0, gt=0, description="with use_gpu only")
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    max_failures: int = Field(
        default=0, ge=-1, description="worker-group restarts from the last checkpoint (-1: always)"
    )
    storage_path: str | None = Field(
        default=None,
        description="runs and checkpoints: an absolute path or URI shared by every node "
        "(multi-node); default <project>/runs/ray, or $HIERTX_STORAGE_PATH",
    )


class TrainParams(Section):
    """``train``: defaults, per-model and per-run overrides, runs, and scaling."""

    defaults: RunParams = RunParams()
    models: dict[str, RunParams] = Field(
        default_factory=dict, description="per model name: the keys that differ from defaults"
    )
    runs: dict[str, RunTarget] = Field(
        default_factory=dict, description="untuned runs `dvc repro` trains (stage train@<key>)"
    )
    scale: ScaleParams = ScaleParams()

    @model_validator(mode="after")
    def _keys(self) -> TrainParams:
        _check_run_keys(self.runs, "runs")
        return self

    def run(self, model: str, corpus: str) -> RunParams:
        """The merged knobs of ``model`` on ``corpus``: defaults < models < run overrides."""
        merged = self.defaults
        if model in self.models:
            merged = merge_params(merged, self.models[model])
        target = self.runs.get(run_key(model, corpus))
        if target is not None:
            merged = merge_params(merged, target.overrides)
        return merged  # type: ignore[return-value]


# --------------------------------------------------------------------------- tune


class SearchKind(enum.StrEnum):
    INT = "int"
    FLOAT = "float"
    LOG_FLOAT = "log_float"
    CHOICE = "choice"


class SearchDim(Section):
    """One searched value: an int/float range (``step`` optional), a log-uniform float
    range, or a choice among ``choices``."""

    kind: SearchKind
    low: float | None = None
    high: float | None = None
    step: float | None = Field(default=None, gt=0)
    choices: tuple[Any, ...] | None = None

    @model_validator(mode="after")
    def _shape(self) -> SearchDim:
        if self.kind == SearchKind.CHOICE:
            if not self.choices:
                raise ValueError("choices: a choice dimension needs a non-empty list")
            return self
        if self.low is None or self.high is None:
            raise ValueError(f"low: a {self.kind.value} dimension needs low and high")
        if self.low > self.high:
            raise ValueError("low: must not exceed high")
        if self.kind == SearchKind.LOG_FLOAT and self.low <= 0:
            raise ValueError("low: a log_float dimension needs low > 0")
        if self.kind == SearchKind.INT and not (
            float(self.low).is_integer() and float(self.high).is_integer()
        ):
            raise ValueError("low: an int dimension needs integer bounds")
        return self


class SearchSpace(Section):
    """What is searched for one model: fields of its config and of the optimizer."""

    model: dict[str, SearchDim] = Field(default_factory=dict)
    optimizer: dict[str, SearchDim] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _fields(self) -> SearchSpace:
        unknown = sorted(set(self.optimizer) - set(OptimizerParams.model_fields))
        if unknown:
            raise ValueError(f"optimizer: {unknown} are not optimizer params")
        if not self.model and not self.optimizer:
            raise ValueError("model: name at least one dimension to search")
        return self


class TuneParams(Section):
    """``tune``: Optuna (TPE) proposes, ASHA stops poor trials early; each trial trains
    ``epochs_per_trial`` epochs with the run's train params."""

    trials: int = Field(default=15, gt=0)
    concurrency: int = Field(default=1, gt=0, description="trials running at once")
    epochs_per_trial: int = Field(default=5, gt=0)
    grace_period: int = Field(default=1, gt=0, description="evaluations before ASHA may stop")
    reduction_factor: int = Field(default=3, ge=2)
    seed: int = Field(default=0, ge=0, description="Optuna sampler seed")
    cpus_per_trial: float = Field(default=1.0, gt=0, description="local-mode trials")
    spaces: dict[str, SearchSpace] = Field(default_factory=dict, description="per model name")
    runs: dict[str, RunTarget] = Field(
        default_factory=dict, description="runs tuned, then trained (stage train_tuned@<key>)"
    )

    @model_validator(mode="after")
    def _runs(self) -> TuneParams:
        _check_run_keys(self.runs, "runs")
        for key, target in self.runs.items():
            if target.model not in self.spaces:
                raise ValueError(f"runs.{key}: tune.spaces has no entry for {target.model!r}")
        return self


# --------------------------------------------------------------------------- tracking


class TrackingParams(Section):
    """``tracking``: what MLflow records (the URI comes from $MLFLOW_TRACKING_URI)."""

    enabled: bool = True
    experiment_prefix: str = Field(default="hiertx", min_length=1)
    log_model: bool = Field(default=True, description="log the final model as a pyfunc")
    register_model: bool = Field(default=True, description="register it as hiertx-<run>")
    sample_generations: int = Field(default=5, ge=0, description="validation samples logged")


# --------------------------------------------------------------------------- evaluate


class DecodeStrategy(enum.StrEnum):
    GREEDY = "greedy"
    BEAM = "beam"
    TOP_K = "top_k"
    NUCLEUS = "nucleus"


class DecodeParams(Section):
    """One decoding of the test histories (fields of ``pipeline.decode.DecodeConfig``;
    ``max_length`` is the corpus' ``generate.max_response``). Its metrics carry
    :attr:`suffix`: none for greedy, ``_beam5`` for a beam of 5, ``_topk10``, ``_topp0.9``."""

    strategy: DecodeStrategy = DecodeStrategy.GREEDY
    beam_size: int = Field(default=5, ge=1)
    length_penalty: float = Field(default=0.0, ge=0)
    min_length: int = Field(default=0, ge=0)
    no_repeat_ngram: int = Field(default=0, ge=0)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    temperature: float = Field(default=1.0, gt=0)
    seed: int = 0

    @property
    def suffix(self) -> str:
        if self.strategy == DecodeStrategy.GREEDY:
            return ""
        if self.strategy == DecodeStrategy.BEAM:
            return f"_beam{self.beam_size}"
        if self.strategy == DecodeStrategy.TOP_K:
            return f"_topk{self.top_k}"
        return f"_topp{self.top_p:g}"


class Word2VecParams(Section):
    """Word vectors of the embedding metrics: ``vectors`` (a word2vec text/binary or GloVe
    file), else a word2vec trained on the corpus' training responses."""

    vectors: str | None = Field(default=None, description="pre-trained vectors file")
    dim: int = Field(default=300, gt=0)
    window: int = Field(default=5, gt=0)
    min_count: int = Field(default=1, gt=0)
    epochs: int = Field(default=5, gt=0)
    seed: int = 0
    max_sentences: int | None = Field(
        default=None, gt=0, description="train on at most this many training responses"
    )


class EvaluateParams(Section):
    """``evaluate``: the test split of every trained seed of a run."""

    batch_size: int = Field(default=32, gt=0)
    max_batches: int | None = Field(
        default=None, gt=0, description="quick runs: only the first N test batches"
    )
    decodes: tuple[DecodeParams, ...] = Field(
        default=(DecodeParams(),), description="generate models: greedy (always) and others"
    )
    models: dict[str, tuple[DecodeParams, ...]] = Field(
        default_factory=dict, description="per model name: decodes replacing `decodes`"
    )
    word2vec: Word2VecParams = Word2VecParams()
    bootstrap_samples: int = Field(
        default=1000, ge=0, description="test-set resamples of the paired bootstrap tests"
    )
    n_samples: int = Field(default=5, ge=0, description="histories shown in samples.md")

    @field_validator("decodes")
    @classmethod
    def _decodes(cls, decodes: tuple[DecodeParams, ...]) -> tuple[DecodeParams, ...]:
        _check_decodes(decodes)
        return decodes

    @field_validator("models")
    @classmethod
    def _model_decodes(
        cls, models: dict[str, tuple[DecodeParams, ...]]
    ) -> dict[str, tuple[DecodeParams, ...]]:
        for name, decodes in models.items():
            try:
                _check_decodes(decodes)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        return models

    def decodes_for(self, model: str) -> tuple[DecodeParams, ...]:
        """The decodings ``model`` is evaluated with."""
        return self.models.get(model, self.decodes)


def _check_decodes(decodes: tuple[DecodeParams, ...]) -> None:
    suffixes = [d.suffix for d in decodes]
    if "" not in suffixes:
        raise ValueError("add {strategy: greedy}: every generate model is decoded greedily")
    if len(set(suffixes)) != len(suffixes):
        raise ValueError(f"two decodings share a metric suffix: {suffixes}")


# --------------------------------------------------------------------------- root


class Params(Section):
    """The whole of ``params.yaml``."""

    corpora: tuple[CorpusName, ...] = Field(
        default=(CorpusName.CHITCHAT,), description="corpora `dvc repro` processes"
    )
    download: DownloadParams = DownloadParams()
    tokenize: TokenizeParams = TokenizeParams()
    train: TrainParams = TrainParams()
    tune: TuneParams = TuneParams()
    tracking: TrackingParams = TrackingParams()
    evaluate: EvaluateParams = EvaluateParams()

    @model_validator(mode="after")
    def _every_corpus_configured(self) -> Params:
        missing = [c.value for c in self.corpora if c not in self.tokenize.corpora]
        if missing:
            raise ValueError(f"tokenize.corpora has no entry for {missing}")
        both = sorted(set(self.train.runs) & set(self.tune.runs))
        if both:
            raise ValueError(
                f"tune.runs.{both[0]}: also in train.runs; a tuned run is trained by the "
                "train_tuned stage: list it under tune.runs only"
            )
        return self

    def corpus(self, name: CorpusName | str) -> CorpusParams:
        return self.tokenize.corpora[CorpusName(name)]


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-")) or "params"


def parse_params(raw: dict[str, Any]) -> Params:
    """Validate a params mapping, names and cross-references included
    (``pipeline.params_check``); a ``ConfigError`` names the first bad key and why."""
    from pipeline.params_check import check_params, unknown_key_reason

    try:
        params = Params.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        key, reason = _dotted(first["loc"]), first["msg"]
        if first["type"] == "extra_forbidden":
            reason = unknown_key_reason(first["loc"]) or reason
        # cross-field validators raise ValueError("field: reason"): name the field too
        field, sep, rest = reason.removeprefix("Value error, ").partition(": ")
        if sep and re.fullmatch(r"[A-Za-z_][\w.-]*", field):
            key = field if key == "params" else f"{key}.{field}"
            reason = rest
        raise ConfigError(key, reason) from None
    check_params(params)
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml``."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError("params", f"{path} not found; run from the project root") from None
    except yaml.YAMLError as err:
        raise ConfigError("params", f"{path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError("params", f"{path} must hold a mapping at the top level")
    return parse_params(raw)


# --------------------------------------------------------------------------- stage slices

_SEARCH_KNOBS = (
    "trials",
    "concurrency",
    "epochs_per_trial",
    "grace_period",
    "reduction_factor",
    "seed",
    "cpus_per_trial",
)


def run_slice(params: Params, key: str, search: bool = False) -> Params:
    """The part of ``params`` that the train (or, with ``search``, the tune) stage of run
    ``key`` reads, as a ``Params``: the run's entry, ``train.defaults/models/scale``,
    ``tracking`` and its corpus' ``tokenize`` settings; a tuned run adds its search space,
    ``search`` the search's own knobs. The stages pass on only this slice, so each
    ``dvc.yaml`` stage declares exactly what its results depend on (tests/test_dvc.py);
    ``tracking`` is read but not declared: it says where results are recorded, not what
    they are (``stages.RECORDING_PARAMS``)."""
    tuned = key in params.tune.runs
    if not tuned and key not in params.train.runs:
        raise ConfigError("train.runs", f"no run {key!r} in train.runs or tune.runs")
    target = (params.tune.runs if tuned else params.train.runs)[key]
    corpus = CorpusName(target.corpus)
    tune: dict[str, Any] = {"runs": {}, "spaces": {}}
    if tuned:
        tune = {"runs": {key: target}, "spaces": {target.model: params.tune.spaces[target.model]}}
    if search:
        tune |= {name: getattr(params.tune, name) for name in _SEARCH_KNOBS}
    return Params.model_construct(
        corpora=(corpus,),
        tokenize=TokenizeParams.model_construct(corpora={corpus: params.tokenize.corpora[corpus]}),
        train=TrainParams.model_construct(
            defaults=params.train.defaults,
            models=params.train.models,
            scale=params.train.scale,
            runs={} if tuned else {key: target},
        ),
        tune=TuneParams.model_construct(**tune),
        tracking=params.tracking,
    )
