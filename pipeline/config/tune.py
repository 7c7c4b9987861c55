"""Params of the tune stage: the search (Optuna TPE + ASHA) and each model's space."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import (
    Field,
    model_validator,
)

from pipeline.config.sections import Section
from pipeline.config.train import OptimizerParams, RunTarget, check_run_keys

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
    """What is searched for one model: fields of its config and of the optimizer.

    ``per_head`` searches config fields per attention head: the trial's value is the
    sampled one times the sampled ``n_heads`` (which ``model`` must search). The HIER
    authors search widths so (``search_params.py``: embedding = heads x 25..40, hidden =
    heads x 10..40), which keeps every width divisible by the heads.
    """

    model: dict[str, SearchDim] = Field(default_factory=dict)
    per_head: dict[str, SearchDim] = Field(default_factory=dict)
    optimizer: dict[str, SearchDim] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _fields(self) -> SearchSpace:
        unknown = sorted(set(self.optimizer) - set(OptimizerParams.model_fields))
        if unknown:
            raise ValueError(f"optimizer: {unknown} are not optimizer params")
        if not self.model and not self.optimizer:
            raise ValueError("model: name at least one dimension to search")
        if self.per_head:
            if "n_heads" not in self.model:
                raise ValueError("per_head: multiplies the searched n_heads; add model.n_heads")
            both = sorted(set(self.per_head) & set(self.model))
            if both:
                raise ValueError(f"per_head: {both} are also searched under model; keep one")
            for name, dim in self.per_head.items():
                if dim.kind not in (SearchKind.INT, SearchKind.CHOICE):
                    raise ValueError(f"per_head.{name}: a size per head is an int or a choice")
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
        check_run_keys(self.runs, "runs")
        for key, target in self.runs.items():
            if target.model not in self.spaces:
                raise ValueError(f"runs.{key}: tune.spaces has no entry for {target.model!r}")
            if target.variant is not None:
                raise ValueError(
                    f"runs.{key}.variant: a tuned run has no variants (list further runs of "
                    "the same model and corpus under train.runs)"
                )
        return self
