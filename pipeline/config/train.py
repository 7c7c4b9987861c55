"""Params of the train stage: runs, per-run overrides merged over model and global
defaults, optimiser, schedule, precision and scale (Ray Train)."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from pipeline.config.sections import CorpusKey, Section, merge_params
from pipeline.errors import ConfigError

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
    embedding_lr_multiplier: float = Field(
        default=1.0,
        gt=0,
        description="the token embedding's learning rate over lr, through warm-up and "
        "schedule (the Transformer-XL PTB recipe's --emb_mult 2); only for a model with "
        "one token embedding (TaskModel.token_embedding)",
    )

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
    COSINE = "cosine"


class ScheduleParams(Section):
    """Learning-rate schedule: constant; linear warm-up to ``lr`` then constant; Noam
    (warm-up then inverse square root decay), scaled so that its peak equals ``lr``; or
    cosine: linear warm-up to ``lr``, cosine decay to ``min_lr`` at step ``decay_steps``
    (counted from the first step, warm-up included), then ``min_lr``."""

    kind: ScheduleKind = ScheduleKind.NONE
    warmup_steps: int = Field(default=1000, gt=0)
    min_lr: float = Field(
        default=0.0, ge=0, description="cosine: the learning rate it decays to (absolute)"
    )
    decay_steps: int | None = Field(
        default=None,
        gt=0,
        description="cosine: the step at which it reaches min_lr, warm-up included; null = "
        "the run's planned steps (those before averaging starts, when averaging is on)",
    )


class AveragingKind(enum.StrEnum):
    NONE = "none"
    UNIFORM = "uniform"  # the running mean of the weights after every step
    EMA = "ema"  # an exponential moving average with ema_decay


class AveragingParams(Section):
    """Parameter averaging over the last ``epochs`` epochs of a run (the Transformer-XL PTB
    recipe: ``--mu -1`` uniform, ``--mu m`` EMA; ``--ema_lr_mult``): from epoch
    ``train.epochs - epochs`` on, the loop keeps an average of the weights after every
    optimizer step, multiplies the learning rate by ``lr_factor`` and stops the schedule.
    The average is what validation evaluates, what the run keeps and exports."""

    kind: AveragingKind = AveragingKind.NONE
    epochs: int = Field(default=1, gt=0, description="the last epochs of the run it covers")
    ema_decay: float = Field(
        default=0.999, gt=0, lt=1, description="ema: the old average's weight at each step"
    )
    lr_factor: float = Field(
        default=1.0, gt=0, description="the learning rate is multiplied by it while averaging"
    )


class CompileMode(enum.StrEnum):
    """``torch.compile`` of the training step's model and loss."""

    AUTO = "auto"  # on CUDA for models that compile whole (supports_compile), else off
    ON = "on"
    OFF = "off"
    # on, with CUDA graphs (torch.compile's mode) over bucketed static shapes: small steps
    REDUCE_OVERHEAD = "reduce-overhead"


class Precision(enum.StrEnum):
    AUTO = "auto"  # bf16 autocast on GPU, fp32 on CPU
    FP32 = "fp32"
    BF16 = "bf16"


class Selection(enum.StrEnum):
    """What picks a run's kept weights, counts its patience and ranks tune trials.

    ``valid_loss``: the lowest validation loss. ``multiwoz_score``: the highest
    ``BLEU + 0.5 * (Inform + Success)`` of greedy responses to the validation dialogues,
    the HT-Encoder authors' criterion. ``mrr``: the highest mean reciprocal rank of the
    true response among each validation example's candidates (select runs: what their
    test split is scored on). Both scores: ``pipeline.eval.validation_score``.
    """

    VALID_LOSS = "valid_loss"
    MULTIWOZ_SCORE = "multiwoz_score"
    MRR = "mrr"

    @property
    def metric(self) -> str:
        """The validation metric it reads, as the loop logs it."""
        return "valid_loss" if self is Selection.VALID_LOSS else "valid_score"

    @property
    def higher_is_better(self) -> bool:
        return self is not Selection.VALID_LOSS

    @property
    def mode(self) -> str:
        """Ray Tune's name for the direction (``min``/``max``)."""
        return "max" if self.higher_is_better else "min"


