"""The command: arguments checked before any compute, the parts run in order within the
time limit (each within its budget, a failure reported and the others still run), the
summary printed and written into the results file."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import environment
from bench.gpu_check.report import (
    REPO,
    Missing,
    Part,
    Setup,
    peak_tflops,
    replace_section,
    section,
    summary,
    where,
)

TIME_LIMIT_S = 480.0  # issue 32: at most 8 minutes on one H100


@dataclass(frozen=True)
class Spec:
    """A part: its title, budget, whether it trains on PTB, and the function that runs it
    (``module:function``, imported when the part runs, so that a package the part needs
    and the machine lacks skips that part alone, saying which)."""

    title: str
    budget_s: float
    needs_ptb: bool
    function: str

    def run(self, setup: Setup, part: Part, state: dict[str, Any]) -> None:
        module, name = self.function.split(":")
        getattr(importlib.import_module(f"bench.gpu_check.{module}"), name)(setup, part, state)


PARTS = {
    "gpt2": Spec("GPT vs HF GPT-2 (GPT-2-small shapes)", 100, False, "peers:gpt_vs_gpt2"),
    "seq2seq": Spec("Transformer and U-Net vs HF BART (paper size)", 80, False, "peers:seq2seq"),
    "loop": Spec("The loop on the paper profile's PTB GPT-6", 100, True, "loop:throughput"),
    "four": Spec("Issue 33: the four 6-layer PTB runs at once", 120, True, "loop:four_runs"),
    "sync": Spec("Sync checks: the loop's steps in sync debug mode", 30, True, "sync:sync_checks"),
    "hier": Spec("HIER attention: masked, packed, flex", 40, False, "hier:hier_rows"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        description=(sys.modules["bench.gpu_check"].__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu (with --smoke)")
    p.add_argument("--smoke", action="store_true", help="toy sizes: the same code paths")
    p.add_argument("--ptb", type=Path, default=None, help="folder with ptb.{train,valid,test}.txt")
    p.add_argument("--profile", type=Path, default=REPO / "profiles" / "paper.yaml")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak")
    p.add_argument("--processes", type=int, default=None, help="trainings at once (4; smoke 2)")
    p.add_argument("--seq2seq-batch", type=int, default=None, help="histories a step (256)")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    p.add_argument("--results", type=Path, default=None, help="RESULTS.md to write (smoke: none)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per peer (10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per peer first (3)")
    p.add_argument("--compile-backend", default=None, help="inductor (smoke: eager: dynamo alone)")
    p.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds in all")
    return p


def setup_of(args: argparse.Namespace, scratch: Path) -> Setup:
    """The checked settings; ``SystemExit`` with one line for anything wrong, before any
    compute."""
    from bench.gpu_check.ptb import missing_files

    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
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
    if args.ptb is not None and (problem := missing_files(args.ptb)):
        raise SystemExit(problem)
    if not args.profile.is_file():
        raise SystemExit(f"--profile {args.profile}: no such file")
    smoke = args.smoke
    processes = args.processes if args.processes is not None else (2 if smoke else 4)
    if processes < 1:
        raise SystemExit(f"--processes {processes}: at least 1")
    return Setup(
        device=args.device,
        dtype="bf16" if cuda else "fp32",
        smoke=smoke,
        backend=args.compile_backend or ("eager" if smoke else "inductor"),
        repeats=args.repeats or (1 if smoke else 10),
        warmup=args.warmup if args.warmup is not None else (1 if smoke else 3),
        peak_tflops=peak,
        processes=processes,
        seq2seq_batch=args.seq2seq_batch or (2 if smoke else 256),
        ptb=args.ptb,
        profile=args.profile,
        scratch=scratch,
    )


def run_part(key: str, setup: Setup, state: dict[str, Any], deadline: float) -> Part:
    """Part ``key``: skipped (with why) where it cannot run, else run and timed; an error
    is the part's failure, reported in one line, and the check goes on."""
    spec = PARTS[key]
    part = Part(key, spec.title, spec.budget_s)
    if time.monotonic() >= deadline:
        part.skipped = f"the time limit is spent; run it alone: --parts {key}"
        return part
    if spec.needs_ptb and setup.ptb is None:
        part.skipped = "no --ptb DIR (a folder with ptb.{train,valid,test}.txt)"
        return part
    start = time.monotonic()
    try:
        if spec.needs_ptb and "ptb" not in state:
            from bench.gpu_check.ptb import PTB

            assert setup.ptb is not None
            state["ptb"] = PTB(setup.profile, setup.ptb, setup.scratch / "project", setup.smoke)
        spec.run(setup, part, state)
    except Missing as err:
        part.skipped = str(err)
    except ModuleNotFoundError as err:
        part.skipped = f"package {err.name} is not installed ({where(err)})"
    except Exception as err:
        part.failed = f"{type(err).__name__} ({where(err)}): {str(err).splitlines()[0][:300]}"
    part.seconds = time.monotonic() - start
    if torch.device(setup.device).type == "cuda":
        torch.cuda.empty_cache()  # the next parts' training processes share the device
    return part


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = args.results if args.results is not None or args.smoke else REPO / "bench/RESULTS.md"
    with tempfile.TemporaryDirectory(prefix="hiertx-gpu-check-") as tmp:
        setup = setup_of(args, Path(tmp))
        env = environment(setup.device)
        print(
            f"# GPU check{' (smoke: toy sizes)' if setup.smoke else ''}\n\n{env.markdown()}\n",
            flush=True,
        )
        deadline = time.monotonic() + args.time_limit
        state: dict[str, Any] = {"facts": {}, "deadline": deadline}
        done = []
        for key in PARTS:
            if key not in args.parts:
                continue
            part = run_part(key, setup, state, deadline)
            done.append(part)
            print(part.markdown() + "\n", flush=True)
        note = (
            f"parts: {', '.join(args.parts)}; compile backend {setup.backend}; "
            f"{setup.precision}; peak {setup.peak_tflops or 'n/a'} TFLOP/s; "
            f"{'toy sizes (--smoke)' if setup.smoke else 'full sizes'}; "
            f"time limit {args.time_limit:.0f} s"
        )
        text = section(env, done, note)
    print(f"## Summary\n\n{summary(done)}", flush=True)
    if results is not None:
        old = results.read_text() if results.is_file() else "# Benchmarks\n"
        results.write_text(replace_section(old, text))
        print(f"\nwritten: the GPU section of {results}")
    return 1 if any(p.failed for p in done) else 0
