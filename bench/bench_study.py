"""Sizing a profile by measurement: each run's training step time on its real batches.

For every run of a params file (default ``profiles/study.yaml``) the model is built as the
train stage builds it (the run's merged knobs, the sizes of its corpus' tokenize record),
then takes optimizer steps (forward, loss, backward, clipping, Adam) on the run's own
training batches, shuffled as training shuffles them. Runs are interleaved round-robin
(``bench.common.interleaved``), so a machine slowing down slows them all. Printed per
run: parameters, the median seconds per step, target tokens per second, the run's steps
(``epochs x max_batches_per_epoch`` or ``max_steps``, times ``seeds``) and the training
time they project: the sum is what the profile's training costs on this machine, without
evaluation (its own stage; timed in the study's report).

Run: ``python -m bench.bench_study --data data/shards`` after tokenizing the profile's
corpora (``dvc repro tokenize`` with the profile as params.yaml, or ``python -m
stages.tokenize <corpus> --params profiles/study.yaml``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import interleaved, parser, setup, table
from pipeline.artifacts import Layout
from pipeline.data.loader import BatchLoader, open_split
from pipeline.data.shards import read_manifest
from pipeline.models import registry
from pipeline.models.base import count_parameters
from pipeline.plan import RunRequest, load_checked


def planned_steps(run, n_batches: int) -> int:
    """Optimizer steps of one seed: ``max_steps`` or epochs of (capped) batches."""
    per_epoch = (
        n_batches
        if run.max_batches_per_epoch is None
        else min(n_batches, run.max_batches_per_epoch)
    )
    steps = run.epochs * per_epoch
    return steps if run.max_steps is None else min(steps, run.max_steps)


class Candidate:
    """One run's model, optimizer and batch stream; ``step()`` times one training step."""

    def __init__(self, request: RunRequest, shards: Path) -> None:
        run, model, corpus = request.knobs, request.model, request.corpus
        task = registry.spec(model).task
        record = read_manifest(shards / corpus)
        config = registry.make_config(model, record.data_sizes(), **run.model)
        torch.manual_seed(run.seed)
        self.key, self.run = request.key, run
        self.net = registry.build_from_config(model, config).train()
        self.n_params = count_parameters(self.net)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=run.optimizer.lr)
        dataset = open_split(shards / corpus, task, "train")
        self.loader = BatchLoader(dataset, run.batch_size, shuffle=True, seed=run.seed)
        self.steps = planned_steps(run, len(self.loader)) * run.seeds
        self.batches = iter(self.loader)
        self.tokens: list[float] = []

    def step(self) -> None:
        batch = next(self.batches)
        self.optimizer.zero_grad(set_to_none=True)
        out = self.net.loss(batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.run.clip_norm)
        self.optimizer.step()
        self.tokens.append(float(out.n_tokens))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--params", type=Path, default=Path("profiles/study.yaml"))
    p.add_argument(
        "--data", type=Path, default=Layout(Path(".")).shards_dir, help="tokenized corpora"
    )
    p.add_argument("--runs", nargs="*", default=None, help="only these run keys")
    args = p.parse_args(argv)
    env = setup(args)
    params = load_checked(args.params)
    keys = args.runs or list(dict.fromkeys([*params.train.runs, *params.tune.runs]))
    candidates = {key: Candidate(RunRequest.of(params, key), args.data) for key in keys}

    cases = {key: c.step for key, c in candidates.items()}
    samples = interleaved(cases, args.repeats, args.warmup)
    rows, total = [], 0.0
    for key, s in samples.items():
        c = candidates[key]
        tokens = sum(c.tokens[-len(s.seconds) :]) / len(s.seconds)
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
