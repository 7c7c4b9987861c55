"""``dvc repro`` with independent stages run concurrently: ``python -m pipeline.repro --jobs N``.

This only decides *when* to start each stage; DVC decides whether a stage is stale and does
all the locking. A stage DVC's status finds up to date, with nothing stale upstream, gets
no process (``Plan.fresh``: a second ``make repro`` starts none). Each other stage runs as
``dvc --wait-for-lock repro -s <stage>``:

* ``-s`` (``--single-item``) reproduces that one stage without walking its upstream, so it
  never write-locks outputs another process reads: DVC's per-path locks (``.dvc/tmp/rwlock``)
  fail at once, they do not wait (treeverse/dvc#11054, #5795). Its upstream is done: a stage
  starts only after every stage it depends on has exited 0.
* ``--wait-for-lock`` is a *global* option (before ``repro``): every DVC process holds the
  repository lock (``.dvc/tmp/lock``) while it loads the index, hashes dependencies, saves
  outputs and writes ``dvc.lock``, and releases it only while the stage command runs
  (``dvc/stage/run.py``: ``unlocked_repo(cmd_run)``). Without the option a process that
  finds the lock taken gives up after 3 s (treeverse/dvc#10465); with it, it polls forever,
  so concurrent stages queue for those short critical sections instead of failing.

The graph comes from DVC's Python API: ``Repo().stage.collect("dvc.yaml", with_deps=True)``
gives the stages a plain ``dvc repro`` considers (this ``dvc.yaml`` and everything upstream),
``repo.index.graph`` (a networkx DiGraph, edges from a stage to the stages it depends on) the
dependencies, ``repo.index.stages`` the order ``dvc.yaml`` lists them in, foreach stages
expanded, and ``stage.addressing`` the name ``dvc repro`` takes (``train@key``).

The final stages (``--final``, default: the graph's sinks) and everything downstream of
them are left to a closing plain ``dvc repro``, as are always-changed stages (``dvc repro``
would run them once more): that run then finds nothing else to do. ``--jobs 1`` is a plain
``dvc repro``. Start/end times of every process run land in ``.dvc/tmp/repro-times.json``.

Each stage runs in its own session, so a terminal's Ctrl-C (SIGINT), a Slurm cancel
(SIGTERM) or a closed terminal (SIGHUP) reaches the driver alone. With ``--jobs`` > 1 all
three stop the run the same way: SIGTERM and SIGHUP raise :class:`Interrupted`, a
``KeyboardInterrupt``, so :func:`interrupt` relays SIGINT to every stage's process group
(the stage stops as on Ctrl-C: DVC ignores SIGINT while the stage command runs, the
command gets ``KeyboardInterrupt``), waits ``GRACE_S`` and then SIGKILLs what is left (a
second signal: at once). The driver then exits 128 + the signal's number, as a shell
reports a process that signal ended (SIGHUP 129, SIGINT 130, SIGTERM 143). A signal
ignored when the driver starts (``nohup``: SIGHUP) stays ignored.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.helpformat import HelpFormatter, describe
from pipeline.signals import Interrupted, print_stacks_on_request, signal_number, stop_on_signals

DVC = [sys.executable, "-m", "dvc"]
TIMES = Path(".dvc/tmp/repro-times.json")
TAIL_LINES = 20
GRACE_S = 10.0
_PRINT = threading.Lock()
Record = dict[str, object]  # one process run in repro-times.json


def say(text: str) -> None:
    """Print one line atomically with respect to the children's output threads. A closed
    stdout (a hung-up terminal: EIO; a closed pipe: EPIPE) loses its lines and nothing else:
    the stages' pipes are still drained, a stop is still relayed, the exit status kept."""
    with _PRINT:
        try:
            print(text, flush=True)
        except OSError:
            # Later lines, and Python's flush of what this one left buffered, go to the null
            # device: a flush that fails at exit would turn the exit status into 120.
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)


