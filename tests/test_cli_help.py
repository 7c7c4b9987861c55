"""Every command line's ``--help``: it exits 0, its usage line is the ``python -m`` form to
type, every option says what it is (and its default, where it has one), and no description
stops mid-sentence."""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipeline import cli, repro

REPO = Path(__file__).resolve().parents[1]
STAGES = sorted(p.stem for p in (REPO / "stages").glob("*.py") if p.stem != "__init__")


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _subparsers(sub)


def _help_of(main: Callable[[list[str]], object], argv: list[str], monkeypatch, capsys):
    """``main(argv + ["--help"])``: its exit code, what it printed and the parser used."""
    used: list[argparse.ArgumentParser] = []
    parse = argparse.ArgumentParser.parse_args

    def recording(self, args=None, namespace=None):
        used.append(self)
        return parse(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", recording)
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    return exit_.value.code, capsys.readouterr().out, used[0]


def check_help(parser: argparse.ArgumentParser, printed: str, prog: str) -> None:
    """The usage line, the description's ends and every option's help text."""
    assert printed.startswith(f"usage: {prog} "), printed[:200]
    description = parser.description or ""
    assert description, f"{prog}: no description"
    first, *_ = description.split("\n\n")
    assert first.rstrip().endswith((".", ")")), f"{prog}: first paragraph stops: {first!r}"
    assert description.rstrip().endswith((".", ")")), f"{prog}: stops: {description[-80:]!r}"
    assert "``" not in printed, f"{prog}: reST markup in --help"
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{prog} {name}: no help text"
        shown = parser.formatter_class(prog)._get_help_string(action)
        if action.option_strings and _has_default(action.default):
            assert "default" in shown, f"{prog} {name}: default {action.default!r} not shown"


def _has_default(default: object) -> bool:
    """Whether a default is worth showing (0 is; None, a flag's False, "" and [] are not)."""
    nothing = default is None or default is False or default == argparse.SUPPRESS
    return not nothing and default != "" and default != []


def test_every_pipeline_command_helps(monkeypatch, capsys):
    for sub in _subparsers(cli.parser()):
        argv = sub.prog.split()[3:]  # "python -m pipeline score multiwoz" -> score multiwoz
        code, printed, _ = _help_of(cli.main, argv, monkeypatch, capsys)
        assert code == 0
        check_help(sub, printed, sub.prog)
    assert {p.prog for p in _subparsers(cli.parser())} >= {
        f"python -m pipeline {c}"
        for c in ("chat", "rank", "compare", "sync-mlflow", "score multiwoz")
    }


def test_rank_help_says_what_a_score_is(monkeypatch, capsys):
    _, printed, _ = _help_of(cli.main, ["rank"], monkeypatch, capsys)
    text = " ".join(printed.split())
    assert "logit" in text and "higher is better" in text and "sigmoid(score)" in text


def test_chat_help_says_how_to_quit_and_reset(monkeypatch, capsys):
    _, printed, _ = _help_of(cli.main, ["chat"], monkeypatch, capsys)
    assert cli.QUIT in printed and cli.RESET in printed and "Ctrl-D" in printed
    text = " ".join(printed.split())  # what a blank line gets, so files line up
    assert "A blank line is not sent to the model and gets an empty line" in text
    assert "lines up line for line" in text


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_helps(stage, monkeypatch, capsys):
    module = importlib.import_module(f"stages.{stage}")
    code, printed, parser = _help_of(module.main, [], monkeypatch, capsys)
    assert code == 0
    check_help(parser, printed, f"python -m stages.{stage}")
    assert not re.search(r"^ {4}python -m", printed, re.MULTILINE), "usage repeated"


def test_repro_helps(monkeypatch, capsys):
    code, printed, parser = _help_of(repro.main, [], monkeypatch, capsys)
    assert code == 0
    check_help(parser, printed, "python -m pipeline.repro")
