"""Stop signals (``pipeline/signals.py``): raised at once for the block of
``stop_on_signals``, deferred by a ``StopRequest`` to where its caller polls. Raised in this
process: the tests run on the main thread, which alone may set handlers. The deferred ones
are SIGTERMs: an xdist worker ignores SIGINT and ``nohup`` SIGHUP, and an ignored signal
stays ignored."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from pipeline.signals import (
    STACKS_SIGNAL,
    STOP_SIGNALS,
    Interrupted,
    StopRequest,
    signal_number,
    stop_on_signals,
)


def test_stop_on_signals_raises_for_the_block_and_restores_the_handlers() -> None:
    """SIGTERM inside the block raises ``Interrupted`` (a ``KeyboardInterrupt``) with its
    number; an ignored SIGHUP (``nohup``) stays ignored; the old handlers come back."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            with pytest.raises(Interrupted) as caught:
                signal.raise_signal(signal.SIGTERM)
            assert caught.value.signum == signal.SIGTERM
            assert isinstance(caught.value, KeyboardInterrupt)
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before[signal.SIGHUP])


def test_a_stop_request_records_the_first_signal_and_raises_at_the_second() -> None:
    """Inside ``deferred`` the first stop signal is only recorded (the caller polls it);
    a second raises at once; the handlers come back after the block."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    request = StopRequest()
    with pytest.raises(Interrupted) as caught, request.deferred():
        signal.raise_signal(signal.SIGTERM)
        assert request.signum == signal.SIGTERM  # recorded, nothing raised
        signal.raise_signal(signal.SIGTERM)
        pytest.fail("a second stop signal raises at once")
    assert signal_number(caught.value) == signal.SIGTERM
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def test_a_stop_request_the_caller_never_polled_raises_when_the_block_ends() -> None:
    request = StopRequest()
    with pytest.raises(Interrupted) as caught, request.deferred():
        signal.raise_signal(signal.SIGTERM)
    assert caught.value.signum == signal.SIGTERM
    with StopRequest().deferred():  # no signal: nothing raised
        pass


def test_a_plain_ctrl_c_is_sigint() -> None:
    assert signal_number(KeyboardInterrupt()) == signal.SIGINT


def test_a_stage_prints_its_stacks_on_sigusr2_and_goes_on() -> None:
    """``kill -USR2 <pid>`` on a stage (what ``ensure_project_interpreter`` sets up in every
    ``python -m stages.<name>``) prints where each thread is, and the stage goes on."""
    code = (
        "import sys, time\n"
        "from stages import ensure_project_interpreter\n"
        "ensure_project_interpreter('stages.waiting')\n"
        "print('ready', flush=True)\n"
        "def waiting_here():\n"
        "    time.sleep(60)\n"
        "waiting_here()\n"
        "print('went on', flush=True)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        time.sleep(0.5)  # into the sleep
        process.send_signal(STACKS_SIGNAL)
        time.sleep(1)
        assert process.poll() is None  # it goes on
    finally:
        process.kill()
        _, stderr = process.communicate(timeout=30)
    assert "Current thread" in stderr and "line 6 in waiting_here" in stderr, stderr
