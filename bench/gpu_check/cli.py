"""The command: arguments checked before any compute, the parts run in order within the
time limit (each within its budget, a failure reported and the others still run), the
summary printed, and the GPU section written where the run may write it (``destination``).

**Adding a part.** Write ``def my_part(check: Check, part: Part) -> None`` in a module of
this package: it measures, appends markdown blocks to ``part.text`` and summary numbers
to ``part.headlines`` (``report.Headline``: the number beside its target and baseline),
adds what its training processes spent compiling to ``part.compile_s`` (in-process
compiling is counted for it), and raises (the part FAILED, the others still run) or
``report.Missing`` (skipped, saying why). It reads the settings from ``check.setup``, the
PTB corpus from ``check.ptb()`` and the time left from ``check.seconds_left()``; a number
a later part needs goes into a typed field of ``report.Check`` that names its writer and
readers. Trainings of the profile's runs go through the project's loop as ``loop.py``'s
do: ``processes.run_at_once`` of ``processes.loop_job(check.ptb().plan(key, **knobs),
folder)``, each process within its share of the GPU. Then add a ``Spec`` to ``PARTS`` at
its place in the order (what a first GPU run needs most comes first: a part after the
time limit is skipped), with a budget that keeps the sum within ``TIME_LIMIT_S``, and
document it in the package docstring, in the README's GPU check section and in the GPU
kit's ``PHASES`` line there (``tests/bench/test_gpu_check.py`` checks the order, the
budgets' sum and that line).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import compile_seconds, environment
from bench.device import on_cuda
from bench.gpu_check.report import (
    REPO,
    Check,
    Missing,
    Part,
    Setup,
    peak_tflops,
    replace_section,
    section,
    summary,
    where,
)
from pipeline.artifacts import Layout
from pipeline.config import Precision
from pipeline.machine import has_gpu

TIME_LIMIT_S = 480.0  # issue 32: at most 8 minutes on one H100
# A smoke run on a CPU compiles the loop with Inductor: minutes on a busy 2-core machine.
SMOKE_TIME_LIMIT_S = 1800.0


@dataclass(frozen=True)
class Spec:
    """A part: its title, budget, whether it trains on PTB, and the function that runs it
    (``module:function``, imported when the part runs, so that a package the part needs
    and the machine lacks skips that part alone, saying which)."""

    title: str
    budget_s: float
    needs_ptb: bool
    function: str

    def run(self, check: Check, part: Part) -> None:
        module, name = self.function.split(":")
        getattr(importlib.import_module(f"bench.gpu_check.{module}"), name)(check, part)


# In the order a first GPU run needs them most (issue 40): the loop, the four PTB runs,
# the loop's host syncs (warm: the parts before compiled its steps), the peers, HIER.
PARTS = {
    "loop": Spec("The loop on the paper profile's PTB GPT-6", 110, True, "loop:throughput"),
    "four": Spec("Issue 33: the four 6-layer PTB runs at once", 130, True, "loop:four_runs"),
    "sync": Spec("Sync checks: the loop's steps in sync debug mode", 40, True, "sync:sync_checks"),
    "gpt2": Spec("GPT vs HF GPT-2 (GPT-2-small shapes)", 80, False, "peers:gpt_vs_gpt2"),
    "seq2seq": Spec("Transformer and U-Net vs HF BART (paper size)", 70, False, "peers:seq2seq"),
    "hier": Spec("HIER attention: masked, packed, flex", 50, False, "hier:hier_rows"),
}
# The GPU kit's run.sh runs a process per phase in the order of its PHASES, whose default
# puts hier before the peers: the README gives the PHASES of this order.
# Diagnostics: run only when named in --parts (alone, each fills a device window of its
# own); never in a default run, nor in the budgets above.
DIAGNOSTICS = {
    "ptb-curve": Spec("Issue 41: PTB curves, documents vs stream", 420, True, "curve:ptb_curve"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        description=(sys.modules["bench.gpu_check"].__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu (with --smoke)")
    p.add_argument("--smoke", action="store_true", help="toy sizes: the same code paths")
    p.add_argument(
        "--ptb",
        type=Path,
        default=None,
        help="folder with ptb.{train,valid,test}.txt (default: data/raw/ptb where it has them)",
    )
    p.add_argument("--profile", type=Path, default=REPO / "profiles" / "paper.yaml")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak")
    p.add_argument("--processes", type=int, default=None, help="trainings at once (4; smoke 2)")
    p.add_argument("--seq2seq-batch", type=int, default=None, help="histories a step (256)")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=[*PARTS, *DIAGNOSTICS],
        default=list(PARTS),
        help=f"default: every part; {', '.join(DIAGNOSTICS)} only when named",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="a results file whose GPU section this run writes (default: bench/RESULTS.md, "
        "by a CUDA run of every part at full size that passes, and by no other run)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed steps per peer (10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per peer first (3)")
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of every compiled step (default inductor; smoke: the "
        "loop part inductor, the peers eager: dynamo alone)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help=f"seconds in all (default {TIME_LIMIT_S:.0f}; smoke {SMOKE_TIME_LIMIT_S:.0f})",
    )
    return p


def default_ptb() -> Path | None:
    """``data/raw/ptb`` (``Layout``) where it holds the three files, else None."""
    from bench.gpu_check.ptb import missing_files

    folder = Layout(REPO).raw("ptb")
    return folder if missing_files(folder) is None else None


def setup_of(args: argparse.Namespace, scratch: Path) -> Setup:
    """The checked settings; ``SystemExit`` with one line for anything wrong, before any
    compute."""
    from bench.gpu_check.ptb import missing_files

    cuda = on_cuda(args.device)
    if not cuda and not args.smoke:
        raise SystemExit(
            f"--device {args.device}: full sizes need a GPU (HIER's rows alone take minutes "
            "on a CPU); add --smoke for the same code paths at toy sizes"
        )
    if cuda and not has_gpu():
        raise SystemExit(
            f"--device {args.device}: no CUDA device here; --device cpu --smoke runs the same "
            "code paths at toy sizes"
        )
    peak = args.peak_tflops
    if cuda and peak is None:
        card = torch.cuda.get_device_name()
        peak = peak_tflops(card)
        if peak is None:
            raise SystemExit(f"--peak-tflops: no dense bf16 peak known for {card!r}; pass it")
    ptb = args.ptb if args.ptb is not None else default_ptb()
    if ptb is not None and (problem := missing_files(ptb)):
        raise SystemExit(problem)
    if not args.profile.is_file():
        raise SystemExit(f"--profile {args.profile}: no such file")
    smoke = args.smoke
    processes = args.processes if args.processes is not None else (2 if smoke else 4)
    if processes < 1:
        raise SystemExit(f"--processes {processes}: at least 1")
    return Setup(
        device=args.device,
        precision=Precision.AUTO,
        smoke=smoke,
        backend=args.compile_backend or ("eager" if smoke else "inductor"),
        loop_backend=args.compile_backend or "inductor",
        repeats=args.repeats or (1 if smoke else 10),
        warmup=args.warmup if args.warmup is not None else (1 if smoke else 3),
        peak_tflops=peak,
        processes=processes,
        seq2seq_batch=args.seq2seq_batch or (2 if smoke else 256),
        ptb=ptb,
        profile=args.profile,
        scratch=scratch,
    )


def run_part(key: str, check: Check) -> Part:
    """Part ``key``: skipped (with why) where it cannot run, else run and timed; an error
    is the part's failure, reported in one line, and the check goes on."""
    spec, setup = {**PARTS, **DIAGNOSTICS}[key], check.setup
    part = Part(key, spec.title, spec.budget_s)
    if check.seconds_left() <= 0:
        part.skipped = f"the time limit is spent; run it alone: --parts {key}"
        return part
    if spec.needs_ptb and setup.ptb is None:
        part.skipped = "no --ptb DIR (a folder with ptb.{train,valid,test}.txt)"
        return part
    start, compiled = time.monotonic(), compile_seconds()
    try:
        spec.run(check, part)
    except Missing as err:
        part.skipped = str(err)
    except ModuleNotFoundError as err:
        part.skipped = f"package {err.name} is not installed ({where(err)})"
    except Exception as err:
        part.failed = f"{type(err).__name__} ({where(err)}): {str(err).splitlines()[0][:300]}"
    part.seconds = time.monotonic() - start
    part.compile_s += compile_seconds() - compiled
    if setup.cuda:
        torch.cuda.empty_cache()  # the next parts' training processes share the device
    return part


