"""The ``ptb-curve`` diagnostic (issue 41): is the feeding why GPT-6 lagged the reference on
PTB? Two trainings of the profile's ``gpt-ptb`` at once on one GPU, each with the whole
run's schedule (175 epochs, the cosine over them), for as many epochs as the time allows:

- **A, documents** (the profile of issue 33): 10-sentence documents, each from ``<bos>``,
  32 a step (~7k tokens, 132 steps an epoch), 300 warm-up steps;
- **B, stream** (the reference's geometry, the profile of issue 41): PTB as one text cut
  every epoch into ~70-token segments after up to 70 tokens of context, 10 a step (~680
  scored tokens, ~1,362 steps an epoch), 3,000 warm-up steps.

Everything else is the profile's recipe. Both are validated after every epoch as the
reference validates (its ``evaluate``: 10 tokens scored a window after 130 of context,
streamed over the validation text), so their curves stand beside the reference's log
(:data:`REFERENCE`): if B tracks the reference and A lags, the feeding is the cause.
B's steps/s with two trainings on the GPU also projects the profile's whole runs (175
epochs; the four 6-layer runs x 3 seeds).

Run alone (``--parts ptb-curve``): it is not one of the default parts, whose budgets fill
the check's 8 minutes; one 10-minute device window holds it.
"""

from __future__ import annotations

import math
from typing import Any

from bench.common import number, table
from bench.gpu_check.loop import _errors, _job, _limit, sized_knobs
from bench.gpu_check.processes import Outcome, run_at_once, shared
from bench.gpu_check.ptb import PTB, steps_per_epoch
from bench.gpu_check.report import Check, Headline, Part
from pipeline.config import Params
from pipeline.eval.perplexity import perplexity_of
from pipeline.plan import checked, load_checked

# The reference's validation perplexity after each epoch: github ischlag/
# Fast-Weight-Memory-public, language-modelling/transformer_xl_ptb/TFM/20201012-163013/
# log.txt (seed 2, 24.0M parameters, 10 x ~68 tokens a step, 3,000 warm-up steps).
REFERENCE = {1: 370.37, 2: 234.45, 3: 187.39, 4: 162.19, 5: 147.20, 6: 136.49, 7: 126.09,
             8: 120.81, 9: 115.75, 10: 111.45, 15: 97.94}  # fmt: skip
# Its validation (train.py l. 299-329: eval_bptt 10, ext_len 70 + 70 - 10): our token
# window's defaults, each model by its own unit.
REFERENCE_VALIDATION = {"protocol": "stream", "unit": "model"}
ARMS = {"documents": {"batch_size": 32, "warmup_steps": 300}, "stream": {}}
RUN, MODEL = "gpt-ptb", "gpt"
PROJECTED_RUNS, PROJECTED_SEEDS = 4, 3
TOY_EPOCHS, TOY_BATCHES = 2, 3  # a smoke run: the code paths, two validations an arm


def arm_params(profile: Params, layout: str) -> Params:
    """The profile with PTB fed as ``layout``, validated and tested as the reference
    validates; the documents arm with issue 33's batch and warm-up."""
    raw = profile.model_dump(mode="json", exclude_unset=True)
    lm = raw["tokenize"]["corpora"]["ptb"].setdefault("lm", {})
    lm.update(layout=layout, validation=REFERENCE_VALIDATION)
    raw.setdefault("evaluate", {}).setdefault("corpora", {})["ptb"] = {"lm": REFERENCE_VALIDATION}
    changes = ARMS[layout]
    if changes:
        gpt = raw["train"]["models"][MODEL]
        gpt["batch_size"] = changes["batch_size"]
        gpt["schedule"] = {**gpt.get("schedule", {}), "warmup_steps": changes["warmup_steps"]}
    return checked(raw)


def curve_of(outcome: Outcome) -> dict[int, float]:
    """Validation perplexity after each epoch, from a process's stamps."""
    return {
        int(line["epoch"]): perplexity_of(line["valid_loss"])
        for line in outcome.lines
        if "valid_loss" in line and "epoch" in line
    }


