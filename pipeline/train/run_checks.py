"""What a run's knobs do with its real step count, checked once the loop has planned its
epochs and before the first step, and by the train stage before it opens a seed's MLflow
run (``train.training.check_planned_steps``; the params check decides what it can without
the data: ``pipeline.plan.check``).

``config.run_rules.step_problem`` refuses averaging that would begin before the warm-up
ends or at a learning rate of 0, a cosine decay no longer than its warm-up, a warm-up that
outlasts the run, and averaging that ``max_steps`` cuts off; the error is keyed on the
params key that sets the knob to change, and names the run (where the caller's message
does not) and every other knob with the key that sets it (the plan's ``sources``).
``patience_note`` says at the start when patience may stop the run before averaging
begins.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.config import RunParams
from pipeline.config.run_rules import EpochSteps, names_from, patience_note, step_problem
from pipeline.errors import ConfigError


def planned_step_notes(
    knobs: RunParams, batches: int, sources: Mapping[str, str], run: str
) -> list[str]:
    """Check ``knobs`` at ``batches`` training batches an epoch (the first epoch's, with
    batches by tokens) before the first step: a ``ConfigError`` for a rule they break
    (``sources``: the params key of each knob, where known; ``run`` names the run, unless
    empty: the caller's message names it), else the notes to show at the start."""
    name = names_from(knobs, lambda knob: sources.get(knob, knob))
    steps = EpochSteps.planned(batches, knobs)
    problem = step_problem(knobs, steps, name)
    if problem is not None:
        reason = f"{run}: {problem.reason}" if run else problem.reason
        raise ConfigError(sources.get(problem.knob, problem.knob), reason)
    note = patience_note(knobs, steps, name)
    return [] if note is None else [note]
