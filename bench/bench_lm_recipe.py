"""Where the Transformer-XL PTB recipe's regularisers matter, on CPU: validation curves of
GPT trained long enough to overfit, with and without them, on documents and on a stream
(issue 41's evidence; issue 33's first comparison never left the under-trained regime).

Arms (``--arms``), both from ``profiles/paper.yaml``'s ``train.models.gpt`` and differing
only in the model's regularisers: ``recipe`` is that run as it is (locked, word-type, q/k/v
and output dropout, AR/TAR); ``plain`` drops them for one dropout of 0.1 everywhere. Both
keep its optimizer (Adam 3e-4, weight decay, clip 0.25), its linear warm-up and cosine
schedule and its uniform averaging of the last epochs, scaled to this run's length: the
warm-up ``--warmup-fraction`` of the steps (the reference's 3,000 of its ~240,000), the
averaging the same share of the epochs as in the profile (50 of 175). Patience off: every
run takes every step and is validated after every epoch.

Data layout (``--layout``, the corpus's ``lm.layout``): ``documents`` (the profile's
10-sentence documents, each from ``<bos>``) or ``stream`` (the split as one text, cut into
jittered segments of 70 target tokens after up to 70 of context, ``lm.stream``'s
defaults). Validation is streamed as the profile's PTB test is (``evaluate.corpora.ptb.lm``,
which the corpus's ``lm.validation`` takes): every layout's weights are scored alike.

The data: the first ``--fraction`` of PTB's training sentences and the first
``--valid-fraction`` of its validation ones (a small corpus overfits sooner), tokenized by
the project's tokenizer with the profile's PTB settings (the vocabulary is the subset's
words). The model: GPT of ``--d-model``, ``--layers`` layers, ``--heads`` heads. Every run
trains through the project's own plan and loop (``plan_training`` -> ``train_job`` ->
``train_local``), ``--jobs`` at a time, ``--threads`` torch threads each; seed i of every
arm starts from the same initial weights.

Two commands. ``run`` trains the runs asked for (a run whose summary exists is skipped, so
a stopped evidence run continues; each run's per-epoch validation goes to
``<work>/runs/<arm>-<layout>-s<seed>.jsonl``). ``report`` reads every finished run of
``--work`` and writes ``--out`` (Markdown: best validation per seed and arm, the epoch of
the best, the plain arm's minimum, the curves) and a PNG of the curves beside it.

    python -m bench.bench_lm_recipe run --ptb ../shared/data/ptb --work /tmp/lm-recipe \
        --arms plain recipe --layout documents --seeds 0 1 2
    python -m bench.bench_lm_recipe report --work /tmp/lm-recipe
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import MetricStamps, command_line, environment, table
from pipeline.artifacts import MANIFEST_FILE, Layout
from pipeline.config import Params
from pipeline.data.loader import BatchLoader, open_split
from pipeline.data.splits import Split
from pipeline.data.streams import LMFeed
from pipeline.data.tokenize import tokenize_corpus
from pipeline.eval.stats import mean_ci
from pipeline.names import Task
from pipeline.plan import RunRequest, checked, load_checked, plan_training
from pipeline.train.job import train_job
from pipeline.train.loop import train_local

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "profiles" / "paper.yaml"
MODEL, CORPUS = "gpt", "ptb"
KEY = f"{MODEL}-{CORPUS}"
ARMS = ("plain", "recipe")
RUNS_HEADING = "## Runs"
LAYOUTS = ("documents", "stream")
# The reference's warm-up: 3,000 steps of its ~240,000 (175 epochs of ~1,372 steps;
# Fast-Weight-Memory transformer_xl_ptb/train.py l. 71, log.txt).
WARMUP_FRACTION = 3000 / (175 * 1372)
# The model's regularisers (the recipe's sites); the plain arm leaves them at their
# defaults: one dropout everywhere, nothing locked, no AR/TAR.
REGULARISERS = (
    "locked_dropout",
    "embedding_dropout",
    "input_dropout",
    "attention_dropout",
    "attention_output_dropout",
    "ffn_dropout",
    "qkv_dropout",
    "output_dropout",
    "ar_alpha",
    "tar_beta",
    "dropout",
)


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


def corpus_params(profile: Params, layout: str) -> dict[str, Any]:
    """The profile's PTB tokenize settings, fed as ``layout``, validated as it tests."""
    corpus = profile.tokenize.corpora[CORPUS].model_dump(mode="json")
    test = profile.evaluate.for_corpus(CORPUS).lm.model_dump(mode="json")
    corpus["lm"] = {**corpus["lm"], "layout": layout, "validation": test}
    return corpus


