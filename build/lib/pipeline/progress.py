"""Progress of long work: a bar on a terminal, a one-line update every so often in a log.

Every stage that runs for long (tokenize, tune, train, evaluate) reports through a
:class:`Reporter`. Where its output goes decides how:

- a terminal (``dvc repro`` typed in a shell: DVC hands a stage the user's terminal): a
  rich progress bar, erased when the work ends, with :meth:`Reporter.note` lines above it;
- a file or pipe (CI, ``make repro > log``, a queued ``dvc exp run``): a bar there is
  either invisible or a stream of control codes, so the same progress is one line at the
  start, one at most every :data:`REPORT_EVERY_S` seconds, one per :meth:`Reporter.note`
  and one at the end, e.g.
  ``train transformer-chitchat (seed 1): step 120/600 (20%), loss 5.12, 3.1 steps/s,
  ETA 2m35s``;
- ``show=False`` (a stage's ``--no-progress``): nothing.

A reporter only formats what it is given: the training loop passes values it has already
read from the device (at ``log_every``), so progress adds no host sync to a step.
"""

from __future__ import annotations

import enum
import sys
import time
from types import TracebackType
from typing import Any, TextIO

# Seconds between two one-line updates in a log: often enough to see that work goes on,
# rarely enough that an hour of training is about 200 lines.
REPORT_EVERY_S = 20.0


class Mode(enum.StrEnum):
    AUTO = "auto"  # BAR on a terminal, LINES elsewhere
    BAR = "bar"
    LINES = "lines"
    OFF = "off"


def now() -> float:
    """The reporters' clock (monotonic seconds); tests replace it with a fake one."""
    return time.monotonic()


def _console(stream: TextIO | None) -> Any:
    from rich.console import Console

    return Console(file=stream) if stream is not None else Console(stderr=True)


def choose(show: bool | Mode | str, stream: TextIO | None = None) -> Mode:
    """The mode ``show`` asks for; ``True``/``AUTO`` is :attr:`Mode.BAR` where ``stream``
    (default stderr) is a terminal that understands cursor moves (rich decides, so
    ``FORCE_COLOR``/``TTY_COMPATIBLE`` apply) and :attr:`Mode.LINES` elsewhere."""
    if show is False:
        return Mode.OFF
    mode = Mode.AUTO if show is True else Mode(show)
    if mode != Mode.AUTO:
        return mode
    console = _console(stream)
    return Mode.BAR if console.is_terminal and not console.is_dumb_terminal else Mode.LINES


def duration(seconds: float) -> str:
    """``4.2s``, ``45s``, ``2m35s``, ``1h02m``."""
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Reporter:
    """Progress of ``total`` units of work named ``label`` (module docstring).

    ``done``: units already done before this process started (a resumed run); the rate
    and ETA count only the units done here. ``every_s``: seconds between two update lines
    (0: a line at every :meth:`advance`, for a few coarse steps). ``info``: a short text
    shown after the count (``loss 5.12``), replaced by :meth:`update`.
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        unit: str = "step",
        units: str | None = None,
        done: int = 0,
        info: str = "",
        show: bool | Mode | str = True,
        every_s: float = REPORT_EVERY_S,
        stream: TextIO | None = None,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.units = units or f"{unit}s"
        self.done = self._start_done = done
        self.info = info
        self.every_s = every_s
        self.stream = stream
        self.mode = choose(show, stream)
        self._bar: Any = None
        self._task: Any = None
        self._started = self._last_line = 0.0

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> Reporter:
        self._started = self._last_line = now()
        if self.mode == Mode.BAR:
            self._bar = self._make_bar()
            self._bar.start()
            self._task = self._bar.add_task(
                self.label, total=self.total, completed=self.done, info=self.info
            )
        elif self.mode == Mode.LINES:
            self._write(self.status())
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.mode == Mode.BAR and self._bar is not None:
            self._bar.stop()
        elif self.mode == Mode.LINES and kind is None:
            self._write(self.status(final=True))

    # ----------------------------------------------------------------- updates

    def advance(self, n: int = 1) -> None:
        """``n`` more units done."""
        self.done += n
        if self.mode == Mode.BAR:
            self._bar.update(self._task, completed=self.done)
        elif self.mode == Mode.LINES:
            self.tick()

    def start_at(self, done: int) -> None:
        """``done`` units turn out to be done before this process (a resumed search's
        finished trials, known once it runs): the rate and ETA leave them out."""
        self.done = self._start_done = done
        if self.mode == Mode.BAR:
            self._bar.update(self._task, completed=self.done)

    def update(self, info: str | None = None, total: int | None = None) -> None:
        """Replace the info text (and the total); shown with the next update."""
        if info is not None:
            self.info = info
        if total is not None:
            self.total = total
        if self.mode == Mode.BAR:
            self._bar.update(self._task, info=self.info, total=self.total)

    def tick(self) -> None:
        """Write the update line if one is due (in a log); :meth:`advance` calls it. Work
        that advances rarely calls it more often, so a log still hears from it."""
        if self.mode != Mode.LINES or (self.total and self.done >= self.total):
            return  # all done: the final line follows
        t = now()
        if t - self._last_line >= self.every_s:
            self._write(self.status())
            self._last_line = t

    def note(self, text: str) -> None:
        """A line of its own (a validation result, a finished trial): above the bar on a
        terminal, in the log otherwise."""
        if self.mode == Mode.BAR:
            self._bar.console.print(f"{self.label}: {text}", markup=False, highlight=False)
        elif self.mode == Mode.LINES:
            self._write(f"{self.label}: {text}")

    # ----------------------------------------------------------------- text

    def status(self, final: bool = False) -> str:
        """The update line: ``<label>: <unit> <done>/<total> (<pct>%), <info>, <rate>,
        ETA <eta>``; at the end ``... in <elapsed>``."""
        count = f"{self.unit} {self.done:,}"
        if self.total:
            count += f"/{self.total:,} ({100 * self.done / self.total:.0f}%)"
        parts = [("finished " if final else "") + count]
        if self.info:
            parts.append(self.info)
        elapsed = now() - self._started
        if final:
            return f"{self.label}: {', '.join(parts)} in {duration(elapsed)}"
        progressed = self.done - self._start_done
        if progressed > 0 and elapsed > 0:
            rate = progressed / elapsed
            parts.append(
                f"{rate:.3g} {self.units}/s" if rate >= 1 else f"{1 / rate:.3g} s/{self.unit}"
            )
            if self.total and self.done < self.total:
                parts.append(f"ETA {duration((self.total - self.done) / rate)}")
        return f"{self.label}: {', '.join(parts)}"

    def _write(self, line: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(line, file=stream, flush=True)

    def _make_bar(self) -> Any:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=_console(self.stream),
            transient=True,
        )
