"""A parse context that skips bad records and keeps them, as the integration layer does
to count them by kind; the format readers' tests check those kinds."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.data.formats import ParseContext
from pipeline.errors import DataError
from pipeline.names import OnError


@dataclass
class Recording(ParseContext):
    on_error: OnError = OnError.SKIP
    errors: list[DataError] = field(default_factory=list)

    def bad_record(self, err: DataError) -> None:
        self.errors.append(err)
        super().bad_record(err)
