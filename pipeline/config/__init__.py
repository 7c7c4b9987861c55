"""Typed, validated parameters: ``params.yaml`` -> frozen pydantic models, one per stage.

The sections live in ``sections`` (base, key types), ``data``, ``train``, ``tune`` and
``evaluate``; this module is the whole ``Params``, parsing and loading, and the package's
public names. It imports nothing of the project but ``errors`` and ``names``: checking
names and cross-references against the model registry and the corpora (does model ``hier``
exist, does its corpus yield its task) is the layer above, ``pipeline.plan.check``, which
every stage calls through ``pipeline.plan.load_checked``.

Every model forbids unknown keys and NaN/inf, so a typo or ``lr: .inf`` fails before any
work, and errors name the dotted key (``tokenize.generate.max_history: Input should be
greater than 0``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from pipeline.config.data import (
    ChatTargets,
    CorpusParams,
    CorpusSource,
    DownloadParams,
    FileSource,
    FormatTraits,
    GenerateParams,
    LMParams,
    SelectParams,
    SourceFormat,
    SplitParams,
    TokenizeParams,
    VocabParams,
)
from pipeline.config.evaluate import (
    CorpusEvaluateParams,
    DecodeParams,
    DecodeStrategy,
    EvaluateParams,
    LMEvaluateParams,
    LMProtocol,
    ReportParams,
    TrackingParams,
    Word2VecParams,
    check_anti_lm,
)
from pipeline.config.params_file import read_yaml
from pipeline.config.sections import CorpusKey, Section, merge_params
from pipeline.config.train import (
    AveragingKind,
    AveragingParams,
    CompileMode,
    OptimizerKind,
    OptimizerParams,
    PlacementParams,
    PlacementStrategy,
    Precision,
    RunParams,
    RunTarget,
    ScaleParams,
    ScheduleKind,
    ScheduleParams,
    Selection,
    TrainParams,
    knob_sources,
    parse_run_key,
    run_key,
    run_label,
)
from pipeline.config.tune import (
    SearchDim,
    SearchKind,
    SearchSpace,
    TuneParams,
    sampled_model,
    trial_params,
    tuned_knobs,
)
from pipeline.config.validation import config_error
from pipeline.errors import ConfigError
from pipeline.names import CorpusName

# --------------------------------------------------------------------------- root


class Params(Section):
    """The whole of ``params.yaml``."""

    corpora: tuple[CorpusKey, ...] = Field(
        default=(CorpusName.CHITCHAT.value,),
        description="corpora `dvc repro` processes: built-in names, or names declared with "
        "a source under tokenize.corpora",
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
        missing = [c for c in self.corpora if c not in self.tokenize.corpora]
        if missing:
            raise ValueError(
                f"corpora: {', '.join(missing)} has no tokenize.corpora entry: add "
                "tokenize.corpora.<name> (a built-in corpus, or your own with its source)"
            )
        builtin = {c.value for c in CorpusName}
        for name, corpus in self.tokenize.corpora.items():
            where = f"tokenize.corpora.{name}.source"
            if name in builtin and corpus.source is not None:
                raise ValueError(f"{where}: {name} is a built-in corpus; give yours another name")
            if name not in builtin and corpus.source is None:
                raise ValueError(
                    f"{where}: {name!r} is no built-in corpus ({', '.join(sorted(builtin))}): "
                    "declare its file and format here (README, Your own dialogues)"
                )
        both = sorted(set(self.train.runs) & set(self.tune.runs))
        if both:
            raise ValueError(
                f"tune.runs.{both[0]}: also in train.runs; a tuned run is trained by the "
                "train_tuned stage: list it under tune.runs only"
            )
        return self

    def corpus(self, name: str) -> CorpusParams:
        """The tokenize settings of corpus ``name``."""
        return self.tokenize.corpora[name]


def parse_params(raw: dict[str, Any]) -> Params:
    """Validate a params mapping, section by section (names and cross-references are
    ``pipeline.plan.check``'s); a ``ConfigError`` names the first bad key and why."""
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise config_error(err, root=Params) from None


def read_params(path: str | Path = "params.yaml") -> dict[str, Any]:
    """The raw mapping of a params file; a ``ConfigError`` for a missing or broken file, one
    over the size or alias limits, or one with a key written twice (``params_file``)."""
    path = Path(path)
    try:
        raw = read_yaml(path) or {}
    except FileNotFoundError:
        raise ConfigError("params", f"{path} not found; run from the project root") from None
    except OSError as err:  # a folder, a file without read permission
        raise ConfigError("params", f"{path} cannot be read: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError("params", f"{path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError("params", f"{path} must hold a mapping at the top level")
    return raw


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml`` section by section (no cross-references: stages
    call ``pipeline.plan.load_checked``)."""
    return parse_params(read_params(path))


__all__ = [
    "AveragingKind",
    "AveragingParams",
    "ChatTargets",
    "CompileMode",
    "CorpusEvaluateParams",
    "CorpusKey",
    "CorpusParams",
    "CorpusSource",
    "DecodeParams",
    "DecodeStrategy",
    "DownloadParams",
    "EvaluateParams",
    "FileSource",
    "FormatTraits",
    "GenerateParams",
    "LMEvaluateParams",
    "LMParams",
    "LMProtocol",
    "OptimizerKind",
    "OptimizerParams",
    "Params",
    "PlacementParams",
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
    "SourceFormat",
    "SplitParams",
    "TokenizeParams",
    "TrackingParams",
    "TrainParams",
    "TuneParams",
    "VocabParams",
    "Word2VecParams",
    "check_anti_lm",
    "knob_sources",
    "load_params",
    "merge_params",
    "parse_params",
    "parse_run_key",
    "read_params",
    "run_key",
    "run_label",
    "sampled_model",
    "trial_params",
    "tuned_knobs",
]  # fmt: skip
