"""The names every layer shares, in a module that imports nothing of the project: the task
kinds, the policy for malformed records, and the built-in corpora; and :func:`one_per_name`,
which ties a table of a higher layer (the corpus readers) to the names it must cover."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TypeVar

Name = TypeVar("Name", bound=enum.Enum)
Entry = TypeVar("Entry")


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
    """The corpora hiertx knows by name. Each has exactly one reader and spec in
    ``pipeline.data.corpora.CORPORA``, checked when that module is imported
    (:func:`one_per_name`). A corpus of one's own takes any other name and declares its
    source in params (``tokenize.corpora.<name>.source``)."""

    CHITCHAT = "chitchat"
    PTB = "ptb"
    PERSONACHAT = "personachat"
    MULTIWOZ = "multiwoz"
    MULTIWOZ21 = "multiwoz21"
    CORNELL = "cornell"
    DSTC7 = "dstc7"


def one_per_name(
    names: type[Name], entries: Iterable[tuple[str, Entry]], table: str
) -> Mapping[Name, Entry]:
    """``entries`` (``(name, entry)`` pairs) as a read-only table keyed by the members of
    ``names``, refused unless it holds exactly one entry per member: an entry under no name,
    a name twice, or a name without an entry is a ``TypeError`` naming ``table`` when its
    module is imported, so a table of a higher layer (the readers of ``CorpusName``) cannot
    fall out of step with the names the layers below it use."""
    by_name: dict[Name, Entry] = {}
    for key, entry in entries:
        try:
            name = names(key)
        except ValueError:
            raise TypeError(
                f"{table}: {key!r} is not a {names.__name__}: add it to "
                f"{names.__module__}.{names.__name__}"
            ) from None
        if name in by_name:
            raise TypeError(f"{table}: {key!r} has two entries")
        by_name[name] = entry
    missing = [str(n.value) for n in names if n not in by_name]
    if missing:
        raise TypeError(f"{table}: no entry for {', '.join(missing)} ({names.__name__})")
    return MappingProxyType(by_name)