def destination(args: argparse.Namespace, setup: Setup, parts: list[Part]) -> Path | None:
    """Where this run's GPU section goes: ``--results`` when given; else
    ``bench/RESULTS.md`` for a CUDA run of every part at full size in which every part
    ran and passed (the committed section is a whole run's, with nothing skipped);
    nowhere for any other run."""
    if args.results is not None:
        return args.results
    whole = [p.key for p in parts] == list(PARTS) and all(p.ok for p in parts)
    if setup.cuda and not setup.smoke and whole:
        return REPO / "bench" / "RESULTS.md"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hiertx-gpu-check-") as tmp:
        setup = setup_of(args, Path(tmp))
        env = environment(setup.device)
        print(
            f"# GPU check{' (smoke: toy sizes)' if setup.smoke else ''}\n\n{env.markdown()}\n",
            flush=True,
        )
        limit = args.time_limit
        if limit is None:
            limit = SMOKE_TIME_LIMIT_S if setup.smoke else TIME_LIMIT_S
        check = Check(setup, time.monotonic() + limit)
        done = []
        for key in [*PARTS, *DIAGNOSTICS]:
            if key in args.parts:
                done.append(run_part(key, check))
                print(done[-1].markdown() + "\n", flush=True)
        note = (
            f"parts: {', '.join(p.key for p in done)}; compile backend {setup.backend} (peers), "
            f"{setup.loop_backend} (the loop); {setup.precision_note}; "
            f"peak {setup.peak_tflops or 'n/a'} TFLOP/s; "
            f"{'toy sizes (--smoke)' if setup.smoke else 'full sizes'}; "
            f"time limit {limit:.0f} s"
        )
        text = section(env, done, note)
    print(f"## Summary\n\n{summary(done)}", flush=True)
    results = destination(args, setup, done)
    if results is not None:
        old = results.read_text() if results.is_file() else "# Benchmarks\n"
        results.write_text(replace_section(old, text))
        print(f"\nwritten: the GPU section of {results}")
    else:
        print(
            "\nnot written: bench/RESULTS.md takes a CUDA run of every part at full size "
            "that passes; --results PATH writes this run's section there"
        )
    return 1 if any(p.failed for p in done) else 0
