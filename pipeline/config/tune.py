"""Params of the tune stage: the search (Optuna TPE + ASHA) and each model's space."""

from __future__ import annotations

import enum
import itertools
import math
from typing import Any

from pydantic import (
    Field,
    model_validator,
)

from pipeline.config.sections import Section
from pipeline.config.train import OptimizerParams, RunParams, RunTarget, check_run_keys

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

    def extremes(self) -> list[tuple[str, Any]]:
        """The values at the edges of this dimension, each named (``"low"``, ``"high"``,
        ``"choice 2"``): what the params check tries every trial's rules at."""
        if self.kind == SearchKind.CHOICE:
            return [(f"choice {i + 1}", v) for i, v in enumerate(self.choices or ())]
        assert self.low is not None and self.high is not None
        if self.kind == SearchKind.INT:
            low, high, step = int(self.low), int(self.high), int(self.step or 1)
            high = low + (high - low) // step * step  # qrandint's largest value
        else:
            low, high = self.low, self.high
        return [("low", low)] if low == high else [("low", low), ("high", high)]


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

    def corners(self, limit: int = 256) -> list[tuple[dict[str, dict[str, Any]], dict[str, str]]]:
        """Samples at the space's extremes, as a trial samples them (``{"model": ...,
        "per_head": ..., "optimizer": ...}``), each with which extreme it took of each
        dimension (``{"model.dropout": "low"}``): every combination of every dimension's
        extremes, or, beyond ``limit`` of them, each dimension's extremes with the others
        at their first."""
        dims = [
            (section, name, dim)
            for section in ("model", "per_head", "optimizer")
            for name, dim in getattr(self, section).items()
        ]
        edges = [dim.extremes() for _, _, dim in dims]
        combos: list[tuple[tuple[str, Any], ...]]
        if math.prod(len(e) for e in edges) <= limit:
            combos = list(itertools.product(*edges))
        else:
            first = tuple(e[0] for e in edges)
            combos = [first] + [
                (*first[:i], edge, *first[i + 1 :]) for i, e in enumerate(edges) for edge in e[1:]
            ]
        out = []
        for combo in combos:
            sample: dict[str, dict[str, Any]] = {"model": {}, "per_head": {}, "optimizer": {}}
            taken = {}
            for (section, name, _), (which, value) in zip(dims, combo, strict=True):
                sample[section][name] = value
                taken[f"{section}.{name}"] = which
            out.append(({k: v for k, v in sample.items() if v}, taken))
        return out

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
    cpus_per_trial: float = Field(
        default=1.0, gt=0, description="local-mode trials: cores = torch threads"
    )
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


def sampled_model(sampled: dict[str, Any]) -> dict[str, Any]:
    """The model config fields of a sampled trial: ``model`` as sampled, and each
    ``per_head`` size times the sampled ``n_heads`` (``SearchSpace``)."""
    model = dict(sampled.get("model", {}))
    heads = model.get("n_heads")
    for name, per_head in sampled.get("per_head", {}).items():
        model[name] = int(per_head) * int(heads)
    return model


def tuned_knobs(base: RunParams, config: dict[str, Any], optimizer: dict[str, Any]) -> RunParams:
    """``base`` with a trial's (or the tune record's) model config fields and optimizer
    values: what a tuned run trains with."""
    return base.model_copy(
        update={
            "model": {**base.model, **config},
            "optimizer": base.optimizer.model_validate(
                {**base.optimizer.model_dump(), **optimizer}
            ),
        }
    )


def trial_params(base: RunParams, tune_params: TuneParams, sampled: dict[str, Any]) -> RunParams:
    """``base`` with the sampled values, ``epochs_per_trial`` epochs, one evaluation and
    one report per epoch (ASHA's unit of time), no early stopping (ASHA decides) and no
    parameter averaging (it belongs to the last epochs of a whole run)."""
    tuned = tuned_knobs(base, sampled_model(sampled), sampled.get("optimizer", {}))
    return base.model_validate(
        {
            **tuned.model_dump(),
            "epochs": tune_params.epochs_per_trial,
            "eval_every": None,
            "checkpoint_every": None,
            "patience": None,
            "max_steps": None,
            "averaging": {"kind": "none"},
        }
    )