def project_params(profile: Params, layout: str, knobs: dict[str, Any] | None = None) -> Params:
    """The params of a run ``gpt-ptb`` on ``layout``, checked as a stage reads them."""
    corpus = corpus_params(profile, layout)
    return checked(
        {
            "corpora": [CORPUS],
            "tokenize": {"corpora": {CORPUS: corpus}},
            "train": {
                "defaults": knobs or {},
                "runs": {KEY: {"model": MODEL, "corpus": CORPUS}},
                "scale": {"num_workers": 0},
            },
            "evaluate": {"corpora": {CORPUS: {"lm": corpus["lm"]["validation"]}}},
            "tracking": {"enabled": False},
        }
    )


def prepare(args: argparse.Namespace, profile: Params) -> tuple[Path, int]:
    """The layout's project under ``--work`` (tokenized once) and its steps per epoch."""
    root = args.work / args.layout
    layout = Layout(root)
    params = project_params(profile, args.layout)
    if not (layout.shards(CORPUS) / MANIFEST_FILE).is_file():
        write_subset(args.ptb, layout.raw(CORPUS), args.fraction, args.valid_fraction)
        tokenize_corpus(CORPUS, layout.raw(CORPUS), layout.shards(CORPUS), params)
    feed = LMFeed("tokens", params.tokenize.corpora[CORPUS].lm)  # GPT's unit
    loader = BatchLoader(
        open_split(layout.shards(CORPUS), Task.LM, Split.TRAIN, feed), args.batch_size
    )
    return root, len(loader)


def arm_knobs(
    profile: Params, arm: str, args: argparse.Namespace, steps_per_epoch: int
) -> dict[str, Any]:
    """The train knobs of ``arm`` (raw ``train.defaults``): the profile's GPT run at this
    length, batch and size, its warm-up and averaging scaled to the run."""
    full = profile.train.run(MODEL, CORPUS)
    model = {k: v for k, v in full.model.items() if arm == "recipe" or k not in REGULARISERS}
    model.update(
        d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, d_ff=4 * args.d_model
    )
    warmup = max(1, round(args.warmup_fraction * args.epochs * steps_per_epoch))
    knobs = full.model_copy(
        update={
            "epochs": args.epochs,
            "patience": None,
            "seeds": max(args.seeds) + 1,
            "checkpoint_every": None,
            "eval_every": None,
            "max_steps": None,
            "batch_size": args.batch_size,
            "batch_tokens": None,
            "eval_batch_size": args.eval_batch_size,
            "model": model,
            "schedule": full.schedule.model_copy(
                update={"warmup_steps": warmup, "decay_steps": None}
            ),
            "averaging": full.averaging.model_copy(
                update={"epochs": max(1, round(full.averaging.epochs / full.epochs * args.epochs))}
            ),
        }
    )
    return knobs.model_dump(mode="json")


@dataclass(frozen=True)
class RunSpec:
    """One training of the evidence: arm, layout, seed index and where its files go."""

    arm: str
    layout: str
    seed: int
    root: Path
    knobs: dict[str, Any]
    threads: int

    @property
    def name(self) -> str:
        return f"{self.arm}-{self.layout}-s{self.seed}"

    def files(self) -> tuple[Path, Path]:
        runs = self.root.parent / "runs"
        return runs / f"{self.name}.jsonl", runs / f"{self.name}.json"


def train_run(spec: RunSpec, profile_path: Path, command: str) -> dict[str, Any]:
    """One run in this process: its per-epoch validation to its JSONL file, its summary
    (final metrics, seconds, knobs, command) to its JSON file, returned."""
    torch.set_num_threads(spec.threads)
    curve, summary = spec.files()
    curve.parent.mkdir(parents=True, exist_ok=True)
    curve.unlink(missing_ok=True)
    profile = load_checked(profile_path)
    start = time.perf_counter()
    plan = plan_training(
        RunRequest.of(project_params(profile, spec.layout, spec.knobs), KEY), spec.root
    )
    job = train_job(plan.for_seed(spec.seed), MetricStamps(str(curve)), False)
    metrics = train_local(job, torch.device("cpu"))
    out = {
        "arm": spec.arm,
        "layout": spec.layout,
        "seed": spec.seed,
        "metrics": metrics,
        "seconds": time.perf_counter() - start,
        "threads": spec.threads,
        "knobs": spec.knobs,
        "command": command,
    }
    summary.write_text(json.dumps(out, indent=1), encoding="utf-8")
    return out


