"""The rules between one run's knobs: what a knob does depends on others, perhaps set at
other levels (``train.defaults`` < ``train.models.<m>`` < a run's overrides, or a tune
space), so each rule reads a run's merged knobs, as the run will train.

- :func:`knob_problem`: rules on the knobs alone (averaging against ``epochs``, the
  schedule's keys against its kind, ``min_lr`` against each parameter group's ``lr``, the
  cosine's decay against its warm-up), and those of :func:`step_problem` that hold
  whatever the run's epochs turn out to hold (at least a step each, at most
  ``max_batches_per_epoch``). The params check (``pipeline.plan.check``) applies them to
  every run, train and tuned, a tuned run's trials and its search space's extremes
  included.
- :func:`step_problem`: rules that need the planned steps per epoch (averaging that would
  begin before the warm-up ends or at a learning rate of 0, a cosine decay no longer than
  its warm-up, a warm-up of any schedule that outlasts the run, averaging that
  ``max_steps`` cuts off). The training loop applies them
  once it has planned its epochs, before the first step (``train.run_checks``);
  :func:`patience_note` says when patience may stop a run before averaging begins.

A rule names knobs through a :data:`Name` (``"train.models.gpt.averaging.epochs = 2"``
where the caller knows the level that sets it), so that every refusal names each level
that contributed; the knob it returns is the one its error is keyed on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.config.sections import Section
from pipeline.config.train import AveragingKind, RunParams, ScheduleKind, ScheduleParams

# How a message names a knob (a dotted name of RunParams: "schedule.min_lr"), with its value.
Name = Callable[[str], str]

WARMUP_KINDS = (ScheduleKind.LINEAR_WARMUP, ScheduleKind.NOAM, ScheduleKind.COSINE)
_DEFAULT_SCHEDULE = ScheduleParams()


@dataclass(frozen=True)
class KnobProblem:
    """A rule the knobs break: ``knob`` (dotted, of ``RunParams``) is the one to key the
    error on; ``reason`` names the others and says what to do."""

    knob: str
    reason: str


def knob_value(knobs: Section, dotted: str) -> Any:
    """The value of a dotted knob (``schedule.min_lr``) of ``knobs``."""
    value: Any = knobs
    for part in dotted.split("."):
        value = getattr(value, part)
    return value.value if hasattr(value, "value") else value


def names_from(
    knobs: RunParams, source: Callable[[str], str], notes: Mapping[str, str] | None = None
) -> Name:
    """Knobs of ``knobs`` named by the params key that sets each (``source``) and their
    value, and a ``notes`` of their own (a search's extreme): ``train.defaults.epochs =
    2``."""

    def name(knob: str) -> str:
        value = knob_value(knobs, knob)
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        return f"{source(knob)} = {shown}{(notes or {}).get(knob, '')}"

    return name


@dataclass(frozen=True)
class EpochSteps:
    """The optimizer steps of each epoch of a run: exactly ``low`` when ``low == high``
    (the loop, once its epochs are planned), else between ``low`` and ``high`` (None: no
    bound), as the params say before the data exists. ``words`` says how it is known."""

    low: int
    high: int | None
    words: str

    @property
    def exact(self) -> bool:
        return self.low == self.high

    @classmethod
    def planned(cls, batches: int, knobs: RunParams) -> EpochSteps:
        """A run's steps per epoch from its epoch's batch count (the first epoch's, for
        batches by tokens), cut to ``max_batches_per_epoch``."""
        cap = knobs.max_batches_per_epoch
        steps = batches if cap is None else min(batches, cap)
        return cls(steps, steps, f"{steps} steps an epoch")

    @classmethod
    def bounds(cls, knobs: RunParams, name: Name) -> EpochSteps:
        """What the params alone say: at least one step an epoch, at most
        ``max_batches_per_epoch``."""
        cap = knobs.max_batches_per_epoch
        if cap is None:
            return cls(1, None, "the data's steps an epoch")
        return cls(1, cap, f"at most {cap} steps an epoch: {name('max_batches_per_epoch')}")


def knob_problem(knobs: RunParams, name: Name) -> KnobProblem | None:
    """The first rule the merged ``knobs`` break whatever the data (module docstring)."""
    avg, schedule, lr = knobs.averaging, knobs.schedule, knobs.optimizer.lr
    averaging = avg.kind != AveragingKind.NONE
    if averaging and avg.epochs > knobs.epochs:
        return KnobProblem(
            "averaging.epochs",
            f"{avg.epochs} averaged epochs in a run of {name('epochs')} epochs: make it at "
            f"most {knobs.epochs} ({knobs.epochs - 1} with a warm-up schedule), or raise epochs",
        )
    if schedule.kind != ScheduleKind.COSINE:
        for key in ("min_lr", "decay_steps"):
            if getattr(schedule, key) != getattr(_DEFAULT_SCHEDULE, key):
                return KnobProblem(
                    f"schedule.{key}",
                    f"{getattr(schedule, key)} applies to the cosine schedule only, and "
                    f"{name('schedule.kind')} would ignore it: set schedule.kind: cosine, "
                    f"or {key}: {_as_params(getattr(_DEFAULT_SCHEDULE, key))} (its default)",
                )
    if schedule.kind == ScheduleKind.COSINE:
        if schedule.min_lr > lr:
            return KnobProblem(
                "schedule.min_lr",
                f"{schedule.min_lr:g} is above {name('optimizer.lr')}: the cosine decays from "
                f"lr down to min_lr; make min_lr at most {lr:g} (about lr / 3 in the "
                "Transformer-XL recipe), or raise lr",
            )
        embedding_lr = lr * knobs.optimizer.embedding_lr_multiplier
        if schedule.min_lr > embedding_lr:
            return KnobProblem(
                "schedule.min_lr",
                f"{schedule.min_lr:g} is above the token embedding's learning rate "
                f"{embedding_lr:g} ({name('optimizer.embedding_lr_multiplier')} x lr): the "
                "cosine takes every weight down to min_lr; make min_lr at most "
                f"{embedding_lr:g}, or raise the multiplier",
            )
        if schedule.decay_steps is not None and schedule.decay_steps <= schedule.warmup_steps:
            return KnobProblem(
                "schedule.decay_steps",
                f"{schedule.decay_steps} must exceed {name('schedule.warmup_steps')}: it "
                "counts from the first step, warm-up included",
            )
    steps = EpochSteps.bounds(knobs, name)
    return step_problem(knobs, steps, name)


def step_problem(knobs: RunParams, steps: EpochSteps, name: Name) -> KnobProblem | None:
    """The first rule that needs the steps per epoch which ``knobs`` break for every count
    ``steps`` allows (all of them once the loop has planned its epochs)."""
    avg, schedule = knobs.averaging, knobs.schedule
    warmup = schedule.warmup_steps if schedule.kind in WARMUP_KINDS else 1
    # rules that break more easily with more steps an epoch hold for sure at the fewest,
    # those that break more easily with fewer at the most (None: unknown, so not for sure)
    fewest = _Steps(knobs, steps.low)
    most = _Steps(knobs, steps.high)
    averaging = avg.kind != AveragingKind.NONE
    if averaging and most.average_from is not None and most.average_from + 1 < warmup:
        begins = most.averaging_begins(steps)
        # the warm-up's factor where it stops: (step + 1) / warmup (Noam's too, scaled to
        # peak at 1: optim.lr_factor)
        factor = (most.average_from + 1) / warmup
        shorter = (
            f", lower warmup_steps to at most {most.average_from + 1}"
            if most.average_from > 0
            else ""
        )
        return KnobProblem(
            "averaging.epochs",
            f"averaging ({_last(avg.epochs)} of {name('epochs')}) begins {begins}, "
            f"before the warm-up ends ({name('schedule.warmup_steps')}, "
            f"{name('schedule.kind')}): the schedule stops there, so the rest of the run "
            f"trains at {factor:.3g} x optimizer.lr. Average fewer epochs{shorter}, or set "
            "schedule.kind: none",
        )
    if schedule.kind == ScheduleKind.COSINE and averaging and schedule.min_lr == 0.0:
        start = fewest.average_from
        assert start is not None  # the fewest steps are known
        decay = schedule.decay_steps or fewest.cosine_default_decay
        if start + 1 >= decay:
            where = (
                f"at step {decay} ({name('schedule.decay_steps')})"
                if schedule.decay_steps is not None
                else "where averaging begins (schedule.decay_steps: null, the planned steps "
                "before averaging)"
            )
            latest = most.average_from  # the fix must hold for every count of steps
            past = "past the step averaging begins"
            past = f"above {latest + 1}, {past}" if latest is not None else past
            return KnobProblem(
                "schedule.min_lr",
                f"the cosine reaches {name('schedule.min_lr')} {where}, so averaging "
                f"({_last(avg.epochs)} of {name('epochs')}), which begins "
                f"{fewest.averaging_begins(steps)}, trains at a learning rate of 0: the "
                "average never moves. Set min_lr above 0 (the Transformer-XL recipe: lr / 3), "
                f"or decay_steps {past}",
            )
    if schedule.kind == ScheduleKind.COSINE and schedule.decay_steps is None:
        decay = most.cosine_default_decay
        if decay is not None and decay <= schedule.warmup_steps:
            return KnobProblem(
                "schedule.warmup_steps",
                "the cosine decays over the run's planned steps"
                f"{' before averaging' if averaging else ''} (schedule.decay_steps: null), "
                f"{most.decay_words(steps)}, which do not exceed "
                f"{name('schedule.warmup_steps')}: the learning rate never passes "
                f"{decay / schedule.warmup_steps:.3g} x optimizer.lr and never decays. Lower "
                "warmup_steps (a tenth of the run is usual), set decay_steps, or train longer",
            )
    if schedule.kind == ScheduleKind.COSINE and schedule.decay_steps is not None:
        total = most.total
        if total is not None and total <= schedule.warmup_steps:
            return KnobProblem(
                "schedule.warmup_steps",
                f"the run's {most.total_words(steps)} end before the warm-up "
                f"({name('schedule.warmup_steps')}) does: the learning rate never passes "
                f"{total / schedule.warmup_steps:.3g} x optimizer.lr and never decays "
                f"({name('schedule.decay_steps')} lies beyond the run). Lower warmup_steps (a "
                "tenth of the run is usual), or train longer",
            )
    if schedule.kind in (ScheduleKind.LINEAR_WARMUP, ScheduleKind.NOAM):
        total = most.total
        if total is not None and total <= schedule.warmup_steps:
            # both peak at the warm-up's last step: (step + 1) / warmup before it
            # (Noam's scaled to peak at 1: optim.lr_factor)
            return KnobProblem(
                "schedule.warmup_steps",
                f"the run's {most.total_words(steps)} end before the warm-up "
                f"({name('schedule.warmup_steps')}, {name('schedule.kind')}) does: the "
                f"learning rate never passes {total / schedule.warmup_steps:.3g} x "
                "optimizer.lr, the peak the schedule is set for. Lower warmup_steps (a tenth "
                "of the run is usual), or train longer",
            )
    if averaging and knobs.max_steps is not None:
        start = fewest.average_from
        assert start is not None
        if knobs.max_steps <= start:
            return KnobProblem(
                "max_steps",
                f"{knobs.max_steps} ends the run before averaging ({_last(avg.epochs)} of "
                f"{name('epochs')}) begins {fewest.averaging_begins(steps)}: the "
                f"run would never average. Raise max_steps above {start}, remove it, or "
                "average more epochs",
            )
    return None


def patience_note(knobs: RunParams, steps: EpochSteps, name: Name) -> str | None:
    """A sentence for the start of a run whose patience may stop it before averaging
    begins (``steps`` exact), else None."""
    avg, patience = knobs.averaging, knobs.patience
    if avg.kind == AveragingKind.NONE or patience is None or not steps.exact:
        return None
    start = _Steps(knobs, steps.low).average_from
    assert start is not None
    # the loop validates at each epoch's end and every eval_every steps
    validations = {steps.low * e for e in range(1, knobs.epochs - avg.epochs + 1)}
    if knobs.eval_every is not None:
        validations |= set(range(knobs.eval_every, start + 1, knobs.eval_every))
    evaluations = len(validations)
    if evaluations <= patience:  # the first evaluation always improves
        return None
    return (
        f"{name('patience')} may stop this run before averaging begins at step {start}: "
        f"{evaluations} validations come before it, and {patience} in a row without "
        "improvement stop the run; averaging would then never begin (the train record and "
        "the report say so). patience: null always reaches it"
    )


class _Steps:
    """Step counts of a run of ``knobs`` at ``per_epoch`` steps an epoch (None: unknown)."""

    def __init__(self, knobs: RunParams, per_epoch: int | None) -> None:
        self.knobs, self.per_epoch = knobs, per_epoch
        self.before = knobs.epochs - knobs.averaging.epochs  # epochs before averaging
        if knobs.averaging.kind == AveragingKind.NONE:
            self.before = knobs.epochs

    @property
    def average_from(self) -> int | None:
        """The step at which averaging begins (None: unknown, beyond any bound)."""
        if self.before <= 0:
            return 0
        return None if self.per_epoch is None else self.before * self.per_epoch

    @property
    def cosine_default_decay(self) -> int | None:
        """The cosine's decay steps when params leave them to the run: the planned steps
        before averaging (all of them without), cut at ``max_steps``."""
        steps = self.average_from if self.before > 0 else 0
        cap = self.knobs.max_steps
        if steps is None:
            return cap
        return steps if cap is None else min(steps, cap)

    def averaging_begins(self, steps: EpochSteps) -> str:
        start = self.average_from
        if self.before <= 0:
            return "at step 0 (it covers every epoch)"
        epoch = f"epoch {self.before + 1} of {self.knobs.epochs}"
        if steps.exact:
            return f"at step {start} ({epoch}, {steps.words})"
        if self.per_epoch == steps.low:
            return f"at step {start} at the earliest ({epoch}, at least 1 step an epoch)"
        return f"by step {start} at the latest ({epoch}, {steps.words})"

    @property
    def total(self) -> int | None:
        """The run's planned steps, cut at ``max_steps`` (None: unknown)."""
        cap = self.knobs.max_steps
        if self.per_epoch is None:
            return cap
        steps = self.per_epoch * self.knobs.epochs
        return steps if cap is None else min(steps, cap)

    def total_words(self, steps: EpochSteps) -> str:
        """:attr:`total` and where it comes from."""
        if self.knobs.max_steps is not None and self.total == self.knobs.max_steps:
            return f"{self.total} planned steps (max_steps)"
        exactly = "" if steps.exact else "at most "
        epochs = "1 epoch" if self.knobs.epochs == 1 else f"{self.knobs.epochs} epochs"
        return f"{exactly}{self.total} planned steps ({epochs}, {steps.words})"

    def decay_words(self, steps: EpochSteps) -> str:
        """The cosine's default decay steps, and where they come from."""
        decay, cap = self.cosine_default_decay, self.knobs.max_steps
        if cap is not None and decay == cap:
            return f"{decay} (max_steps)"
        exactly = "" if steps.exact else "at most "
        epochs = "1 epoch" if self.before == 1 else f"{self.before} epochs"
        return f"{exactly}{decay} ({epochs}, {steps.words})"


def _as_params(value: Any) -> str:
    """A value as params spell it."""
    return "null" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _last(epochs: int) -> str:
    return "the last epoch" if epochs == 1 else f"the last {epochs} epochs"