@dataclass(frozen=True)
class Plan:
    """What to run: ``order`` by ``dvc repro -s`` (:func:`topological`: the longest chain
    first, then dvc.yaml order), ``left`` by ``dvc repro``;
    ``fresh``: stages up to date with nothing stale upstream, which no process is started
    for (a ``dvc repro -s`` would only find them unchanged)."""

    order: list[str]
    upstream: dict[str, set[str]]
    left: list[str]
    fresh: list[str] = field(default_factory=list)

    def waves(self) -> list[list[str]]:
        """Stages grouped by their longest chain of upstream stages (for ``--dry-run``)."""
        depth: dict[str, int] = {}
        for name in self.order:  # upstream stages come first in a topological order
            depth[name] = 1 + max((depth[u] for u in self.upstream[name]), default=-1)
        return [
            [n for n in self.order if depth[n] == d]
            for d in range(max(depth.values(), default=-1) + 1)
        ]


def load_plan(final: list[str] | None = None, skip_fresh: bool = False) -> Plan:
    """Read the stage graph of ``./dvc.yaml`` and split it into scheduled and left stages;
    with ``skip_fresh``, DVC's own status of each stage (``Stage.status``: what ``dvc
    status`` prints) leaves out the stages up to date with nothing stale upstream."""
    from dvc.repo import Repo

    with Repo() as repo:
        index = repo.index
        position = {stage: i for i, stage in enumerate(index.stages)}
        stages = sorted(repo.stage.collect("dvc.yaml", with_deps=True), key=position.__getitem__)
        names = {stage: stage.addressing for stage in stages}
        upstream = {
            names[s]: {names[d] for d in index.graph.successors(s) if d in names} for s in stages
        }
        always = {names[s] for s in stages if s.always_changed or s.is_callback}
        stale = set(upstream)
        if skip_fresh:
            with repo.lock:
                stale = {names[s] for s in stages if s.status()}
    downstream: dict[str, set[str]] = {name: set() for name in upstream}
    for name, ups in upstream.items():
        for u in ups:
            downstream[u].add(name)
    if final is None:
        final = [name for name, down in downstream.items() if not down]
    if unknown := sorted(set(final) - set(upstream)):
        raise SystemExit(f"unknown stage(s) for --final: {', '.join(unknown)}")
    left = with_downstream([*final, *always], downstream)
    # a stage runs when it is stale or when a stage it depends on may change its inputs
    fresh = set(upstream) - left - with_downstream(stale, downstream)
    ordered = topological(list(upstream), upstream)
    return Plan(
        order=[n for n in ordered if n not in left | fresh],
        upstream={n: upstream[n] - fresh for n in ordered if n not in left | fresh},
        left=[n for n in ordered if n in left],
        fresh=[n for n in ordered if n in fresh],
    )


def with_downstream(names: Iterable[str], downstream: dict[str, set[str]]) -> set[str]:
    """``names`` and every stage that depends on one of them, directly or not."""
    found: set[str] = set()
    todo = list(names)
    while todo:
        if (name := todo.pop()) not in found:
            found.add(name)
            todo.extend(downstream[name])
    return found


def topological(names: list[str], upstream: dict[str, set[str]]) -> list[str]:
    """Kahn's order; among ready stages the one on the longest chain of stages through it
    goes first (a tuned training, behind its search, before the plain ones that could wait),
    then the one listed first in ``names``. ``run_stages`` starts ready stages in this order."""
    downstream: dict[str, set[str]] = {name: set() for name in names}
    for name in names:
        for u in upstream[name]:
            downstream[u].add(name)
    above: dict[str, int] = {}
    below: dict[str, int] = {}
    chain = {n: _longest(n, upstream, above) + _longest(n, downstream, below) for n in names}
    position = {name: i for i, name in enumerate(names)}
    done: set[str] = set()
    order: list[str] = []
    while len(order) < len(names):
        ready = [n for n in names if n not in done and upstream[n] <= done]
        name = min(ready, key=lambda n: (-chain[n], position[n]))
        done.add(name)
        order.append(name)
    return order


