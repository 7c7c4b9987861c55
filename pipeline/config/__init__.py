"""Typed, validated parameters: ``params.yaml`` -> frozen pydantic models, one per stage.

The sections live in ``sections`` (base, names), ``data``, ``train``, ``tune`` and
``evaluate``; this module is the whole ``Params``, parsing, loading and stage slices, and
the package's public names.

Every model forbids unknown keys, so a typo fails before any work, and errors name the
dotted key (``tokenize.generate.max_history: Input should be greater than 0``). Names and
cross-references (models, corpora, config fields) are checked by ``pipeline.params_check``,
which ``parse_params`` runs too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from pipeline.config.data import (
    CorpusParams,
    DownloadParams,
    GenerateParams,
    LMParams,
    SelectParams,
    SplitParams,
    Task,
    TokenizeParams,
    VocabParams,
)
from pipeline.config.evaluate import (
    CorpusEvaluateParams,
    DecodeParams,
    DecodeStrategy,
    EvaluateParams,
    ReportParams,
    TrackingParams,
    Word2VecParams,
)
from pipeline.config.sections import CorpusName, OnError, Section
from pipeline.config.train import (
    OptimizerKind,
    OptimizerParams,
    PlacementStrategy,
    Precision,
    RunParams,
    RunTarget,
    ScaleParams,
    ScheduleKind,
    ScheduleParams,
    Selection,
    TrainParams,
    merge_params,
    parse_run_key,
    run_key,
    run_label,
)
from pipeline.config.tune import SearchDim, SearchKind, SearchSpace, TuneParams
from pipeline.errors import ConfigError

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
    report: ReportParams = ReportParams()

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


__all__ = [
    "CorpusEvaluateParams",
    "CorpusName",
    "CorpusParams",
    "DecodeParams",
    "DecodeStrategy",
    "DownloadParams",
    "EvaluateParams",
    "GenerateParams",
    "LMParams",
    "OnError",
    "OptimizerKind",
    "OptimizerParams",
    "Params",
    "PlacementStrategy",
    "Precision",
    "ReportParams",
    "RunParams",
    "RunTarget",
    "ScaleParams",
    "ScheduleKind",
    "ScheduleParams",
    "SearchDim",
    "SearchKind",
    "SearchSpace",
    "Section",
    "SelectParams",
    "Selection",
    "SplitParams",
    "Task",
    "TokenizeParams",
    "TrackingParams",
    "TrainParams",
    "TuneParams",
    "VocabParams",
    "Word2VecParams",
    "load_params",
    "merge_params",
    "parse_params",
    "parse_run_key",
    "run_key",
    "run_label",
    "run_slice",
]  # fmt: skip
