"""The shared base of every params section, and the names params use as keys."""

from __future__ import annotations

import enum

from pydantic import (
    BaseModel,
    ConfigDict,
)


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