class RunParams(Section):
    """The knobs of one training run. ``train.defaults`` holds them all; ``train.models.<m>``
    and ``train.runs.<run>.overrides`` hold only the keys they change (merged in that order
    by ``TrainParams.run``)."""

    seed: int = Field(default=1234, ge=0, description="base seed; worker r uses seed + r")
    batch_size: int = Field(
        default=32, gt=0, description="global: examples per optimizer step over all workers"
    )
    eval_batch_size: int | None = Field(
        default=None,
        gt=0,
        description="global: validation examples a batch; null = batch_size, and on CUDA "
        "the largest that fits from 512 a device down (halved on out-of-memory); a number "
        "starts there on CUDA too (trainings sharing a GPU: leave memory to the others)",
    )
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
    min_delta: float = Field(
        default=0.0, ge=0, description="smallest improvement that counts (select_by's units)"
    )
    select_by: Selection = Field(
        default=Selection.VALID_LOSS,
        description="what picks the kept weights, patience and tune trials: valid_loss, "
        "multiwoz_score (BLEU + 0.5 (Inform + Success) of greedy validation responses; "
        "MultiWOZ generate runs) or mrr (the validation examples' mean reciprocal rank of "
        "the true response among their candidates; select runs)",
    )
    clip_norm: float | None = Field(default=1.0, gt=0, description="max gradient norm")
    optimizer: OptimizerParams = OptimizerParams()
    schedule: ScheduleParams = ScheduleParams()
    precision: Precision = Precision.AUTO
    compile: CompileMode = Field(
        default=CompileMode.AUTO,
        description="torch.compile the training forward and backward: auto = on CUDA for "
        "models that compile without graph breaks (off on CPU, where it is slower); "
        "reduce-overhead = on, with CUDA graphs over bucketed shapes (small steps)",
    )
    batch_tokens: int | None = Field(
        default=None,
        gt=0,
        description="global: padded tokens per optimizer step over all workers, examples "
        "grouped by length (null = batch_size examples a step)",
    )
    averaging: AveragingParams = AveragingParams()
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
    word_vectors: str | None = Field(
        default=None,
        min_length=1,
        description="pre-trained word vectors, a FastText/word2vec .vec text file (or "
        ".vec.gz; a relative path is from the project root): a fresh run starts its token "
        "embeddings from the rows of the vocabulary's words, rescaled to the embedding's "
        "initial scale (pipeline.models.word_vectors); a resumed run keeps its checkpoint's. "
        "Their dimension must be the model's embedding size (d_model, or d_embed). Train "
        "runs only: tune trials start from random embeddings",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_from_yaml_booleans(cls, value: Any) -> Any:
        """YAML 1.1 reads unquoted ``on``/``off`` (and ``yes``/``no``) as booleans, and so
        does ``dvc exp run -S train.defaults.compile=off``: true means on, false off."""
        if isinstance(value, bool):
            return CompileMode.ON if value else CompileMode.OFF
        return value

    @property
    def validation_batch_size(self) -> int:
        """Validation examples a batch (global): ``eval_batch_size``, else ``batch_size``."""
        return self.eval_batch_size or self.batch_size

    @property
    def validation_limit(self) -> int | None:
        """Validation batches an evaluation reads: ``max_eval_batches``, else
        ``max_batches_per_epoch``; None = the whole split."""
        return self.max_eval_batches or self.max_batches_per_epoch


def knob_names(section: type[Section], prefix: str = "") -> list[str]:
    """The dotted names of every leaf field of ``section`` (``schedule.min_lr``), mappings
    (a run's ``model`` config overrides) left out."""
    out = []
    for name, info in section.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, Section):
            out += knob_names(kind, f"{prefix}{name}.")
        elif name != "model":
            out.append(f"{prefix}{name}")
    return out


def _sets(section: Section, dotted_key: str) -> bool:
    """Whether ``section`` was given ``dotted_key`` explicitly (not by default)."""
    head, _, rest = dotted_key.partition(".")
    if head not in section.model_fields_set:
        return False
    value = getattr(section, head)
    return not rest or not isinstance(value, Section) or _sets(value, rest)


class RunTarget(Section):
    """One model trained (or tuned) on one corpus; its key in ``runs`` is
    ``<model>-<corpus>`` (the DVC stage name suffix and output folder), or
    ``<model>-<corpus>-<variant>`` for a further run of the same pair (a sweep)."""

    model: str = Field(min_length=1)
    corpus: CorpusKey
    variant: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9][a-z0-9_.]*$",
        description="names one more run of this model and corpus with its own overrides "
        "(the HGPT paper's layer splits: l1_1_4); train runs only",
    )
    overrides: RunParams = Field(
        default_factory=RunParams, description="keys of this run that differ (train runs only)"
    )

    @property
    def key(self) -> str:
        return run_key(self.model, self.corpus, self.variant)

    @property
    def label(self) -> str:
        """How tables name the run: the model, and its variant if it has one."""
        return run_label(self.model, self.variant)


def run_key(model: str, corpus: str, variant: str | None = None) -> str:
    """The name of a (model, corpus) run: ``hier-multiwoz``; ``hgpt-ptb-l2_2_2`` with a
    variant."""
    return f"{model}-{corpus}" + (f"-{variant}" if variant else "")


def parse_run_key(key: str) -> tuple[str, str, str | None]:
    """``(model, corpus, variant)`` of a run key (``run_key``'s inverse: model names,
    corpus names and variants hold no ``-``); a ``ConfigError`` for anything else. Whether
    the model and the corpus exist is the params check's business (``pipeline.plan``)."""
    parts = key.split("-")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(
            "runs", f"{key!r} is no run key: <model>-<corpus>[-<variant>], e.g. hier-multiwoz"
        )
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def run_label(model: str, variant: str | None) -> str:
    """A run's row name in the report: ``hgpt``, ``hgpt (l2_2_2)``."""
    return f"{model} ({variant})" if variant else model