def curve_rows(curves: dict[str, dict[int, float]]) -> list[list[object]]:
    """A row per epoch that any arm reached (and each reference milestone up to the last):
    each arm's validation perplexity beside the reference's."""
    last = max((max(c) for c in curves.values() if c), default=0)
    epochs = sorted({e for c in curves.values() for e in c} | {e for e in REFERENCE if e <= last})
    return [
        [
            epoch,
            *(f"{c[epoch]:.1f}" if epoch in c else "" for c in curves.values()),
            f"{REFERENCE[epoch]:.1f}" if epoch in REFERENCE else "",
        ]
        for epoch in epochs
    ]


def projection(steps_per_epoch: int, epochs: int, steps_per_s: float, at_once: int) -> str:
    """The profile's whole run, and the four 6-layer runs x 3 seeds ``at_once`` at a time,
    at ``steps_per_s`` a training (validation and start-up left out)."""
    if steps_per_s <= 0:
        return "n/a (no steady training window)"
    one = steps_per_epoch * epochs / steps_per_s
    waves = math.ceil(PROJECTED_RUNS * PROJECTED_SEEDS / at_once)
    return (
        f"{_clock(one)} a run; the {PROJECTED_RUNS} runs x {PROJECTED_SEEDS} seeds, {at_once} "
        f"at once: {_clock(waves * one)} ({_clock(waves * one / PROJECTED_SEEDS)} a seed)"
    )


def _clock(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def ptb_curve(check: Check, part: Part) -> None:
    """The diagnostic (module docstring)."""
    setup = check.setup
    assert setup.ptb is not None  # run_part skips a part that needs PTB without --ptb
    profile = load_checked(setup.profile)
    knobs: dict[str, Any] = {"log_every": 50}
    if setup.smoke:
        knobs = {"log_every": 1, "max_batches_per_epoch": TOY_BATCHES, "max_eval_batches": 2}
    plans, per_epoch = {}, {}
    for layout in ARMS:
        arm = PTB(
            arm_params(profile, layout), setup.ptb, setup.scratch / f"curve-{layout}", setup.smoke
        )
        # a smoke run's two epochs average in proportion, as the four runs' do
        short = sized_knobs(arm.request(RUN).knobs, TOY_EPOCHS) if setup.smoke else {}
        plans[layout] = arm.plan(RUN, **knobs, **short)
        per_epoch[layout] = steps_per_epoch(plans[layout])
    jobs = {layout: _job(plan, setup, f"curve-{layout}") for layout, plan in plans.items()}
    outcomes = run_at_once(jobs, setup.device, _limit(check, part))
    part.compile_s += max(o.compile_s for o in outcomes)
    # A training stopped at the time limit still shows the epochs it finished.
    error = _errors([o for o in outcomes if not (o.killed and o.eval_times)])
    if error is not None:
        part.failed = error
        return
    curves = {o.label: curve_of(o) for o in outcomes}
    rates = shared(outcomes, 1).rates
    lines = [
        f"- {layout}: batch {plans[layout].knobs.batch_size}, {per_epoch[layout]} steps an "
        f"epoch, warm-up {plans[layout].knobs.schedule.warmup_steps} steps, "
        f"{plans[layout].knobs.epochs} epochs scheduled; {rates[layout].steps_per_s:.1f} "
        f"steps/s, {number(rates[layout].tokens_per_s)} scored tokens/s (both at once)"
        for layout in ARMS
    ]
    lines += [
        "- validation after each epoch, streamed as the reference validates (10 tokens "
        "scored a window after 130 of context); the reference column is its log (seed 2, "
        "`bench/gpu_check/curve.py` cites it)",
        "- the profile's runs projected at the stream arm's rate, two at once: "
        + projection(
            per_epoch["stream"], plans["stream"].knobs.epochs, rates["stream"].steps_per_s, 2
        ),
    ]
    headers = ["epoch", *(f"{layout}: valid PPL" for layout in curves), "reference"]
    part.text += ["\n".join(lines), table(headers, curve_rows(curves))]
    for layout, curve in curves.items():
        last = max(curve, default=0)
        reference = REFERENCE.get(last)
        part.headlines.append(
            Headline(
                f"ptb-curve, {layout}: valid PPL after epoch {last}",
                f"{curve[last]:.1f}" if curve else "none",
                f"the reference's {reference:.1f}" if reference else "",
                "",
            )
        )
