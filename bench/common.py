"""Shared timing helpers for the benchmarks in ``bench/``.

Every benchmark compares candidates measured in the SAME run: repetitions are interleaved
(round-robin, the order rotated each round so no candidate always runs right after another
one), warm-up calls are excluded, and the median of N is reported next to its
inter-quartile range. On a shared machine the load average is recorded with the numbers
(``Environment``), since a loaded machine slows every candidate but not equally.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.device import on_cuda, synchronize
from pipeline.config import GenerateParams, Precision
from pipeline.data.batch import GenerateBatch
from pipeline.data.encoding import EncodedDialogue
from pipeline.data.examples import build_generate
from pipeline.data.loader import collate_generate
from pipeline.data.special import SPECIAL_TOKENS
from pipeline.machine import gpu_names, has_gpu


@dataclass(frozen=True)
class Samples:
    """Wall-clock seconds of one candidate's timed repetitions (warm-up excluded)."""

    name: str
    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def iqr(self) -> tuple[float, float]:
        """First and third quartiles (both the median with fewer than two samples)."""
        if len(self.seconds) < 2:
            return self.median, self.median
        q1, _, q3 = statistics.quantiles(self.seconds, n=4, method="inclusive")
        return q1, q3


@dataclass(frozen=True)
class Environment:
    """What the numbers were measured on: recorded with every result table."""

    date: str
    cpu: str
    cores: int
    threads: int
    torch: str
    device: str
    load: tuple[float, float, float]
    command: str

    def markdown(self) -> str:
        load = ", ".join(f"{x:.2f}" for x in self.load)
        return "\n".join(
            [
                f"- date: {self.date}; command: `{self.command}`",
                f"- machine: {self.cpu}, {self.cores} cores, torch {self.torch} "
                f"({self.threads} intra-op threads), device {self.device}",
                f"- load average at start (1/5/15 min): {load}",
            ]
        )


def environment(device: str = "cpu") -> Environment:
    """The current machine, torch build, thread count, load average and command line."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    names = gpu_names() if on_cuda(device) else []
    if names:
        device = f"{device} ({names[torch.device(device).index or 0]})"
    return Environment(
        date=datetime.date.today().isoformat(),
        cpu=cpu,
        cores=os.cpu_count() or 1,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        device=device,
        load=os.getloadavg(),
        command=command_line(),
    )


def command_line() -> str:
    """How this process was started (``python -m module`` when run as a module), with the
    thread-count variables that change timings."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    # A package run with -m (``bench.gpu_check``) runs its ``__main__`` submodule.
    module = spec.name.removesuffix(".__main__") if spec is not None else None
    head = ["python", "-m", module] if module is not None else ["python", sys.argv[0]]
    env = [
        f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ
    ]
    return " ".join([*env, *head, *map(shlex.quote, sys.argv[1:])])


@dataclass(frozen=True)
class MetricStamps:
    """A training loop's metric sink (built on rank 0 by ``TrainJob.sink``) that appends
    every logged metrics dict to ``path`` as one JSON line, with the step, the time
    (``time.monotonic``: one clock for every process of the machine) and the thread count.
    Training steps' lines carry ``train_loss``; evaluations' carry ``valid_loss``."""

    path: str
    recording = True  # ``MetricSink``: the loop computes and logs the training metrics

    def __call__(self) -> MetricStamps:
        return self

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        stamp = {"step": step, "time": time.monotonic(), "threads": torch.get_num_threads()}
        with open(self.path, "a") as f:
            f.write(json.dumps({**metrics, **stamp}) + "\n")

    def read(self) -> list[dict[str, float]]:
        """The lines written so far (none if the file does not exist yet)."""
        path = Path(self.path)
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]


