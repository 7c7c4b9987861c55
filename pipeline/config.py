"""Typed, validated parameters: ``params.yaml`` -> frozen pydantic models, one per stage.

Every model forbids unknown keys, so a typo fails before any work, and errors name the
dotted key (``tokenize.generate.max_history: Input should be greater than 0``).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.errors import ConfigError


class Section(BaseModel):
    """Base of every params section: frozen, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class CorpusName(enum.StrEnum):
    CHITCHAT = "chitchat"
    PTB = "ptb"
    PERSONACHAT = "personachat"
    MULTIWOZ = "multiwoz"
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


# --------------------------------------------------------------------------- root


class Params(Section):
    """The whole of ``params.yaml``."""

    corpora: tuple[CorpusName, ...] = Field(
        default=(CorpusName.CHITCHAT,), description="corpora `dvc repro` processes"
    )
    download: DownloadParams = DownloadParams()
    tokenize: TokenizeParams = TokenizeParams()

    @model_validator(mode="after")
    def _every_corpus_configured(self) -> Params:
        missing = [c.value for c in self.corpora if c not in self.tokenize.corpora]
        if missing:
            raise ValueError(f"tokenize.corpora has no entry for {missing}")
        return self

    def corpus(self, name: CorpusName | str) -> CorpusParams:
        return self.tokenize.corpora[CorpusName(name)]


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-")) or "params"


def parse_params(raw: dict[str, Any]) -> Params:
    """Validate a params mapping; a ``ConfigError`` names the first bad key and why."""
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(_dotted(first["loc"]), first["msg"]) from None


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
