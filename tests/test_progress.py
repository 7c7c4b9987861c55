"""``pipeline.progress``: the bar on a terminal, periodic lines in a log, silence when off."""

from __future__ import annotations

import io

import pytest

from pipeline import progress
from pipeline.progress import Mode, Reporter, choose, duration


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """``progress.now`` returns ``clock[0]``; tests move it."""
    now = [100.0]
    monkeypatch.setattr(progress, "now", lambda: now[0])
    return now


@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm")


def test_duration():
    assert [duration(s) for s in (0.04, 4.25, 45.4, 155, 3725)] == [
        "0.0s",
        "4.2s",
        "45s",
        "2m35s",
        "1h02m",
    ]


def test_mode_follows_the_stream(plain_env):
    assert choose(True, Terminal()) == Mode.BAR
    assert choose(True, io.StringIO()) == Mode.LINES
    assert choose(False, Terminal()) == Mode.OFF
    assert choose("lines", Terminal()) == Mode.LINES


def test_a_log_gets_a_line_every_few_seconds(clock):
    log = io.StringIO()
    with Reporter("work", 100, unit="batch", units="batches", every_s=20, stream=log) as bar:
        for _ in range(100):
            clock[0] += 0.5  # 2 batches/s: a line every 40 batches
            bar.advance()
            if bar.done == 50:
                bar.update(info="half way")
                bar.note("a validation")
    assert log.getvalue().splitlines() == [
        "work: batch 0/100 (0%)",
        "work: batch 40/100 (40%), 2 batches/s, ETA 30s",
        "work: a validation",
        "work: batch 80/100 (80%), half way, 2 batches/s, ETA 10s",
        "work: finished batch 100/100 (100%), half way in 50s",
    ]


def test_tick_reports_work_that_advances_rarely(clock):
    log = io.StringIO()
    with Reporter("tune", 4, unit="trial", every_s=20, stream=log, done=1) as bar:
        for _ in range(5):
            clock[0] += 10
            bar.tick()
        bar.advance()
    lines = log.getvalue().splitlines()
    assert lines[1:3] == ["tune: trial 1/4 (25%)", "tune: trial 1/4 (25%)"]  # no rate yet
    # the rate counts only this process's trials (a resumed search started at 1)
    assert lines[-1] == "tune: finished trial 2/4 (50%) in 50s"


def test_slow_work_shows_seconds_per_unit(clock):
    log = io.StringIO()
    with Reporter("train", 10, every_s=0, stream=log) as bar:
        clock[0] += 40
        bar.advance()
    assert log.getvalue().splitlines()[1] == "train: step 1/10 (10%), 40 s/step, ETA 6m00s"


def test_an_error_leaves_no_finished_line(clock):
    log = io.StringIO()
    with pytest.raises(RuntimeError), Reporter("work", 3, stream=log) as bar:
        bar.advance()
        raise RuntimeError("boom")
    assert "finished" not in log.getvalue()


def test_a_terminal_gets_a_bar_and_notes_above_it(clock, plain_env):
    screen = Terminal()
    with Reporter("work", 4, stream=screen) as bar:
        assert bar.mode == Mode.BAR
        bar.advance(3)
        bar.update(info="loss 1.5")
        bar.note("valid loss 1.2 (best)")
    drawn = screen.getvalue()
    assert "━" in drawn and "3/4" in drawn and "loss 1.5" in drawn
    assert "work: valid loss 1.2 (best)" in drawn
    assert "\x1b[" in drawn  # cursor moves: drawn in place, erased at the end


def test_off_is_silent(clock):
    log = io.StringIO()
    with Reporter("work", 2, show=False, stream=log) as bar:
        bar.advance(2)
        bar.update(info="x")
        bar.note("y")
        bar.tick()
    assert log.getvalue() == ""
