"""``--help`` of every command line (``python -m pipeline ...``, ``python -m stages.<name>``,
``python -m pipeline.repro``): descriptions from module docstrings, defaults shown.

Standard library only, so that ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import re

# Indented example command lines of a docstring (``    python -m stages.train <run> ...``):
# argparse prints its own usage line, so they would say the same thing twice.
_USAGE_BLOCK = re.compile(r"^ {4}python -m .*(?:\n {8}.*)*\n?", re.MULTILINE)
# Sphinx cross-references (:class:`~pipeline.artifacts.SourceDeclaration`): the name alone.
_ROLE = re.compile(r":\w+:`(~?)([^`]+)`")


def _role_text(match: re.Match[str]) -> str:
    name = match.group(2)
    return name.rsplit(".", 1)[-1] if match.group(1) else name


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (paragraphs and indented examples kept) and each option's
    default after its help: ``(default: X)``, unless the help already says it or there is
    nothing to show (``None``, ``""``, ``[]``, a flag's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == ""
            or (isinstance(default, list | tuple) and not default)
            or default == argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def describe(doc: str | None, *, drop_usage: bool = True) -> str:
    """A module docstring as a ``--help`` description: reST's double backticks and roles
    dropped and, with ``drop_usage``, the example command lines that repeat argparse's
    usage line."""
    text = _ROLE.sub(_role_text, (doc or "").replace("``", ""))
    if drop_usage:
        text = _USAGE_BLOCK.sub("", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def command_parser(prog: str, doc: str | None, **kwargs: object) -> argparse.ArgumentParser:
    """A parser whose usage names ``prog`` (the ``python -m`` form to type) and whose help
    is ``doc`` (see :func:`describe`), defaults shown."""
    return argparse.ArgumentParser(
        prog=prog,
        description=describe(doc),
        formatter_class=HelpFormatter,
        **kwargs,  # type: ignore[arg-type]
    )
