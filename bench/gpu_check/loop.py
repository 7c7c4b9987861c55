"""The loop's parts: the paper profile's PTB runs through the project's own loop
(``plan_training`` -> ``train_job`` -> ``train_local``), each training a process of its own.

- **throughput** (``loop``): ``gpt-ptb`` alone, then ``Setup.processes`` copies of it at
  once on the one device: steady tokens/s and steps/s per process and in all, the overlap
  of the processes, MFU by 6 x parameters x tokens; its rate goes to ``Check.loop_rate``.
  A smoke run compiles the step (``compile: on``, Inductor) where the CPU's ``auto`` would
  not: the compiled loop's code paths, short of CUDA;
- **four runs** (``four``, issue 33): ``gpt``, ``congruent_gpt``, ``hgpt`` and
  ``congruent_hgpt`` on PTB with the profile's recipe, at once, for as many whole epochs as
  the part's budget fits (from ``Check.loop_rate``); the epoch time measured between
  evaluations, and the profile's whole run projected from it.

Processes that share the GPU each get an equal share of its free memory
(``processes.run_at_once``), within which validation finds its largest batch.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Any

from bench.common import number, table
from bench.gpu_check.processes import Outcome, Rate, loop_job, run_at_once, shared
from bench.gpu_check.ptb import RUNS, knobs_line, parameters, steps_per_epoch
from bench.gpu_check.report import Check, Headline, LoopRate, Part, Setup
from pipeline.config import AveragingKind, CompileMode, RunParams
from pipeline.eval.perplexity import perplexity_of
from pipeline.execution import ExecutionOverrides
from pipeline.plan import RunPlan
from pipeline.train.loop import TrainJob

# Issue 32: four 6-layer PTB runs at once on one H200, about 12 steps/s and 161k tokens/s each.
BASELINE_EACH_TOKENS, BASELINE_EACH_STEPS, BASELINE_PROCESSES = 161e3, 12.0, 4
TARGET_FACTOR = 3.0  # the loop at least 3x the baseline's tokens/s per GPU, all trainings counted


@dataclass(frozen=True)
class LoopSizes:
    """Steps of the throughput part and the logging that measures them."""

    steps: int
    log_every: int
    warmup_windows: int
    max_batches_per_epoch: int | None


GPU_LOOP = LoopSizes(steps=200, log_every=10, warmup_windows=3, max_batches_per_epoch=None)
TOY_LOOP = LoopSizes(steps=6, log_every=1, warmup_windows=1, max_batches_per_epoch=3)


def _job(plan: RunPlan, setup: Setup, name: str) -> TrainJob:
    """The plan's job in ``<scratch>/<name>``, compiling (where the plan compiles) with the
    check's backend."""
    return loop_job(plan, setup.scratch / name, execution=ExecutionOverrides(setup.loop_backend))


def _limit(check: Check, part: Part) -> float:
    """Seconds the part's processes may run before they are killed: twice its budget (six
    times in a smoke run, whose processes' start-up alone can take most of a minute on a
    busy 2-core machine), and never past the check's time limit."""
    return max(1.0, min(part.budget_s * (6 if check.setup.smoke else 2), check.seconds_left()))


def _errors(outcomes: list[Outcome]) -> str | None:
    failed = [f"{o.label}: {o.error}" for o in outcomes if o.error]
    return "; ".join(failed) if failed else None


def _mfu(setup: Setup, n_params: int, tokens_per_s: float) -> str:
    if not setup.peak_tflops:
        return "n/a"
    return f"{6 * n_params * tokens_per_s / (setup.peak_tflops * 1e12):.1%}"


