"""Trainings in processes of their own, at once on one device, and what their stamps say.

Each training is ``train_local`` of a ``TrainJob`` (the project's loop, in-process) in a
process of its own, forked from a fork server; its metric sink is a ``MetricStamps``
file, so every logged window of training steps and every evaluation carries the
machine's one monotonic clock. From those:

- a **window** is the steps between two logged train lines; its tokens are the loop's
  ``tokens_per_s`` times its length (the loop measures it over exactly that window);
- the **steady** windows drop the first ``warmup`` ones (start-up, compilation) and any
  that holds an evaluation (with its checkpoint);
- several processes **overlap** over the span where all of them were in steady windows:
  each one's rate there (the windows whose middle lies in it) adds up to the device's.

On CUDA each of N processes may allocate 1/N of the memory free when they start
(``torch.cuda.set_per_process_memory_fraction``): validation, which starts large and
halves on out-of-memory (``LargestBatch``), so finds the largest batch that fits its
share and leaves the others theirs; a training step beyond its share fails that process
alone, saying so.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import MetricStamps, compile_seconds
from bench.device import on_cuda
from bench.gpu_check.report import where
from pipeline.plan import RunPlan
from pipeline.train.job import train_job
from pipeline.train.loop import TrainJob, train_local


@dataclass(frozen=True)
class Window:
    """Logged training steps ``[start, end]`` (monotonic seconds) and their tokens."""

    start: float
    end: float
    steps: int
    tokens: float

    @property
    def middle(self) -> float:
        return (self.start + self.end) / 2


@dataclass(frozen=True)
class Outcome:
    """One process's training: its stamps, when it was started, and its error if any."""

    label: str
    lines: tuple[dict[str, float], ...]
    spawned: float  # when the parent started the process
    error: str | None
    killed: bool = False  # at the time limit: its stamps so far are all there is
    compile_s: float = 0.0  # spent compiling (dynamo's clock)

    def windows(self, warmup: int) -> list[Window]:
        """The steady windows (module docstring)."""
        train = [line for line in self.lines if "train_loss" in line]
        evals = [line["time"] for line in self.lines if "valid_loss" in line]
        out = []
        for i, (a, b) in enumerate(itertools.pairwise(train)):
            if i < warmup or any(a["time"] < t <= b["time"] for t in evals):
                continue
            seconds = b["time"] - a["time"]
            out.append(
                Window(
                    a["time"], b["time"], int(b["step"] - a["step"]), b["tokens_per_s"] * seconds
                )
            )
        return out

    @property
    def eval_times(self) -> list[float]:
        return [line["time"] for line in self.lines if "valid_loss" in line]


@dataclass(frozen=True)
class Rate:
    """Tokens and steps per second over some windows."""

    tokens_per_s: float
    steps_per_s: float

    @classmethod
    def of(cls, windows: list[Window]) -> Rate:
        seconds = sum(w.end - w.start for w in windows)
        if seconds <= 0:
            return cls(0.0, 0.0)
        tokens, steps = sum(w.tokens for w in windows), sum(w.steps for w in windows)
        return cls(tokens / seconds, steps / seconds)


@dataclass(frozen=True)
class Shared:
    """Several processes on one device: each one's rate while all ran, and the overlap."""

    rates: dict[str, Rate]
    overlap: float  # the span all were steady / the span any was (0 when they never met)


def shared(outcomes: list[Outcome], warmup: int) -> Shared:
    """The processes' rates over the span where every one was in steady windows."""
    steady = {o.label: o.windows(warmup) for o in outcomes}
    if not all(steady.values()):
        empty = sorted(k for k, v in steady.items() if not v)
        raise RuntimeError(f"no steady training windows in {', '.join(empty)}: run more steps")
    lo = max(w[0].start for w in steady.values())
    hi = min(w[-1].end for w in steady.values())
    first = min(w[0].start for w in steady.values())
    last = max(w[-1].end for w in steady.values())
    if hi <= lo:
        return Shared({k: Rate.of(v) for k, v in steady.items()}, 0.0)
    inside = {k: [w for w in v if lo <= w.middle <= hi] or v for k, v in steady.items()}
    return Shared({k: Rate.of(v) for k, v in inside.items()}, (hi - lo) / (last - first))


