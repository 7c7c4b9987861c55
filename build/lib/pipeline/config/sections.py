"""The shared base of every params section, and the type of the names params use as keys."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StringConstraints


class Section(BaseModel):
    """Base of every params section: frozen, no unknown keys, no NaN or infinite numbers
    (``lr: .inf`` is refused before any compute, not found as a diverged run)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# A corpus name: a built-in one (``pipeline.names.CorpusName``) or one a user declares with
# its source (``tokenize.corpora.<name>.source``). No ``-``: run keys join model, corpus and
# variant with it (``hier-chitchat``).
CorpusKey = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$")]


def merge_params(base: Section, override: Section) -> Section:
    """``base`` updated with the fields ``override`` was given explicitly (its
    ``model_fields_set``): nested sections merge recursively, mappings are updated."""
    update: dict[str, Any] = {}
    for name in override.model_fields_set:
        new, old = getattr(override, name), getattr(base, name)
        if isinstance(new, Section) and isinstance(old, Section):
            new = merge_params(old, new)
        elif isinstance(new, dict) and isinstance(old, dict):
            new = {**old, **new}
        update[name] = new
    return type(base).model_validate({**base.model_dump(), **update})
