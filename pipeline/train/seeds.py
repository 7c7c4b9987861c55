"""Several seeds of one run: ``train.*.seeds`` models, seed i trained with ``seed + 1000 i``.

A thin wrapper over ``run.train_run`` (which trains one model): for each seed it trains
with the seed overridden (so each seed is its own Ray run and MLflow run, resumable like
any other), then, with more than one seed, moves the exported model into
``data/train/<key>/seed-<i>/``. The run's ``manifest.json`` always lists the seeds:
``{"seeds": [{"seed": s, ...that seed's train_run manifest...}], ...the first seed's
manifest...}`` (so a one-seed run keeps ``data/train/<key>/model.pt`` and every field
readers used before). The offset 1000 keeps seeds apart from the per-worker offsets
(worker r seeds ``seed + r``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import Params, parse_params, run_key
from pipeline.train.checkpoint import write_json
from pipeline.train.run import MANIFEST_FILE, MODEL_FILE, Layout, train_run

SEED_STRIDE = 1000


def seed_values(base: int, n: int) -> list[int]:
    """The seeds of an ``n``-seed run whose base seed is ``base``."""
    return [base + SEED_STRIDE * i for i in range(n)]


def with_seed(params: Params, model: str, corpus: str, seed: int) -> Params:
    """``params`` with run ``<model>-<corpus>``'s seed set to ``seed`` (its run overrides
    for a train run, the model's overrides for a tuned run), nothing else changed."""
    raw = params.model_dump(mode="json", exclude_unset=True)
    key = run_key(model, corpus)
    train = raw.setdefault("train", {})
    if key in params.train.runs:
        target = train.setdefault("runs", {})[key]
        target.setdefault("overrides", {})["seed"] = seed
    else:
        train.setdefault("models", {}).setdefault(model, {})["seed"] = seed
    return parse_params(raw)


def train_seeds(
    params: Params, model: str, corpus: str, root: str | Path = ".", show_progress: bool = True
) -> dict[str, Any]:
    """Train every seed of ``model`` on ``corpus``; returns the manifest it writes."""
    layout = Layout(Path(root).resolve())
    run = params.train.run(model, corpus)
    seeds = seed_values(run.seed, run.seeds)
    out = layout.train_out(run_key(model, corpus))
    entries = []
    for i, seed in enumerate(seeds):
        seeded = with_seed(params, model, corpus, seed)
        manifest = train_run(seeded, model, corpus, root, show_progress)
        if len(seeds) > 1:
            folder = out / f"seed-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            moved = (out / MODEL_FILE).replace(folder / MODEL_FILE)
            manifest["checkpoint"] = layout.relative(moved)
            write_json(folder / MANIFEST_FILE, manifest)
        entries.append({"seed": seed, **manifest})
    combined = {**entries[0], "seeds": entries}
    write_json(out / MANIFEST_FILE, combined)
    return combined
