"""Errors users see: each says what is wrong and, where it can, what to do."""


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


class DataError(HiertxError):
    """An input file is malformed; the message names the file and, where known, the line."""

    def __init__(self, path: object, reason: str, line: int | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}")


class DownloadError(HiertxError):
    """A corpus could not be fetched or verified."""
