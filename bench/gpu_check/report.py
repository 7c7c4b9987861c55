"""What every part of the GPU check shares: its settings (``Setup``), what one part hands
to a later one (``Check``), its result (``Part``), optional packages, and the summary
written into the GPU section of a results file.

The issues' targets and the numbers they measured (one H200, at commit ab321a2) are
here, once: the summary prints them beside each measured number.
"""

from __future__ import annotations

import importlib
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from bench.common import Environment, table
from bench.device import on_cuda
from pipeline.config import Precision
from pipeline.execution import autocast_dtype

if TYPE_CHECKING:
    from bench.gpu_check.ptb import PTB

REPO = Path(__file__).resolve().parents[2]
SECTION = "## GPU"  # the heading of RESULTS.md's GPU section (the text after it is free)
RERUN = (
    "to measure again: `python -m bench.gpu_check --ptb data/raw/ptb` on one GPU, or the "
    'GPU kit\'s `run.sh` part by part (README, "On a GPU, one command")'
)
BASELINE = "issue 32/33: one H200, torch 2.11+cu130, main at ab321a2"
# Dense bf16 peak TFLOP/s by card name (the SXM parts; their PCIe/NVL parts are lower).
PEAKS = {"H100": 989.0, "H200": 989.0}


class Missing(Exception):
    """An optional package is not installed: the part (or its rows) is skipped."""


def optional(package: str, needed_for: str) -> ModuleType:
    """``import package``, or ``Missing`` saying what is skipped without it."""
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise Missing(f"{needed_for} skipped: {package} is not installed ({err})") from None


def where(err: BaseException) -> str:
    """``file:line`` of the innermost frame of the project's code that ``err`` passed
    through (the innermost frame at all when none is the project's)."""
    frames = traceback.extract_tb(err.__traceback__)
    last = ([f for f in frames if f.filename.startswith(f"{REPO}/")] or frames)[-1]
    return f"{last.filename.removeprefix(f'{REPO}/')}:{last.lineno}"


def peak_tflops(card: str) -> float | None:
    """The dense bf16 peak of a card by its name (``PEAKS``), None for one not listed."""
    return next((peak for name, peak in PEAKS.items() if name in card), None)


@dataclass(frozen=True)
class Setup:
    """The check's settings, the same for every part."""

    device: str
    precision: Precision  # the training params' (auto), read by the execution policy
    smoke: bool
    backend: str  # torch.compile backend of the peer rows
    loop_backend: str  # torch.compile backend of the loop's compiled steps
    repeats: int
    warmup: int
    peak_tflops: float | None
    processes: int
    seq2seq_batch: int
    ptb: Path | None
    profile: Path
    scratch: Path

    @property
    def cuda(self) -> bool:
        return on_cuda(self.device)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The execution policy's autocast dtype of :attr:`precision` on the device
        (None: fp32), for every part's steps and passes."""
        return autocast_dtype(self.precision, torch.device(self.device))

    @property
    def precision_note(self) -> str:
        """How every step runs, in words."""
        dtype = self.autocast_dtype
        how = "fp32 (no autocast)" if dtype is None else f"{dtype}".replace("torch.", "")
        how += "" if dtype is None else " autocast"
        return f"{how} (precision {self.precision})"


@dataclass(frozen=True)
class LoopRate:
    """What the ``loop`` part measured that sizes the ``four`` part: the median steps/s of
    one training among ``processes`` at once, and their start-up (from starting the
    processes to the last one's first logged window: building, compiling)."""

    processes: int
    steps_per_s_each: float
    startup_s: float


@dataclass
class Check:
    """One run of the check as its parts see it: the settings, the time limit, the PTB
    corpus (tokenized on first use, once) and what an earlier part measured for a later
    one. Each field after ``deadline`` has one writer and names its readers; a reader that
    finds it None (its writer did not run, or failed) goes on without it and says so."""

    setup: Setup
    deadline: float  # time.monotonic() after which no part starts and trainings are killed
    loop_rate: LoopRate | None = None  # written by ``loop``; read by ``four``
    _ptb: PTB | None = field(default=None, repr=False)

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def ptb(self) -> PTB:
        """The profile's PTB runs on the ``--ptb`` corpus (``ptb.PTB``); ``Missing``
        without ``--ptb``."""
        if self._ptb is None:
            from bench.gpu_check.ptb import PTB

            s = self.setup
            if s.ptb is None:
                raise Missing("no --ptb DIR (a folder with ptb.{train,valid,test}.txt)")
            self._ptb = PTB(s.profile, s.ptb, s.scratch / "project", s.smoke)
        return self._ptb


@dataclass(frozen=True)
class Headline:
    """One number of the summary, with the issue's target and baseline for it."""

    what: str
    value: str
    target: str = ""
    baseline: str = ""


@dataclass
class Part:
    """One part's outcome: printed as it finishes, summarised at the end."""

    key: str
    title: str
    budget_s: float
    text: list[str] = field(default_factory=list)  # markdown blocks: tables and notes
    headlines: list[Headline] = field(default_factory=list)
    skipped: str | None = None
    failed: str | None = None
    seconds: float = 0.0
    compile_s: float = 0.0  # of ``seconds``: compiling (dynamo's clock; the slowest process)

    @property
    def ok(self) -> bool:
        return self.failed is None and self.skipped is None

    @property
    def status(self) -> str:
        if self.failed is not None:
            return f"FAILED: {self.failed}"
        if self.skipped is not None:
            return f"skipped: {self.skipped}"
        over = f" (over its {self.budget_s:.0f} s budget)" if self.seconds > self.budget_s else ""
        return f"ran in {self.seconds:.0f} s{over}; compiling {self.compile_s:.0f} s of it"

    def markdown(self) -> str:
        body = "\n\n".join(self.text) if self.text else ""
        return f"### {self.title}\n\n{self.status}" + (f"\n\n{body}" if body else "")


def summary(parts: list[Part]) -> str:
    """The summary table: each headline number beside its target and baseline, and a row
    for every part without one (skipped, failed)."""
    rows: list[list[object]] = []
    for part in parts:
        spent = f"{part.seconds:.0f} / {part.budget_s:.0f} ({part.compile_s:.0f})"
        if part.headlines and part.ok:
            rows += [
                [part.title, h.what, h.value, h.target, h.baseline, spent] for h in part.headlines
            ]
        else:
            rows.append([part.title, part.status, "", "", "", spent])
    headers = ["part", "what", "measured", "target", f"baseline ({BASELINE})"]
    headers.append("s / budget s (compiling s)")
    return table(headers, rows)


def section(env: Environment, parts: list[Part], note: str) -> str:
    """The GPU section of RESULTS.md: where and how it was measured, the summary, then
    every part's tables."""
    head = [
        f"{SECTION} (`python -m bench.gpu_check`)",
        "",
        env.markdown(),
        f"- {note}",
        f"- {RERUN}",
        "",
        summary(parts),
    ]
    return "\n".join(head) + "\n\n" + "\n\n".join(p.markdown() for p in parts) + "\n"


def replace_section(document: str, new: str) -> str:
    """``document`` with its GPU section (from the ``## GPU`` heading to the next ``## ``
    heading) replaced by ``new``; appended at the end where it has none."""
    pattern = re.compile(rf"^{re.escape(SECTION)}\b.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(document):
        return (
            pattern.sub(lambda _: new.rstrip("\n") + "\n\n", document, count=1).rstrip("\n") + "\n"
        )
    return document.rstrip("\n") + "\n\n" + new
