"""What a run ran on, in one line for records and reports (results are only comparable
between runs whose line says the same machine), and the threads it computes with."""

from __future__ import annotations

import contextlib
import math
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * page / 2**30


def gpu_names() -> list[str]:
    """The name of every GPU torch sees (none: an empty list)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def has_gpu() -> bool:
    """Whether torch sees a GPU on this machine."""
    import torch

    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The device this process computes on: its first GPU when torch sees one, else the
    CPU (how a run then uses it is its ``pipeline.execution.ExecutionPolicy``)."""
    import torch

    return torch.device("cuda" if has_gpu() else "cpu")


@contextlib.contextmanager
def cpu_threads(cpus: float) -> Iterator[int]:
    """torch's intra-op threads for the block: the cores one worker holds
    (``train.placement.cpus_per_worker``, at least one thread), as many in a stage's own
    process as in a Ray worker with that many CPUs; the caller's count restored after.

    A fixed count, not this machine's cores, because a CPU result depends on it: the
    reductions split over threads add in another order (1 and 2 threads end a training at
    different weights). So a run gives the same weights on any machine with the same CPU
    kernels, whatever its cores and however many stages run beside it, and concurrent
    stages (``make repro JOBS=N``) each keep to their share instead of all of them
    spinning a thread per core."""
    import torch

    before = torch.get_num_threads()
    threads = max(1, math.floor(cpus))
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def describe() -> str:
    """``"AMD EPYC 7B13, 2 cores, 24 GiB; no GPU; torch 2.13.0, Python 3.11.9"``: the
    CPU model, the cores this process may use, memory, the GPUs torch sees, versions."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = _memory_gib()
    parts = [_cpu_model(), f"{cores} cores"]
    if memory is not None:
        parts.append(f"{memory:.0f} GiB")
    names = gpu_names()
    gpu = ", ".join(f"{names.count(n)}x {n}" for n in dict.fromkeys(names)) or "no GPU"
    versions = f"torch {torch.__version__}, Python {platform.python_version()}"
    return f"{', '.join(parts)}; {gpu}; {versions}"


def code_version(root: str | Path = ".") -> str | None:
    """The git commit of the code under ``root`` (``+dirty`` with uncommitted changes to
    tracked files); None outside a git checkout or without git."""
    import subprocess

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False
        )

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        dirty = git("diff", "--quiet", "HEAD", "--", "pipeline", "stages").returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")
