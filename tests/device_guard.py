"""Where code decides about the device on its own: the patterns the device guards look for.

A guard scans a tree's Python code (docstrings, other string literals and comments left
out, so prose about ``torch.compile`` is not a hit) for the decisions the execution policy
owns (issue 50): autocast, compiling, tests of the device, moves to it and pinning. Each
guard compares what it finds with its stated exceptions (``tests/bench/test_device_guard.py``
for ``bench/``).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PATTERNS = {
    "autocast": re.compile(r"\btorch\.(?:autocast|amp\b|cuda\.amp\b)|\bGradScaler\b"),
    # ``module.compile(...)`` too; not ``re.compile``
    "compile": re.compile(r"\btorch\.compile\b|(?<!\bre)\.compile\(|\btorch\._dynamo\.optimize\b"),
    "device check": re.compile(
        r"torch\.cuda\.is_available\(|\.is_cuda\b|\bdevice\.type\b"
        r"|torch\.device\([^()]*\)\.type\b|device\.startswith\("
    ),
    # to the device of a run or a process (not to another tensor's: ``x.to(y.device)``)
    "device move": re.compile(
        r"\.to\(\s*(?:(?:self|args|setup|ctx|check)\.)*device\b(?!\s*=)|\.cuda\("
    ),
    "pinning": re.compile(r"\bpin_memory\b"),
}


def code_lines(text: str) -> list[str]:
    """``text``'s lines with every string literal and comment blanked out."""
    rows = [list(line) for line in text.splitlines()]
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        (first, start), (last, end) = token.start, token.end
        for number in range(first, last + 1):
            row = rows[number - 1]
            lo = start if number == first else 0
            hi = end if number == last else len(row)
            row[lo:hi] = " " * (min(hi, len(row)) - lo)
    return ["".join(row) for row in rows]


def scan(
    trees: tuple[str, ...], patterns: dict[str, re.Pattern[str]] = PATTERNS
) -> dict[tuple[str, str], list[int]]:
    """``(file relative to the repository, pattern name) -> line numbers`` of every hit
    in the Python files under ``trees`` (folders of the repository)."""
    found: dict[tuple[str, str], list[int]] = {}
    for tree in trees:
        for path in sorted((REPO / tree).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            for number, line in enumerate(code_lines(path.read_text()), 1):
                for kind, pattern in patterns.items():
                    if pattern.search(line):
                        found.setdefault((name, kind), []).append(number)
    return found
