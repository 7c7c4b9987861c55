"""Errors users see: each says what is wrong and, where it can, what to do."""

from __future__ import annotations


class HiertxError(Exception):
    """Base class of every error hiertx raises on purpose."""


class ConfigError(HiertxError, ValueError):
    """A parameter is unknown, of the wrong type or out of range.

    ``key`` is the dotted path of the offending parameter (``tokenize.vocab_size``).
    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")

    def under(self, prefix: str, replacing: str = "") -> ConfigError:
        """This error seen from ``prefix``, the section that holds its key, in place of the
        key's leading ``replacing`` part: model ``hier``'s ``hier.d_model`` is
        ``train.models.hier.model.d_model`` in params (``under("train.models.hier.model",
        replacing="hier")``)."""
        key = self.key
        if replacing and (key == replacing or key.startswith(f"{replacing}.")):
            key = key[len(replacing) :].lstrip(".")
        return ConfigError(".".join(part for part in (prefix, key) if part), self.reason)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses process boundaries (Ray)
        return type(self), (self.key, self.reason)


class DataError(HiertxError):
    """An input file is malformed; the message names the file and, where known, the line."""

    def __init__(self, path: object, reason: str, line: int | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str, int | None]]:  # crosses processes
        return type(self), (self.path, self.reason, self.line)


class DownloadError(HiertxError):
    """A corpus could not be fetched or verified."""


class TrainingDiverged(HiertxError):
    """A training's loss or weights went non-finite: the message names the run, the step and
    the knobs to look at."""