def _longest(name: str, edges: dict[str, set[str]], memo: dict[str, int]) -> int:
    """The most stages on a path from ``name`` along ``edges``, ``name`` excluded."""
    if name not in memo:
        memo[name] = max((1 + _longest(n, edges, memo) for n in edges[name]), default=0)
    return memo[name]


class Child:
    """One DVC process: output streamed line by line with a ``[label]`` prefix, last lines kept."""

    def __init__(self, label: str, argv: list[str], finished: queue.Queue[str]) -> None:
        self.label, self.start, self.end = label, time.time(), 0.0
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # stage output comes line by line
            start_new_session=True,  # own process group: Ctrl-C reaches only us, we relay it
        )
        threading.Thread(target=self._pump, args=(finished,), daemon=True).start()

    def _pump(self, finished: queue.Queue[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            say(f"[{self.label}] {line.rstrip()}")
        finished.put(self.label)

    def wait(self) -> int:
        """Reap the process (its output has ended) and stamp its end time."""
        code = self.proc.wait()
        self.end = time.time()
        return code

    def send(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (DVC and the stage command)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def record(self) -> Record:
        """The timing record written to ``repro-times.json``."""
        code = self.proc.returncode
        return {"stage": self.label, "start": self.start, "end": self.end, "returncode": code}


def interrupt(children: list[Child]) -> None:
    """Relay SIGINT (Ctrl-C; SIGTERM, SIGHUP) to every child group; SIGKILL what is left
    after ``GRACE_S`` or at a second signal."""
    for child in children:
        child.send(signal.SIGINT)
    deadline = time.time() + GRACE_S
    try:
        for child in children:
            child.proc.wait(timeout=max(0.0, deadline - time.time()))
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        for child in children:
            child.send(signal.SIGKILL)
    for child in children:
        child.wait()


def run_stages(plan: Plan, jobs: int, records: list[Record]) -> int:
    """Run ``plan.order`` at most ``jobs`` at a time; 0, the first failure's code, or 128 +
    the signal that stopped the run (:func:`stop_on_signals`)."""
    pending, done, total = list(plan.order), set[str](), len(plan.order)
    if plan.fresh:
        say(f"up to date: {' '.join(plan.fresh)}")
    running: dict[str, Child] = {}
    failed: list[Child] = []
    finished: queue.Queue[str] = queue.Queue()
    try:
        while pending or running:
            ready = [n for n in pending if plan.upstream[n] <= done] if not failed else []
            for name in ready[: jobs - len(running)]:
                pending.remove(name)
                argv = [*DVC, "--wait-for-lock", "repro", "--single-item", name]
                running[name] = Child(name, argv, finished)
                say(f"started {name} ({len(running)} running, {len(done)}/{total} done)")
            if not running:
                break
            child = running[finished.get()]
            code = child.wait()  # still in `running` until reaped: a stop meanwhile reaches it
            del running[child.label]
            records.append(child.record())
            if code == 0:
                done.add(child.label)
                say(f"done {child.label} in {child.end - child.start:.1f} s")
            else:
                failed.append(child)
                say(f"FAILED {child.label} (exit {code}) in {child.end - child.start:.1f} s")
    except KeyboardInterrupt as stop:
        signum = signal_number(stop)
        name = signal.Signals(signum).name
        say(f"interrupted ({name}): stopping {', '.join(running) or 'nothing'}")
        interrupt(list(running.values()))
        records.extend(child.record() for child in running.values())
        return 128 + signum
    if failed:
        first = failed[0]
        say(f"stage {first.label} failed (exit {first.proc.returncode}); last lines:")
        for line in first.tail:
            say(f"  {line}")
        if pending:
            say(f"not started: {', '.join(pending)}")
        return exit_code(first.proc.returncode)
    return 0


def write_times(jobs: int, records: list[Record], repro: Record | None) -> None:
    """Write the timing log (``.dvc/tmp`` is git-ignored by ``dvc init``)."""
    TIMES.parent.mkdir(parents=True, exist_ok=True)
    log = {"jobs": jobs, "stages": records, "repro": repro}
    TIMES.write_text(json.dumps(log, indent=1) + "\n")


def run_final(jobs: int, records: list[Record]) -> int:
    """The closing plain ``dvc repro``: in our terminal at ``--jobs 1``, streamed otherwise."""
    if jobs == 1:
        start = time.time()
        proc = subprocess.Popen([*DVC, "repro"])  # our process group: ^C reaches DVC as typed
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # and DVC alone handles it
        try:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
        repro = {"stage": "dvc repro", "start": start, "end": time.time(), "returncode": code}
    else:
        say("started dvc repro (the remaining stages)")
        ended: queue.Queue[str] = queue.Queue()
        child = Child("dvc repro", [*DVC, "--wait-for-lock", "repro"], ended)
        try:
            ended.get()
            code = child.wait()
        except KeyboardInterrupt as stop:
            interrupt([child])
            code = -signal_number(stop)
        say(f"done dvc repro (exit {exit_code(code)}) in {child.end - child.start:.1f} s")
        repro = child.record()
    write_times(jobs, records, repro)
    return exit_code(code)


def exit_code(returncode: int) -> int:
    """A process's exit status as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m pipeline.repro [--jobs N] [--final STAGE ...] [--dry-run]``."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.repro",
        description=describe((__doc__ or "").split("\n\n")[0])
        + "\n\nEach stage runs as `dvc --wait-for-lock repro -s <stage>` once every stage it "
        "depends on\nhas finished; the final stages run in a closing plain `dvc repro`. "
        "Start and end\ntimes land in .dvc/tmp/repro-times.json.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--jobs", "-j", type=int, default=1, help="stages run at once (1: a plain dvc repro)"
    )
    parser.add_argument(
        "--final",
        nargs="+",
        action="extend",
        metavar="STAGE",
        help="stages left, with all they feed, to the closing dvc repro "
        "(default: the stages nothing depends on)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.jobs == 1 and args.dry_run:
        print("dvc repro")
        return 0
    plan = load_plan(args.final, skip_fresh=True) if args.jobs > 1 else None
    if plan is not None and args.dry_run:
        if plan.fresh:
            print(f"up to date: {' '.join(plan.fresh)}")
        print(f"`dvc repro -s`, {args.jobs} at a time, each once its upstream stages are done:")
        for i, wave in enumerate(plan.waves(), 1):
            print(f"  wave {i}: {' '.join(wave)}")
        print(f"then `dvc repro` for: {' '.join(plan.left) or '(nothing left)'}")
        return 0
    from pipeline.gpu_share import run_instance  # torch and Ray: not for --help

    print_stacks_on_request()  # `kill -USR2 <pid>`: where the driver waits
    if plan is None:  # a plain `dvc repro` in our process group, as if typed
        with run_instance(args.jobs):
            return run_final(1, [])
    try:
        with stop_on_signals(), run_instance(args.jobs):  # one Ray instance on a GPU machine
            return run_plan(plan, args.jobs)
    except Interrupted as stop:  # while no stage ran (the Ray instance starting or stopping)
        return 128 + stop.signum


def run_plan(plan: Plan, jobs: int) -> int:
    """The stages of ``plan`` at most ``jobs`` at a time, then the closing ``dvc repro``."""
    records: list[Record] = []
    code = run_stages(plan, jobs, records)
    if code != 0:
        write_times(jobs, records, None)
        return code
    return run_final(jobs, records)


if __name__ == "__main__":
    sys.exit(main())
