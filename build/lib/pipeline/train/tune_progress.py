"""Progress of a Ray Tune search: a line per finished trial, and the trials done of all.

Each finished trial gets one line with its sampled values and the best value of what the
search selects on (``RunParams.select_by``: ``tune hier-chitchat: trial 3/8 a1b2c3d4
finished after 1/1 epochs: valid loss 4.98 (best so far); model.n_heads=2
model.dropout=0.243``); in a log a status line every ``progress.REPORT_EVERY_S`` seconds
says how many trials are done and running and the best value so far; on a terminal a bar
over the trials (``pipeline.progress``). This replaces Ray Tune's own reporter
(``verbose=0``), whose tables take about 25 lines per trial in a log.

Ray pickles a search's callbacks with the search and restores them when it resumes, so
:class:`TrialProgress` holds no state: it reports to the search under way in this process,
which :func:`reporting` sets up around ``Tuner.fit()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ray import tune

from pipeline.config import Selection
from pipeline.progress import Mode, Reporter


@dataclass
class _Search:
    bar: Reporter
    epochs: int
    select: Selection
    best: float = math.nan
    synced: bool = False  # trials restored as finished counted (first loop step)

    @property
    def shown(self) -> str:
        """What the lines call the value (``valid loss``, ``valid score``)."""
        return self.select.metric.replace("_", " ")

    def better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if not math.isfinite(self.best):
            return True
        return value > self.best if self.select.higher_is_better else value < self.best


_current: _Search | None = None


@contextmanager
def reporting(
    label: str,
    trials: int,
    epochs: int,
    select: Selection = Selection.VALID_LOSS,
    show: bool | Mode = True,
) -> Iterator[None]:
    """Report the trials of the search run inside the block (``trials`` in all, each of
    at most ``epochs`` epochs, ranked by ``select``) through :class:`TrialProgress`."""
    global _current
    search = _Search(Reporter(label, trials, unit="trial", show=show), epochs, select)
    with search.bar:
        _current = search
        try:
            yield
        finally:
            _current = None


def _finished(trials: list[Any]) -> int:
    return sum(1 for t in trials if t.status in ("TERMINATED", "ERROR"))


def _values(config: dict[str, Any], prefix: str = "") -> list[str]:
    """``{"model": {"n_heads": 2}}`` -> ``["model.n_heads=2"]`` (floats to 3 digits)."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += _values(value, f"{prefix}{key}.")
        else:
            shown = f"{value:.3g}" if isinstance(value, float) else str(value)
            out.append(f"{prefix}{key}={shown}")
    return out


def trial_line(search: _Search, trial: Any, failed: bool, done: int) -> str:
    """The line of one finished trial (module docstring); updates the best value."""
    result = trial.last_result or {}
    metric = search.select.metric
    analysis = (trial.metric_analysis or {}).get(metric, {})
    value = analysis.get(search.select.mode, result.get(metric, math.nan))
    epochs = int(result.get("training_iteration", 0))
    total = search.bar.total or "?"
    head = f"trial {done}/{total} {trial.trial_id}"
    sampled = " ".join(_values(dict(trial.config))) or "(no sampled values)"
    after = f"after {epochs}/{search.epochs} epochs"
    if failed:
        where = getattr(trial, "error_file", None) or "in the log above"
        return f"{head} failed {after} (error: {where}); {sampled}"
    if result.get("invalid"):
        return f"{head} skipped: an invalid configuration; {sampled}"
    how = "finished" if epochs >= search.epochs else "stopped early by ASHA"
    if search.better(value):
        search.best, mark = value, "best so far"
    else:
        mark = f"best {search.best:.4g}"
    return f"{head} {how} {after}: {search.shown} {value:.4g} ({mark}); {sampled}"


class TrialProgress(tune.Callback):
    """Reports to the search under way (:func:`reporting`); stateless (module docstring)."""

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        search = _current
        if search is None:
            return
        if not search.synced:  # a resumed search: its finished trials were done before
            search.synced = True
            search.bar.start_at(_finished(trials))
        running = sum(1 for t in trials if t.status == "RUNNING")
        best = f", best {search.shown} {search.best:.4g}" if math.isfinite(search.best) else ""
        search.bar.update(info=f"{running} running{best}")
        search.bar.tick()

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._report(trials, trial, failed=False)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._report(trials, trial, failed=True)

    def _report(self, trials: list[Any], trial: Any, failed: bool) -> None:
        search = _current
        if search is None:
            return
        # Ray marks the trial finished after its callbacks: count it here
        done = max(_finished(trials), search.bar.done + 1)
        search.bar.note(trial_line(search, trial, failed, done))
        search.bar.advance(done - search.bar.done)
