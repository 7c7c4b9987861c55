"""The canonical dialogue record every corpus parser produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Turn:
    """One speaker turn.

    ``acts`` maps a dialogue act (``"Hotel-Inform"``) to its ``[slot, value]`` pairs
    (MultiWOZ); ``belief`` is the belief state after the turn as ``{"domain-slot": value}``;
    ``booked`` the domains whose booking the system has made by this turn (MultiWOZ system
    turns: what the scorers' booking checks read).
    """

    speaker: str
    text: str
    acts: dict[str, list[list[str]]] | None = None
    belief: dict[str, str] | None = None
    booked: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Dialogue:
    """A dialogue (or, for language modelling, a document whose turns are sentences).

    ``meta`` holds corpus-specific extras: the split it came from, PersonaChat persona
    lines, DSTC7 candidates and labels, MultiWOZ goals.
    """

    id: str
    turns: tuple[Turn, ...]
    meta: dict[str, Any] = field(default_factory=dict)