def run(args: argparse.Namespace) -> int:
    profile = load_checked(PROFILE)
    root, steps = prepare(args, profile)
    specs = [
        RunSpec(arm, args.layout, seed, root, arm_knobs(profile, arm, args, steps), args.threads)
        for seed in args.seeds
        for arm in args.arms
    ]
    todo = [s for s in specs if not s.files()[1].is_file()]
    print(f"{len(todo)} of {len(specs)} runs to train, {steps} steps an epoch", flush=True)
    command = command_line()
    if args.jobs == 0:  # in this process, one after another
        for spec in todo:
            _done(spec, train_run(spec, PROFILE, command))
        return 0
    context = multiprocessing.get_context("spawn")  # a fresh torch in each process
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = {pool.submit(train_run, s, PROFILE, command): s for s in todo}
        for future in concurrent.futures.as_completed(futures):
            _done(futures[future], future.result())
    return 0


def _done(spec: RunSpec, summary: dict[str, Any]) -> None:
    best = summary["metrics"]["best_valid_ppl"]
    print(f"{spec.name}: best valid {best:.1f} in {summary['seconds'] / 60:.0f} min", flush=True)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class RunCurve:
    """A run, finished or not (``summary`` None: training, or stopped; its curve so far): its
    validation perplexity after each epoch and its training perplexity (the logged
    windows' NLL, dropout on) over each epoch."""

    arm: str
    layout: str
    seed: int
    seconds: float
    curve: dict[int, float]
    train: dict[int, float]
    summary: dict[str, Any] | None

    @property
    def group(self) -> str:
        return f"{self.arm}, {self.layout}"

    @property
    def best(self) -> tuple[int, float]:
        """(epoch, perplexity) of the lowest validation."""
        epoch = min(self.curve, key=lambda e: (self.curve[e], e))
        return epoch, self.curve[epoch]

    @property
    def epochs(self) -> str:
        """Epochs run: all of them, or how far an unfinished run got."""
        done = max(self.curve, default=0)
        return str(done) if self.summary is not None else f"{done}, unfinished"


def read_runs(work: Path) -> list[RunCurve]:
    """Every run under ``work/runs`` with at least one validation."""
    out = []
    for curve_path in sorted((work / "runs").glob("*.jsonl")):
        lines = [json.loads(x) for x in curve_path.read_text(encoding="utf-8").splitlines()]
        curve = {int(x["epoch"]): float(x["valid_ppl"]) for x in lines if "valid_ppl" in x}
        if not curve:
            continue
        summary_path = curve_path.with_suffix(".json")
        summary = None
        if summary_path.is_file():
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
        arm, layout, seed = curve_path.stem.rsplit("-", 2)
        seconds = summary["seconds"] if summary else lines[-1]["time"] - lines[0]["time"]
        epoch_of = [(x["step"], int(x["epoch"])) for x in lines if "valid_ppl" in x]
        train: dict[int, list[float]] = {}
        for x in lines:
            if "train_nll" in x:  # the epoch it was logged in: the first validation after it
                epoch = next((e for step, e in epoch_of if x["step"] <= step), None)
                if epoch is not None:
                    train.setdefault(epoch, []).append(x["train_nll"])
        mean_train = {e: math.exp(statistics.mean(v)) for e, v in train.items()}
        out.append(RunCurve(arm, layout, int(seed[1:]), seconds, curve, mean_train, summary))
    return sorted(out, key=lambda r: (LAYOUTS.index(r.layout), ARMS.index(r.arm), r.seed))


