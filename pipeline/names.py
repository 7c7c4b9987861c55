"""The names every layer shares, in a module that imports nothing of the project: the task
kinds, the policy for malformed records, and the built-in corpora."""

from __future__ import annotations

import enum


class Task(enum.StrEnum):
    """The three task kinds: ``generate`` (history -> response), ``select`` (context +
    candidates -> scores), ``lm`` (documents of sentences). A corpus yields some of them
    (``CorpusParams.tasks``); every registered model serves one (``registry.spec``)."""

    GENERATE = "generate"
    SELECT = "select"
    LM = "lm"


class OnError(enum.StrEnum):
    """What tokenize does with a malformed record: stop with an error naming it, or skip it
    and count it."""

    RAISE = "raise"
    SKIP = "skip"


class CorpusName(enum.StrEnum):
    """The corpora hiertx knows by name (``pipeline.data.corpora``). A corpus of one's own
    takes any other name and declares its source in params (``tokenize.corpora.<name>.source``)."""

    CHITCHAT = "chitchat"
    PTB = "ptb"
    PERSONACHAT = "personachat"
    MULTIWOZ = "multiwoz"
    MULTIWOZ21 = "multiwoz21"
    CORNELL = "cornell"
    DSTC7 = "dstc7"