def check_run_keys(runs: dict[str, RunTarget], where: str) -> None:
    for key, target in runs.items():
        if key != target.key:
            raise ValueError(
                f"{where}.{key}: must be named {target.key!r} (<model>-<corpus>[-<variant>])"
            )


class PlacementStrategy(enum.StrEnum):
    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


class ScaleParams(Section):
    """How many Ray Train workers a run trains on: part of what a run computes (the global
    batch is split over them, worker r seeds ``seed + r``), so a dependency of its stages."""

    num_workers: int = Field(default=0, ge=0, description="0 = local, in-process, no Ray")


class PlacementParams(Section):
    """Where a run's workers go: not what they compute, so changing it re-runs nothing (no
    DVC dependency; ``stages.UNDECLARED_PARAMS``). ``cpus_per_worker`` is also a worker's
    torch threads, in the stage's own process too (``pipeline.machine.cpu_threads``): like
    another CPU or GPU model, another count rounds a CPU result differently (the same
    training, other low bits), which DVC does not track either."""

    use_gpu: bool | None = Field(default=None, description="null = use GPUs if present")
    cpus_per_worker: float = Field(default=1.0, gt=0, description="cores = torch threads")
    gpus_per_worker: float = Field(default=1.0, gt=0, description="with use_gpu only")
    strategy: PlacementStrategy = PlacementStrategy.PACK
    max_failures: int = Field(
        default=0, ge=-1, description="worker-group restarts from the last checkpoint (-1: always)"
    )
    storage_path: str | None = Field(
        default=None,
        description="runs and checkpoints: an absolute path or URI shared by every node "
        "(multi-node); default $HIERTX_STORAGE_PATH, else <project>/runs/ray",
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
    placement: PlacementParams = PlacementParams()

    @model_validator(mode="after")
    def _keys(self) -> TrainParams:
        check_run_keys(self.runs, "runs")
        return self

    def source(self, key: str, model: str, knob: str) -> str:
        """The dotted params key that sets ``knob`` for run ``key`` (:func:`knob_source`)."""
        return knob_source(run_levels(self, key, model), knob)

    def sets(self, key: str, model: str, knob: str) -> bool:
        """Whether a level of run ``key`` gives ``knob`` (else it is the default)."""
        return any(_sets(level, knob) for _, level in run_levels(self, key, model))

    def run(self, model: str, corpus: str, variant: str | None = None) -> RunParams:
        """The merged knobs of ``model`` on ``corpus`` (its ``variant``): defaults < models
        < run overrides."""
        merged = self.defaults
        if model in self.models:
            merged = merge_params(merged, self.models[model])
        target = self.runs.get(run_key(model, corpus, variant))
        if target is not None:
            merged = merge_params(merged, target.overrides)
        return merged  # type: ignore[return-value]


def run_levels(train: TrainParams, key: str, model: str) -> list[tuple[str, RunParams]]:
    """Where the knobs of run ``key`` (of ``model``) come from, most specific first, each
    with its dotted params key: its overrides (a train run's), ``train.models.<model>``,
    ``train.defaults``. The knobs that bound one another may be set at different levels
    (averaging.epochs for a model, epochs in a run's overrides): the params check
    (``pipeline.plan.check``) checks them where they meet, in the merged knobs, and names
    each level that contributed."""
    out = []
    if key in train.runs:
        out.append((f"train.runs.{key}.overrides", train.runs[key].overrides))
    if model in train.models:
        out.append((f"train.models.{model}", train.models[model]))
    return [*out, ("train.defaults", train.defaults)]


def knob_source(levels: list[tuple[str, RunParams]], knob: str) -> str:
    """The dotted params key that sets ``knob`` (``schedule.min_lr``) among a run's
    ``levels``: the most specific level that gives it; for a knob left at its default, the
    most specific level that gives its section (where the run's ``schedule`` is), else
    ``train.defaults``."""
    where = next((prefix for prefix, level in levels if _sets(level, knob)), None)
    if where is None:
        section = knob.rpartition(".")[0]
        where = next(
            (prefix for prefix, level in levels if section and _sets(level, section)),
            levels[-1][0],
        )
    return f"{where}.{knob}"


def knob_sources(train: TrainParams, key: str, model: str) -> dict[str, str]:
    """:func:`knob_source` of every knob of run ``key`` (dotted; the model config aside).
    A function, not a method: what the train stage reads of params is recorded field by
    field (``tests/test_dvc.py``), and a method call would take ``train`` whole."""
    levels = run_levels(train, key, model)
    return {knob: knob_source(levels, knob) for knob in knob_names(RunParams)}