def summary_rows(runs: list[RunCurve]) -> list[list[object]]:
    """A row per run: epochs run, best validation (epoch), the last epoch's validation and
    training perplexity, minutes; then per arm and layout with several seeds, the mean of
    the best +- 95% and the seeds' spread."""
    rows: list[list[object]] = []
    for r in runs:
        epoch, best = r.best
        last = max(r.curve)
        train = f"{r.train[last]:.1f}" if last in r.train else ""
        rows.append([f"{r.group}, seed {r.seed}", r.epochs, f"{best:.1f}", epoch,
                     f"{r.curve[last]:.1f}", train, f"{r.seconds / 60:.0f}"])  # fmt: skip
    groups: dict[str, list[RunCurve]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    for group, members in groups.items():
        if len(members) < 2:
            continue
        best = [r.best[1] for r in members]
        ci = mean_ci(best)
        interval = "-" if math.isnan(ci.half_width) else f"± {ci.half_width:.1f}"
        rows.append([f"{group}: {len(members)} seeds", "", f"{ci.mean:.1f} {interval}",
                     f"spread {max(best) - min(best):.1f}", "", "", ""])  # fmt: skip
    return rows


def curve_rows(runs: list[RunCurve]) -> tuple[list[str], list[list[object]]]:
    """Validation perplexity per epoch (rows) and run (columns)."""
    epochs = sorted({e for r in runs for e in r.curve})
    headers = ["epoch", *(f"{r.arm} {r.layout} s{r.seed}" for r in runs)]
    rows = [[e, *(f"{r.curve[e]:.1f}" if e in r.curve else "" for r in runs)] for e in epochs]
    return headers, rows


def plot(runs: list[RunCurve], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    colours = {}
    for r in runs:
        colour = colours.setdefault(r.group, f"C{len(colours)}")
        epochs = sorted(r.curve)
        label = r.group if r.seed == min(x.seed for x in runs if x.group == r.group) else None
        ax.plot(epochs, [r.curve[e] for e in epochs], color=colour, lw=1.2, label=label)
        trained = sorted(r.train)
        ax.plot(trained, [r.train[e] for e in trained], color=colour, lw=0.8, ls=":")
        epoch, best = r.best
        ax.plot([epoch], [best], "o", color=colour, ms=4)
    ax.set_xlabel("epoch")
    ax.set_ylabel("perplexity: validation (solid), training (dotted)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("GPT on 10% of PTB: validation after each epoch (dots: each run's best)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def replace_runs(document: str, runs: str) -> str:
    """``document`` with its runs section (from :data:`RUNS_HEADING` to the next ``## ``
    heading) replaced by ``runs``; appended where it has none."""
    pattern = re.compile(rf"^{re.escape(RUNS_HEADING)}.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(document):
        return pattern.sub(lambda _: runs.rstrip("\n") + "\n\n", document, count=1)
    return document.rstrip("\n") + "\n\n" + runs


def report(args: argparse.Namespace) -> int:
    runs = read_runs(args.work)
    if not runs:
        raise SystemExit(f"--work {args.work}: no run with a validation under runs/")
    png = args.out.with_suffix(".png")
    plot(runs, png)
    headers = ["run", "epochs", "best valid PPL", "its epoch", "last valid PPL",
               "last epoch's train PPL", "minutes"]  # fmt: skip
    curve_headers, curves = curve_rows(runs)
    finished = [r.summary for r in runs if r.summary is not None]
    described = []
    for summary in finished[:1]:  # the runs' settings, from a finished one's summary
        knobs, size = summary["knobs"], summary["knobs"]["model"]
        commands = ", ".join(sorted({f"`{s['command']}`" for s in finished}))
        described = [
            f"Commands: {commands}. Each run: {knobs['epochs']} epochs, GPT d "
            f"{size['d_model']}, {size['n_layers']} layers, {size['n_heads']} heads, "
            f"{summary['threads']} torch thread(s); batch: `run`'s `--batch-size`.",
            "",
        ]
    text = "\n".join(
        [
            f"{RUNS_HEADING} (written by `python -m bench.bench_lm_recipe report`)",
            "",
            *described,
            environment("cpu").markdown(),
            "",
            table(headers, summary_rows(runs)),
            "",
            f"![validation curves]({png.name})",
            "",
            "Validation perplexity after each epoch (streamed; the averaged weights once "
            "averaging began):",
            "",
            table(curve_headers, curves),
            "",
        ]
    )
    print(text)
    if args.out.is_file() and args.section:
        text = replace_runs(args.out.read_text(encoding="utf-8"), text)
    args.out.write_text(text, encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run(args) if args.command == "run" else report(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train the runs asked for (finished ones are skipped)")
    r.add_argument("--ptb", type=Path, required=True, help="folder of ptb.{train,valid,test}.txt")
    r.add_argument("--work", type=Path, required=True, help="the evidence's folder")
    r.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    r.add_argument("--layout", choices=LAYOUTS, default="documents", help="lm.layout")
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seed indices")
    r.add_argument("--fraction", type=float, default=0.1, help="of PTB's training sentences")
    r.add_argument("--valid-fraction", type=float, default=0.1, help="of its validation ones")
    r.add_argument("--epochs", type=int, default=20, help="epochs of every run")
    r.add_argument(
        "--batch-size", type=int, default=4, help="documents (or stream segments) a step"
    )
    r.add_argument("--eval-batch-size", type=int, default=16, help="validation windows a batch")
    r.add_argument("--warmup-fraction", type=float, default=WARMUP_FRACTION, help="of the steps")
    r.add_argument("--d-model", type=int, default=256)
    r.add_argument("--layers", type=int, default=2)
    r.add_argument("--heads", type=int, default=4)
    r.add_argument("--jobs", type=int, default=2, help="trainings at a time (0: in this process)")
    r.add_argument("--threads", type=int, default=1, help="torch threads per training")
    w = sub.add_parser("report", help="the table, curves and plot of every finished run")
    w.add_argument("--work", type=Path, required=True)
    w.add_argument("--out", type=Path, default=REPO / "results" / "LM_RECIPE.md")
    w.add_argument("--section", action="store_true", help="replace only --out's runs section")
    return p


if __name__ == "__main__":
    sys.exit(main())
