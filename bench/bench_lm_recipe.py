"""The Transformer-XL PTB recipe against today's, on validation perplexity after the same
steps: issue 33's CPU evidence, at a size that trains on 2 cores in under an hour.

Both recipes come from ``profiles/paper.yaml``: today's is its ``train.defaults`` (Adam
1e-4, dropout 0.1, no schedule, clip 1.0), the recipe is those merged with
``train.models.gpt`` (locked, word-type and output dropout, AR/TAR, Adam 3e-4 with
weight decay, warm-up and cosine decay, clip 0.25, uniform parameter averaging). Only the
run's length is changed, the same for both: ``--epochs`` epochs, the recipe's warm-up and
averaged epochs scaled to the same fractions of the run as in the profile (warm-up 300 of
175 x 132 steps, averaging 50 of 175 epochs); patience off, so both take every step.

The data: the first ``--fraction`` of PTB's training sentences and the first
``--valid-fraction`` of its validation ones (a small corpus overfits sooner: what the
recipe is for), tokenized by the project's tokenizer with the profile's PTB settings
(the vocabulary is the subset's words). The model: a GPT of ``--d-model``, ``--layers``
layers. Each recipe trains ``--seeds`` seeds (the profile's seeds, shared by both recipes:
seed i of one starts from the weights of seed i of the other) through the project's own
plan and loop (``plan_training`` -> ``train_job`` -> ``train_local``), ``--jobs`` at a
time, each on ``--threads`` threads. Reported per recipe: the best validation perplexity
(per document: what the run keeps; the averaged weights' once averaging began), mean and
95% interval over seeds, and the recipe's paired difference; written to ``--out`` with
the machine, command and date.

Run (about 50 min on a quiet 2-core machine: an epoch of one run costs ~47 s of one
core, measured under load; 6 runs x 20 epochs, 2 at a time):
``python -m bench.bench_lm_recipe --ptb ../shared/data/ptb``.
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import environment, table
from pipeline.artifacts import Layout
from pipeline.config import Params
from pipeline.data.tokenize import tokenize_corpus
from pipeline.eval.stats import mean_ci
from pipeline.plan import RunRequest, checked, load_checked, plan_training
from pipeline.train.job import train_job
from pipeline.train.loop import train_local

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "profiles" / "paper.yaml"
MODEL, CORPUS = "gpt", "ptb"
KEY = f"{MODEL}-{CORPUS}"
# The profile's PTB run: 175 epochs of 132 steps (4,207 documents at batch 32), 300 of
# them warming up, the last 50 epochs averaged.
PROFILE_STEPS_PER_EPOCH = 132


def write_subset(ptb: Path, raw: Path, fraction: float, valid_fraction: float) -> dict[str, int]:
    """``raw/ptb.{train,valid,test}.txt``: the first ``fraction`` of the training sentences,
    the first ``valid_fraction`` of the validation ones, the test file whole (the
    tokenizer reads every split); returns the sentences of each."""
    raw.mkdir(parents=True, exist_ok=True)
    kept = {}
    for split, share in (("train", fraction), ("valid", valid_fraction), ("test", 1.0)):
        source = ptb / f"ptb.{split}.txt"
        if not source.is_file():
            raise SystemExit(f"--ptb {ptb}: no ptb.{split}.txt there (Mikolov's PTB folder)")
        lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
        lines = lines[: max(1, round(len(lines) * share))]
        (raw / f"ptb.{split}.txt").write_text("".join(lines), encoding="utf-8")
        kept[split] = len(lines)
    return kept


def recipes(
    profile: Params, epochs: int, steps_per_epoch: int, sizes: dict[str, int], seeds: int
) -> dict[str, dict[str, Any]]:
    """The train knobs (raw ``train.defaults``) of ``today`` and ``recipe``: the profile's,
    at this run's length and model size, the recipe's warm-up and averaging scaled to it."""
    base = profile.train.defaults
    common = {"epochs": epochs, "patience": None, "seeds": seeds, "checkpoint_every": None}
    today = base.model_copy(update=common)
    recipe = profile.train.run(MODEL, CORPUS).model_copy(update=common)
    full = profile.train.run(MODEL, CORPUS)
    warmup = full.schedule.warmup_steps / (full.epochs * PROFILE_STEPS_PER_EPOCH)
    recipe = recipe.model_copy(
        update={
            "schedule": recipe.schedule.model_copy(
                update={"warmup_steps": max(1, round(warmup * epochs * steps_per_epoch))}
            ),
            "averaging": recipe.averaging.model_copy(
                update={"epochs": max(1, round(full.averaging.epochs / full.epochs * epochs))}
            ),
        }
    )
    out = {}
    for name, knobs in (("today", today), ("recipe", recipe)):
        raw = knobs.model_dump(mode="json", exclude_unset=False)
        raw["model"] = {**raw["model"], **sizes}
        out[name] = raw
    return out


def project_params(knobs: dict[str, Any], profile: Params) -> Params:
    """The params of one recipe's run ``gpt-ptb``, checked as a stage reads them."""
    return checked(
        {
            "corpora": [CORPUS],
            "tokenize": {"corpora": {CORPUS: profile.tokenize.corpora[CORPUS].model_dump()}},
            "train": {
                "defaults": knobs,
                "runs": {KEY: {"model": MODEL, "corpus": CORPUS}},
                "scale": {"num_workers": 0},
            },
            "tracking": {"enabled": False},
        }
    )