def loop_job(plan: RunPlan, folder: Path, **fields: Any) -> TrainJob:
    """The loop's job of ``plan`` (``train_job``, no progress) with a folder of its own:
    its checkpoints in ``folder`` (jobs of one plan share a run name, and would resume
    from one another's) and its metrics in ``folder/stamps.jsonl`` (``MetricStamps``);
    ``fields`` of ``TrainJob`` set."""
    folder.mkdir(parents=True, exist_ok=True)
    job = train_job(plan, MetricStamps(str(folder / "stamps.jsonl")), show_progress=False)
    return dataclasses.replace(job, run_dir=str(folder), **fields)


@dataclass(frozen=True)
class MemoryShare:
    """What a process sharing a GPU may allocate: ``fraction`` of the card."""

    fraction: float
    gib: float  # the same, in GiB
    processes: int

    def describe(self) -> str:
        return f"{self.gib:.1f} GiB (1/{self.processes} of the free memory)"

    @classmethod
    def of(cls, processes: int) -> MemoryShare:
        """An equal share of the memory free now, for each of ``processes``."""
        free, total = torch.cuda.mem_get_info()
        return cls(free / total / processes, free / processes / 2**30, processes)


def _child(
    job: TrainJob, device: str, threads: int, share: MemoryShare | None, result: str
) -> None:
    """A training process: train ``job`` on ``device`` within its ``share`` of the GPU's
    memory; write the outcome (error, seconds compiling) to ``result``."""
    torch.set_num_threads(threads)
    if share is not None:
        torch.cuda.set_per_process_memory_fraction(share.fraction)
    error = None
    try:
        train_local(job, torch.device(device))
    except torch.cuda.OutOfMemoryError as err:
        within = "" if share is None else f" within its share, {share.describe()}"
        error = (
            f"out of memory ({where(err)}){within}: train fewer at once (--processes) or "
            "smaller batches (train.defaults.batch_tokens)"
        )
    except Exception as err:  # reported by the parent, which goes on with the other parts
        error = f"{type(err).__name__} ({where(err)}): {str(err).splitlines()[0][:300]}"
    Path(result).write_text(json.dumps({"error": error, "compile_s": compile_seconds()}))


def run_at_once(jobs: dict[str, TrainJob], device: str, timeout_s: float) -> list[Outcome]:
    """Train ``jobs`` (``loop_job``'s) at once, one process each, on ``device`` (on CUDA,
    each within an equal share of the free memory: ``MemoryShare``). Processes still
    running after ``timeout_s`` are killed (their outcome says so)."""
    # CUDA cannot be forked once initialised; a fork server can: it imports this module
    # (torch, the loop) once, initialises no device, and forks each training from itself.
    # torch._dynamo too: a torch optimizer imports it when built (seconds a process).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "torch._dynamo"])
    threads = max(1, (os.cpu_count() or 1) // len(jobs))
    share = MemoryShare.of(len(jobs)) if on_cuda(device) else None
    procs = {}
    spawned = time.monotonic()
    for label, job in jobs.items():
        result = Path(job.run_dir) / "result.json"
        result.unlink(missing_ok=True)
        args = (job, device, threads, share, str(result))
        proc = context.Process(target=_child, args=args)
        proc.start()
        procs[label] = (proc, result)
    deadline = time.monotonic() + timeout_s
    outcomes = []
    for label, (proc, result) in procs.items():
        proc.join(max(0.0, deadline - time.monotonic()))
        killed = proc.is_alive()
        if killed:
            proc.kill()
            proc.join()
        sink = jobs[label].sink
        assert isinstance(sink, MetricStamps), "run_at_once reads MetricStamps sinks"
        out = json.loads(result.read_text()) if result.is_file() else {}
        if not out:
            why = f"killed at the time limit ({timeout_s:.0f} s)" if killed else "died"
            out["error"] = f"the process {why}, exit code {proc.exitcode}"
        lines = tuple(sink.read())
        compile_s = out.get("compile_s", 0.0)
        outcomes.append(Outcome(label, lines, spawned, out["error"], killed, compile_s))
    return outcomes
