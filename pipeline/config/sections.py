"""The shared base of every params section, and the type of the names params use as keys."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints


class Section(BaseModel):
    """Base of every params section: frozen, no unknown keys, no NaN or infinite numbers
    (``lr: .inf`` is refused before any compute, not found as a diverged run)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# A corpus name: a built-in one (``pipeline.names.CorpusName``) or one a user declares with
# its source (``tokenize.corpora.<name>.source``). No ``-``: run keys join model, corpus and
# variant with it (``hier-chitchat``).
CorpusKey = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$")]