def throughput(check: Check, part: Part) -> None:
    """The throughput part (module docstring); its rate with ``setup.processes`` at once
    goes to ``check.loop_rate`` for the four runs."""
    setup, ptb = check.setup, check.ptb()
    sizes = TOY_LOOP if setup.smoke else GPU_LOOP
    knobs = {
        "epochs": 10**6,  # max_steps ends the run
        "max_steps": sizes.steps,
        "log_every": sizes.log_every,
        "patience": None,
        "checkpoint_every": None,
        "max_batches_per_epoch": sizes.max_batches_per_epoch,
        "max_eval_batches": 2,
    }
    if setup.smoke:  # the compiled loop's code paths, where the CPU's auto would not compile
        knobs["compile"] = CompileMode.ON
    plan = ptb.plan("gpt-ptb", **knobs)
    n_params = parameters(plan)
    rows, lines = [], [f"- gpt-ptb: {n_params / 1e6:.1f}M parameters; {knobs_line(plan)}"]
    for n in sorted({1, setup.processes}):
        jobs = {f"gpt-{n}-{i}": _job(plan, setup, f"throughput-{n}-{i}") for i in range(n)}
        outcomes = run_at_once(jobs, setup.device, _limit(check, part))
        part.compile_s += max(o.compile_s for o in outcomes)
        error = _errors(outcomes)
        if error is not None:
            part.failed = f"{n} process(es): {error}"
            return
        together = shared(outcomes, sizes.warmup_windows)
        total = Rate(
            sum(r.tokens_per_s for r in together.rates.values()),
            sum(r.steps_per_s for r in together.rates.values()),
        )
        each = list(together.rates.values())
        startup = max(_first_step(o) - o.spawned for o in outcomes)
        rows.append(
            [
                n,
                f"{startup:.0f}",
                f"{max(o.compile_s for o in outcomes):.0f}",
                number(statistics.median(r.tokens_per_s for r in each)),
                f"{statistics.median(r.steps_per_s for r in each):.1f}",
                number(total.tokens_per_s),
                f"{total.steps_per_s:.1f}",
                _mfu(setup, n_params, total.tokens_per_s),
                f"{together.overlap:.0%}" if n > 1 else "",
            ]
        )
        if n == setup.processes:
            each_steps = statistics.median(r.steps_per_s for r in each)
            check.loop_rate = LoopRate(n, each_steps, startup)
            baseline = BASELINE_EACH_TOKENS * BASELINE_PROCESSES
            part.headlines += [
                Headline(
                    f"loop, {n} gpt-ptb at once: tokens/s (steps/s) in all",
                    f"{number(total.tokens_per_s)} ({total.steps_per_s:.0f})",
                    f">= {number(TARGET_FACTOR * baseline)} (3x)",
                    f"{number(baseline)} ({BASELINE_EACH_STEPS * BASELINE_PROCESSES:.0f}), "
                    "4 at once",
                ),
                Headline(
                    f"loop, {n} at once: MFU (6 x params x tokens)",
                    _mfu(setup, n_params, total.tokens_per_s),
                    "",
                    "about 9% (4 at once)",
                ),
            ]
    lines.append(
        f"- {sizes.steps} steps per process, logged every {sizes.log_every}; start-up: from "
        "starting the processes to the last one's first logged window (building, compiling); "
        "compiling: the slowest process's (dynamo's clock; the processes after the first "
        "read the Inductor cache it wrote on disk); steady windows: "
        f"after the first {sizes.warmup_windows}, none holding an evaluation; tokens are the "
        "loop's scored tokens (every word and `<eos>`)"
    )
    headers = ["processes", "start-up s", "compiling s", "tokens/s each", "steps/s each"]
    headers += ["tokens/s in all", "steps/s in all", "MFU in all", "overlap"]
    part.text += ["\n".join(lines), table(headers, rows)]


def epochs_that_fit(budget_s: float, rate: LoopRate | None, per_epoch: int, profile: int) -> int:
    """Whole epochs of the four runs that fit ``budget_s`` at the loop part's rate per
    process with ``--processes`` trainings at once (4 by default, as here) and its
    start-up, with a margin (HGPT is slower than GPT, and compiles afresh); at least 2
    (so one epoch is timed without the start-up), at most the profile's; 2 without a
    measured rate."""
    if rate is None or not rate.steps_per_s_each:
        return 2
    epoch_s = per_epoch / rate.steps_per_s_each
    return max(2, min(profile, math.floor(0.6 * (budget_s - rate.startup_s) / epoch_s)))


def sized_knobs(knobs: RunParams, epochs: int) -> dict[str, Any]:
    """Knob changes that make the profile's run ``epochs`` long, its averaged epochs (where
    the recipe averages) scaled in proportion."""
    update: dict[str, Any] = {"epochs": epochs}
    averaging = knobs.averaging
    if averaging.kind != AveragingKind.NONE:
        kept = math.floor(epochs * averaging.epochs / knobs.epochs)
        off = averaging.model_copy(update={"kind": AveragingKind.NONE})
        update["averaging"] = averaging.model_copy(update={"epochs": kept}) if kept else off
    return update


