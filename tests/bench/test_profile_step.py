"""``profile_step`` profiles the training loop's own step (issue 50: it profiled a step
of its own, plain Adam, no compile), each op under the phase of the step it ran in."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from bench import profile_step
from bench.common import synthetic_batch
from bench.models import SCALES, seq2seq
from bench.steps import StepSettings, loop_step
from pipeline.train import loop

TINY = SCALES["tiny"]


@pytest.mark.slow
def test_the_profiled_step_is_the_loops(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    updates = []
    real_update = loop._Run.update

    def update(run: loop._Run, batch: object) -> object:
        updates.append(type(run.optimizer).__name__)
        return real_update(run, batch)

    monkeypatch.setattr(loop._Run, "update", update)
    argv = "--scale tiny --batch-size 2 --history 12 --target 5 --max-length 2 --warmup 2"
    monkeypatch.setattr(sys, "argv", ["profile_step", *argv.split(), "--models", "unet"])
    profile_step.main()
    assert updates == ["Adam"] * 3  # 2 warm-up steps, 1 profiled: the loop's update
    assert "| unet | train step |" in capsys.readouterr().out


@pytest.mark.slow
def test_every_op_of_the_step_falls_in_its_phase() -> None:
    batch = synthetic_batch(2, 12, 5, TINY.vocab)
    model, _ = seq2seq("transformer", TINY)
    step = loop_step(model, batch, "cpu", StepSettings())
    step()
    prof = profile_step.profiled(step, "cpu")
    phases = Counter(profile_step.phase_of(e) for e in prof.events() if e.name.startswith("aten::"))
    assert {"forward", "backward", "clip", "optimizer"} <= set(phases), phases
    linear = [profile_step.phase_of(e) for e in prof.events() if e.name == "aten::linear"]
    assert set(linear) == {"forward"}  # the model's matmuls, not the optimizer's
    norms = {profile_step.phase_of(e) for e in prof.events() if e.name == "aten::_foreach_norm"}
    assert norms == {"clip"}