def interleaved(
    cases: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    device: torch.device | str = "cpu",
) -> dict[str, Samples]:
    """Time each case ``repeats`` times, round-robin, after ``warmup`` untimed calls each.

    Round ``r`` starts at case ``r mod n``, so slow drifts of the machine (another
    process starting, thermal state) spread over every case instead of one.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            cases[name]()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            synchronize(device)
            start = time.perf_counter()
            cases[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: Samples(name, tuple(times[name])) for name in names}


def compile_seconds() -> float:
    """Seconds this process has spent compiling with ``torch.compile`` so far (dynamo's
    own clock: tracing and the backend, forward and backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)


def number(value: float) -> str:
    """3 significant digits, without exponent notation for large values."""
    return f"{value:.3g}" if abs(value) < 1e3 else f"{value:,.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats get 3 significant digits."""

    def cell(value: object) -> str:
        return number(value) if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def timing_cells(samples: Samples, scale: float = 1e3) -> list[object]:
    """``[median, "q1-q3"]`` in milliseconds (``scale``) for a table row."""
    q1, q3 = samples.iqr
    return [samples.median * scale, f"{number(q1 * scale)}-{number(q3 * scale)}"]


def parser(description: str, precision: bool = True) -> argparse.ArgumentParser:
    """Arguments every benchmark takes: repetitions, warm-up, threads, device and, unless
    the runs' own params set it (``precision`` False), the precision (``--dtype``: its
    older name, which the commands in ``bench/RESULTS.md`` use)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions per case")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per case first")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: keep)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    if precision:
        p.add_argument(
            "--precision",
            "--dtype",
            type=Precision,
            choices=list(Precision),
            default=Precision.AUTO,
            help="the training params' precision, as the execution policy reads it (auto: "
            "bf16 autocast on CUDA, fp32 elsewhere)",
        )
    p.add_argument("--seed", type=int, default=0)
    return p


def setup(args: argparse.Namespace) -> Environment:
    """Apply the common arguments (threads, seed, device check) and describe the run."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if on_cuda(args.device) and not has_gpu():
        raise SystemExit(f"--device {args.device}: no CUDA device on this machine")
    return environment(args.device)


def synthetic_batch(
    batch_size: int = 16,
    history: int = 150,
    target: int = 30,
    vocab_size: int = 20000,
    utterance: tuple[int, int] = (5, 25),
    seed: int = 0,
) -> GenerateBatch:
    """A ``GenerateBatch`` of random words laid out as the data layer lays out a corpus.

    Row ``i`` is a dialogue of random utterances of ``utterance`` (min, max) tokens
    (``<bos> .. <eos>`` included) and a response; its example is built and collated by the
    data layer's own functions (``data.examples.build_generate``, ``data.loader``'s
    collate, which serving shares), with the history cut to a length spread evenly from
    ``history`` (row 0) down to 60% of it and the response to ``target`` down to 60%. So
    rows carry different amounts of padding, as after length bucketing, and every model
    sees the same tokens.
    """
    rng = np.random.default_rng(seed)

    def length(i: int, full: int) -> int:
        return max(2, round(full * (1.0 - 0.4 * i / max(batch_size - 1, 1))))

    examples = []
    lo, hi = utterance
    for i in range(batch_size):
        want, response = length(i, history), length(i, target)
        sizes: list[int] = []
        while sum(sizes) < want:  # the oldest utterance is the one the cut shortens
            sizes.append(int(rng.integers(lo, hi + 1)))
        sizes = [*reversed(sizes), response]
        words = [rng.integers(len(SPECIAL_TOKENS), vocab_size, max(n - 2, 1)) for n in sizes]
        speakers = tuple(
            "self" if (len(sizes) - u) % 2 == 1 else "other" for u in range(len(sizes))
        )
        dialogue = EncodedDialogue(f"synthetic-{i}", speakers, tuple(words), responder="self")
        params = GenerateParams(max_history=want, max_utterances=None, max_response=response)
        table = build_generate([dialogue], params)
        examples.append(table[len(table) - 1])  # the answer to the last utterance
    return collate_generate(examples)