def four_runs(check: Check, part: Part) -> None:
    """The four 6-layer PTB runs of the profile at once (module docstring). A run that
    fails (out of memory, say) is a row saying so and fails the part; the others' rows
    are still measured."""
    setup, ptb = check.setup, check.ptb()
    profile_knobs = ptb.request(RUNS[0]).knobs
    logging = {"max_batches_per_epoch": 2, "log_every": 1} if setup.smoke else {"log_every": 10}
    probe = ptb.plan(RUNS[0], **logging)
    per_epoch = steps_per_epoch(probe)
    rate = check.loop_rate
    fit = epochs_that_fit(part.budget_s, rate, per_epoch, profile_knobs.epochs)
    epochs = 2 if setup.smoke else fit
    plans = {
        key: ptb.plan(key, **logging, **sized_knobs(ptb.request(key).knobs, epochs)) for key in RUNS
    }
    jobs = {key: _job(plan, setup, f"four-{key}") for key, plan in plans.items()}
    limit = _limit(check, part)
    outcomes = run_at_once(jobs, setup.device, limit)
    part.compile_s += max(o.compile_s for o in outcomes)
    # A run stopped at the time limit still timed the epochs it finished.
    timed = [o for o in outcomes if o.error is None or (o.killed and len(o.eval_times) >= 2)]
    part.failed = _errors([o for o in outcomes if o not in timed])
    if not timed:
        return
    rows, epoch_times = [], []
    together = shared(timed, 1)
    for o in outcomes:
        full = ptb.request(o.label).knobs.epochs
        if o not in timed:
            rows.append([o.label, f"{parameters(plans[o.label]) / 1e6:.1f}M", f"FAILED: {o.error}"])
            rows[-1] += [""] * 6
            continue
        evals = o.eval_times
        later = [b - a for a, b in itertools.pairwise(evals)]
        epoch_s = statistics.median(later) if later else evals[0] - o.spawned
        epoch_times.append(epoch_s)
        best = [line["best_valid_loss"] for line in o.lines if "best_valid_loss" in line]
        ppl = perplexity_of(min(best)) if best else math.nan
        rows.append(
            [
                o.label,
                f"{parameters(plans[o.label]) / 1e6:.1f}M",
                f"{len(evals)}{f' (stopped at {limit:.0f} s)' if o.killed else ''}",
                f"{evals[0] - o.spawned:.1f}",
                f"{o.compile_s:.0f}",
                f"{epoch_s:.1f}",
                f"{ppl:.1f}",
                number(together.rates[o.label].tokens_per_s),
                f"{full} x {epoch_s:.1f} s = {_clock(full * epoch_s)}",
            ]
        )
    slowest = max(epoch_times)
    sized = (
        "a smoke run's"
        if setup.smoke
        else f"sized from the loop part's rate ({rate.steps_per_s_each:.1f} steps/s each with "
        f"{rate.processes} at once, start-up {rate.startup_s:.0f} s)"
        if rate is not None
        else "the least (the loop part did not run: no rate to size them from)"
    )
    part.text += [
        "\n".join(
            [
                f"- {epochs} epochs of {per_epoch} steps each fit the part's {part.budget_s:.0f} s "
                f"({sized}); {knobs_line(probe)}",
                f"- the recipe's knobs (gpt-ptb): {_recipe(profile_knobs)}; this sized run: "
                f"{_recipe(plans[RUNS[0]].knobs, model=False)} (averaged epochs scaled in "
                "proportion, rounded down: 0 = none)",
                "- epoch time: the median time between evaluations (each epoch's training, "
                "its evaluation and checkpoint), the first epoch (start-up, compilation) apart; "
                f"processes overlapped {together.overlap:.0%} of the time",
                "- validation perplexity after these few epochs is no verdict on the paper's "
                "claims: the full runs are (README, issue 33)",
            ]
        ),
        table(
            [
                "run",
                "params",
                "epochs run",
                "first epoch s",
                "compiling s",
                "epoch s",
                "best valid ppl",
                "tokens/s",
                "the profile's run, projected",
            ],
            rows,
        ),
    ]
    part.headlines.append(
        Headline(
            f"four PTB runs at once: epochs in {part.budget_s:.0f} s; the profile's run projected",
            f"{epochs}; {_clock(profile_knobs.epochs * slowest)} (slowest run)",
            "",
            "not measured",
        )
    )


def _first_step(outcome: Outcome) -> float:
    """When a process logged its first training window (start-up and compilation done)."""
    return min(line["time"] for line in outcome.lines if "train_loss" in line)


def _clock(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _recipe(knobs: RunParams, model: bool = True) -> str:
    """The knobs of issue 33's recipe as ``knobs`` set them (``model``: its dropouts too)."""
    parts = [
        f"epochs {knobs.epochs}",
        f"lr {knobs.optimizer.lr:g}",
        f"schedule {knobs.schedule.kind.value}",
        f"clip {knobs.clip_norm}",
        f"weight decay {knobs.optimizer.weight_decay:g}",
    ]
    averaging = knobs.averaging
    if averaging.kind != AveragingKind.NONE:
        parts.append(f"averaging {averaging.kind} over the last {averaging.epochs} epochs")
    else:
        parts.append("no averaging")
    if model:
        dropouts = {k: v for k, v in knobs.model.items() if "dropout" in k}
        parts.append(f"model {dropouts}" if dropouts else "model dropouts: the presets'")
    return ", ".join(parts)
