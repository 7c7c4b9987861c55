"""Sizing a profile by measurement: each run's training step time on its real batches.

For every run of a params file (default ``profiles/study.yaml``) the train stage's job is
built as the stage builds it (``plan_training`` -> ``train_job``: the run's merged knobs,
the model at the sizes of its corpus' tokenize record, its data factory; a tuned run at
its base knobs, before any search), and the training loop's own step
(``pipeline.train.loop.loop_step``: the execution policy's autocast and compile, the run's
optimizer and schedule, clipping, token weighting) trains on the run's own training
batches, planned and shuffled as training plans them. Runs are interleaved round-robin
(``bench.common.interleaved``), so a machine slowing down slows them all. Printed per
run: parameters, the median seconds per step, scored tokens per second, the run's steps
(``epochs x max_batches_per_epoch`` or ``max_steps``, times ``seeds``) and the training
time they project: the sum is what the profile's training costs on this machine, without
evaluation (its own stage; timed in the study's report).

Run: ``python -m bench.bench_study --root .`` after tokenizing the profile's corpora into
``<root>/data/shards`` (``dvc repro tokenize`` with the profile as params.yaml, or
``python -m stages.tokenize <corpus> --params profiles/study.yaml``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from bench.common import interleaved, parser, setup, table
from pipeline.data.batch import Batch
from pipeline.models.base import LossOutput, count_parameters
from pipeline.plan import RunRequest, load_checked, plan_training
from pipeline.train.job import train_job
from pipeline.train.loop import loop_step


def planned_steps(run, n_batches: int) -> int:
    """Optimizer steps of one seed: ``max_steps`` or epochs of (capped) batches."""
    per_epoch = (
        n_batches
        if run.max_batches_per_epoch is None
        else min(n_batches, run.max_batches_per_epoch)
    )
    steps = run.epochs * per_epoch
    return steps if run.max_steps is None else min(steps, run.max_steps)


class _Tokens:
    """The model's ``loss``, recording each output's scored tokens (on the device: read
    after the timing, so the step waits for nothing more than it does in training)."""

    def __init__(self, loss: object) -> None:
        self.loss, self.seen = loss, list[Tensor]()

    def __call__(self, batch: Batch) -> LossOutput:
        out = self.loss(batch)  # type: ignore[operator]
        self.seen.append(out.n_tokens.detach())
        return out


class Candidate:
    """One run's train-stage job in this process, and its batch stream; ``step()`` takes
    the training loop's step on the next batch."""

    def __init__(self, request: RunRequest, root: Path, device: torch.device, scratch: str) -> None:
        # a tuned run at its base knobs: the search's result may not exist yet
        plan = plan_training(request.model_copy(update={"tuned": False}), root)
        job = dataclasses.replace(train_job(plan, None, False), run_dir=scratch)
        self.key, self.run = request.key, plan.knobs
        self.loop = loop_step(job, device)
        self.n_params = count_parameters(self.loop.model)
        self.tokens = _Tokens(self.loop.model.loss)
        self.loop.model.loss = self.tokens  # type: ignore[method-assign]
        train, _ = job.data(0, 1)
        self.steps = planned_steps(plan.knobs, len(train)) * plan.knobs.seeds
        self.batches = _epochs(train)

    def step(self) -> None:
        self.loop.step(self.loop.prepare(next(self.batches)))


def _epochs(data) -> Iterator[Batch]:
    """``data``'s batches epoch after epoch, as the loop draws them."""
    epoch = 0
    while True:
        data.set_epoch(epoch)
        yield from data.iter_from(0)
        epoch += 1


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, precision=False)  # each run's own
    p.add_argument("--params", type=Path, default=Path("profiles/study.yaml"))
    p.add_argument(
        "--root", type=Path, default=Path("."), help="project root: data/shards/<corpus>"
    )
    p.add_argument("--runs", nargs="*", default=None, help="only these run keys")
    args = p.parse_args(argv)
    env = setup(args)
    params = load_checked(args.params)
    keys = args.runs or list(dict.fromkeys([*params.train.runs, *params.tune.runs]))
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="hiertx-bench-study-") as scratch:
        candidates = {
            key: Candidate(RunRequest.of(params, key), args.root, device, scratch) for key in keys
        }
        cases = {key: c.step for key, c in candidates.items()}
        samples = interleaved(cases, args.repeats, args.warmup, device)
    rows, total = [], 0.0
    for key, s in samples.items():
        c = candidates[key]
        tokens = float(sum(c.tokens.seen[-len(s.seconds) :])) / len(s.seconds)
        minutes = c.steps * s.median / 60
        total += minutes
        rows.append(
            [
                key,
                f"{c.n_params / 1e6:.2f}M",
                f"{s.median * 1e3:.0f}",
                f"{tokens / s.median:,.0f}",
                f"{c.steps:,}",
                f"{minutes:.1f}",
            ]
        )
    print(env.markdown())
    print(table(["run", "params", "ms/step", "tokens/s", "steps (all seeds)", "train min"], rows))
    print(f"\nprojected training: {total:.0f} min ({math.ceil(total / 60 * 10) / 10} h)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
