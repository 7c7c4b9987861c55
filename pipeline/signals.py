"""Signals that stop a process: Ctrl-C (SIGINT), SIGTERM (``kill``, a Slurm cancel) and
SIGHUP (a closed terminal), each raised as a ``KeyboardInterrupt`` so that one stop path
handles them all.

Two ways to take them. :func:`stop_on_signals` raises at once (``make repro``'s driver,
which relays the stop to its stages). :class:`StopRequest` defers the stop to a point the
caller chooses: an in-process training finishes its step, checkpoints it and then raises,
so the stage resumes where it stopped instead of at its last periodic checkpoint. A
process ends with 128 + the signal's number (:func:`signal_number`), as the shell reports
a process the signal killed.

One signal does not stop: :data:`STACKS_SIGNAL` (``kill -USR2 <pid>``) makes a stage or
``make repro``'s driver that seems stuck print every thread's Python stack to its stderr
and go on (:func:`print_stacks_on_request`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

Handler = Callable[[int, FrameType | None], None]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# SIGUSR1 is Ray Tune's stop request (``tune.Tuner.fit`` takes it in the driver)
STACKS_SIGNAL = signal.SIGUSR2


def print_stacks_on_request() -> None:
    """From now on, :data:`STACKS_SIGNAL` prints every thread's Python stack to stderr
    (Python's ``faulthandler``, at any point, in a C call too), which DVC and ``make
    repro`` show; the process goes on."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP (or a deferred SIGINT), raised where Ctrl-C raises
    ``KeyboardInterrupt``: one stop path."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_number(stop: KeyboardInterrupt) -> int:
    """The signal behind ``stop``: SIGINT for a plain ``KeyboardInterrupt`` (Ctrl-C)."""
    return stop.signum if isinstance(stop, Interrupted) else signal.SIGINT


@contextlib.contextmanager
def _handling(signals: tuple[int, ...], handler: Handler) -> Iterator[None]:
    """``handler`` for ``signals`` in the block, the previous handlers back afterwards. A
    signal already ignored (``nohup``'s SIGHUP) stays ignored; off the main thread, which
    alone may set handlers, nothing changes."""
    previous: dict[int, Handler | int | None] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_on_signals() -> contextlib.AbstractContextManager[None]:
    """For the block, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread (as
    SIGINT raises ``KeyboardInterrupt``)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    return _handling((signal.SIGTERM, signal.SIGHUP), stop)


class StopRequest:
    """A stop deferred to where the caller asks for it (:attr:`signum`): inside
    :meth:`deferred`, the first of :data:`STOP_SIGNALS` is only recorded; a second one
    raises at once (a user who presses Ctrl-C twice means it). The caller polls
    :attr:`signum` and raises :class:`Interrupted` itself; a request it never reached
    (after its last poll) raises when the block ends."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        def record(signum: int, frame: FrameType | None) -> None:
            if self.signum is not None:
                raise Interrupted(signum)
            self.signum = signum

        with _handling(STOP_SIGNALS, record):
            yield
        if self.signum is not None:
            raise Interrupted(self.signum)