def train_seed(
    root: Path, knobs: dict[str, Any], seed_index: int, threads: int
) -> dict[str, float]:
    """One seed of one recipe, in this process: the loop's final metrics and its seconds."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    profile = load_checked(PROFILE)
    plan = plan_training(RunRequest.of(project_params(knobs, profile), KEY), root)
    metrics = train_local(train_job(plan.for_seed(seed_index), None, False), torch.device("cpu"))
    return {**metrics, "seconds": time.perf_counter() - start}


def run_all(
    root: Path, knobs: dict[str, dict[str, Any]], seeds: int, jobs: int, threads: int
) -> dict[str, list[dict[str, float]]]:
    """Every seed of every recipe, ``jobs`` processes at a time (0: one after another in
    this one), seed by seed so that both recipes' seeds share the machine alike."""
    order = [(name, i) for i in range(seeds) for name in knobs]
    if jobs == 0:
        done = {job: train_seed(root, knobs[job[0]], job[1], threads) for job in order}
    else:
        context = multiprocessing.get_context("spawn")  # a fresh torch in each process
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = {job: pool.submit(train_seed, root, knobs[job[0]], job[1], threads)
                       for job in order}  # fmt: skip
            done = {job: future.result() for job, future in futures.items()}
    return {name: [done[name, i] for i in range(seeds)] for name in knobs}


def summary_rows(results: dict[str, list[dict[str, float]]]) -> list[list[object]]:
    """A row per recipe: best validation perplexity per seed, mean ± 95% interval, steps;
    then the recipe's paired difference over seeds."""
    rows: list[list[object]] = []
    for name, seeds in results.items():
        ppl = [r["best_valid_ppl"] for r in seeds]
        ci = mean_ci(ppl)
        interval = "-" if math.isnan(ci.half_width) else f"{ci.half_width:.1f}"
        steps = "/".join(sorted({f"{r['steps']:.0f}" for r in seeds}))
        best = ", ".join(f"{r['best_step']:.0f}" for r in seeds)
        cells = ", ".join(f"{p:.1f}" for p in ppl)
        minutes = sum(r["seconds"] for r in seeds) / 60
        rows.append([name, cells, f"{ci.mean:.1f}", interval, steps, best, f"{minutes:.0f}"])
    today, recipe = (results[k] for k in ("today", "recipe"))
    diff = [b["best_valid_ppl"] - a["best_valid_ppl"] for a, b in zip(today, recipe, strict=True)]
    ci = mean_ci(diff)
    interval = "-" if math.isnan(ci.half_width) else f"{ci.half_width:.1f}"
    rows.append(["recipe - today", ", ".join(f"{d:+.1f}" for d in diff), f"{ci.mean:+.1f}",
                 interval, "", "", ""])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    profile = load_checked(PROFILE)
    env = environment("cpu")
    sizes = {"d_model": args.d_model, "n_heads": args.heads, "n_layers": args.layers,
             "d_ff": 4 * args.d_model}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lm-recipe-") as tmp:
        root = Path(args.work or tmp).resolve()
        layout = Layout(root)
        kept = write_subset(args.ptb, layout.raw(CORPUS), args.fraction, args.valid_fraction)
        record = tokenize_corpus(CORPUS, layout.raw(CORPUS), layout.shards(CORPUS), profile)
        documents = math.ceil(kept["train"] / profile.corpus(CORPUS).lm.sentences_per_document)
        steps_per_epoch = math.ceil(documents / profile.train.defaults.batch_size)
        knobs = recipes(profile, args.epochs, steps_per_epoch, sizes, args.seeds)
        results = run_all(root, knobs, args.seeds, args.jobs, args.threads)
    headers = ["recipe", "best valid PPL per seed", "mean", "95% ±", "steps", "best step",
               "minutes (all seeds)"]  # fmt: skip
    text = "\n".join(
        [
            "# The Transformer-XL PTB recipe against today's, on CPU (issue 33)",
            "",
            f"Produced by `bench/bench_lm_recipe.py` (its docstring says what it does). GPT, "
            f"d {args.d_model}, {args.layers} layer(s), {args.heads} heads, FFN "
            f"{4 * args.d_model}; the first {kept['train']:,} training sentences "
            f"({args.fraction:.0%} of PTB's, {record.data_sizes().vocab_size:,}-word vocabulary "
            f"from them) and {kept['valid']:,} validation sentences; batch "
            f"{profile.train.defaults.batch_size} documents of "
            f"{profile.corpus(CORPUS).lm.sentences_per_document} sentences, "
            f"{args.epochs} epochs ({steps_per_epoch} steps each) for both recipes, "
            f"{args.seeds} seeds each (seed i of both from the same initial weights). "
            "Perplexity: validation, per document, of the weights each run keeps (its best "
            "validation; the recipe's averaged weights once averaging begins).",
            "",
            env.markdown(),
            "",
            table(headers, summary_rows(results)),
            "",
        ]
    )
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


def _parser():
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ptb", type=Path, required=True, help="folder of ptb.{train,valid,test}.txt")
    p.add_argument("--fraction", type=float, default=0.1, help="of PTB's training sentences")
    p.add_argument("--valid-fraction", type=float, default=0.5, help="of its validation ones")
    p.add_argument("--epochs", type=int, default=20, help="epochs of every run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--jobs", type=int, default=2, help="trainings at a time (0: in this process)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per training")
    p.add_argument("--work", type=Path, default=None, help="project folder (default: a temp one)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "LM_RECIPE.md",
                   help="where the table goes (none: printed only)")  # fmt: skip
    return p


if __name__ == "__main__":
    sys.exit(main())
