"""The search for tests that depend on the order they run in (``make test-order``).

A test passes whatever ran before it in its process. The search runs the suite in orders
``make test`` never uses, each a pytest of its own:

- reversed (pytest-reverse's ``--reverse``);
- shuffled with each of ``--seeds`` (pytest-random-order: the modules' order and the tests'
  within each module, so a module-scoped fixture is still set up once);
- each test module alone in a fresh process (``--workers`` at a time): a test that passes
  only after another module set something up fails here.

The not-slow tests by default (``-m "not slow"``); ``--slow`` runs them all. ``--orders``
runs only the orders named (``reversed``, ``shuffled``: one run per seed, ``alone``), in
that order. Both plugins act only when asked (``make test`` and ``make test-fast`` run in
pytest's order). Every order's failed tests are listed at the end; the exit status is 1
where any order failed. Not run by CI.

    python -m tests.order [--slow] [--orders reversed shuffled alone] [--seeds 1 2 3] [--workers 3]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
# pytest's exit statuses that pass: all passed; no test collected (a module of slow tests)
PASSED = (0, 5)
ORDERS = ("reversed", "shuffled", "alone")


def failed_tests(output: str) -> list[str]:
    """The node ids pytest's short summary (``-rfE``) names as failed or in error."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)


def run(argv: list[str], echo: bool) -> tuple[int, str]:
    """Run ``argv`` in the repository; its exit status and output (printed as it comes when
    ``echo``)."""
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if echo:
            print(line, end="", flush=True)
    return proc.wait(), "".join(lines)


def modules(root: Path = REPO / "tests") -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for p in root.rglob("test_*.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.order", description=__doc__)
    parser.add_argument("--slow", action="store_true", help="the slow tests too")
    parser.add_argument(
        "--orders", nargs="+", choices=ORDERS, default=list(ORDERS), help="the orders to run"
    )
    parser.add_argument("--seeds", nargs="+", default=["1", "2", "3"], help="shuffles' seeds")
    parser.add_argument("--workers", type=int, default=2, help="xdist workers; modules at once")
    args = parser.parse_args(argv)
    marks = [] if args.slow else ["-m", "not slow"]
    xdist = ["-n", str(args.workers), "--dist", "loadgroup", "--no-loadscope-reorder"]
    orders: dict[str, list[str]] = {"reversed": ["--reverse"]} if "reversed" in args.orders else {}
    if "shuffled" in args.orders:
        orders |= {
            f"shuffled, seed {seed}": [
                "--random-order-bucket=module",
                f"--random-order-seed={seed}",
            ]
            for seed in args.seeds
        }
    failures: dict[str, list[str]] = {}
    for name, options in orders.items():
        print(f"\n=== {name}", flush=True)
        started = time.monotonic()
        status, output = run([*PYTEST, *xdist, *marks, *options], echo=True)
        print(f"=== {name}: exit {status}, {time.monotonic() - started:.0f} s", flush=True)
        if status not in PASSED:
            failures[name] = failed_tests(output) or [f"exit {status}"]

    def alone(module: str) -> tuple[str, int, str]:
        return module, *run([*PYTEST, *marks, module], echo=False)

    if "alone" in args.orders:
        print(f"\n=== each module alone, {args.workers} at a time", flush=True)
        started = time.monotonic()
        with ThreadPoolExecutor(max(1, args.workers)) as pool:
            for module, status, output in pool.map(alone, modules()):
                print(f"{module}: exit {status}", flush=True)
                if status not in PASSED:
                    print(output, flush=True)
                    failures[f"{module} alone"] = failed_tests(output) or [f"exit {status}"]
        print(f"=== each module alone: {time.monotonic() - started:.0f} s", flush=True)

    print("\n=== order dependence:", "none found" if not failures else "", flush=True)
    for name, tests in failures.items():
        print(f"{name}:", *tests, sep="\n  ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
