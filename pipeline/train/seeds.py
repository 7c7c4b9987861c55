"""Several seeds of one run: ``train.*.seeds`` models, seed i trained with ``seed + 1000 i``.

A thin wrapper over ``run.train_run`` (which trains one model): each seed trains with the
seed overridden (so each seed is its own Ray run and MLflow run, resumable like any other)
and exports to ``data/train/<key>/model.pt`` (one seed) or ``data/train/<key>/seed-<i>/
model.pt``; then the run's :class:`~pipeline.artifacts.TrainRecord` lists them all. The
offset 1000 keeps seeds apart from the per-worker offsets (worker r seeds ``seed + r``).
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline import machine
from pipeline.artifacts import MANIFEST_FILE, MODEL_FILE, WALL_SECONDS, Layout, TrainRecord
from pipeline.config import Params, parse_params, run_key
from pipeline.models import registry
from pipeline.train.run import train_run

SEED_STRIDE = 1000


def seed_values(base: int, n: int) -> list[int]:
    """The seeds of an ``n``-seed run whose base seed is ``base``."""
    return [base + SEED_STRIDE * i for i in range(n)]


def with_seed(
    params: Params, model: str, corpus: str, seed: int, variant: str | None = None
) -> Params:
    """``params`` with run ``<model>-<corpus>[-<variant>]``'s seed set to ``seed`` (its run
    overrides for a train run, the model's overrides for a tuned run), nothing else changed."""
    raw = params.model_dump(mode="json", exclude_unset=True)
    key = run_key(model, corpus, variant)
    train = raw.setdefault("train", {})
    if key in params.train.runs:
        target = train.setdefault("runs", {})[key]
        target.setdefault("overrides", {})["seed"] = seed
    else:
        train.setdefault("models", {}).setdefault(model, {})["seed"] = seed
    return parse_params(raw)


def train_seeds(
    params: Params,
    model: str,
    corpus: str,
    root: str | Path = ".",
    show_progress: bool = True,
    variant: str | None = None,
) -> TrainRecord:
    """Train every seed of ``model`` on ``corpus`` (run ``variant``); writes and returns
    the run's record."""
    layout = Layout(Path(root).resolve())
    run = params.train.run(model, corpus, variant)
    seeds = seed_values(run.seed, run.seeds)
    out = layout.train_out(run_key(model, corpus, variant))
    trained = []
    for i, seed in enumerate(seeds):
        folder = out / f"seed-{i}" if len(seeds) > 1 else out
        seeded = with_seed(params, model, corpus, seed, variant)
        start = time.perf_counter()
        done = train_run(
            seeded, model, corpus, root, show_progress, folder / MODEL_FILE, variant=variant
        )
        # Wall time of this process's training (a resumed run: since the resume).
        wall = {WALL_SECONDS: time.perf_counter() - start}
        trained.append(done.model_copy(update={"metrics": {**done.metrics, **wall}}))
    record = TrainRecord(
        model=model,
        corpus=corpus,
        task=registry.spec(model).task.value,
        seeds=trained,
        machine=machine.describe(),
        commit=machine.code_version(layout.root),
    )
    record.write(out / MANIFEST_FILE)
    return record
