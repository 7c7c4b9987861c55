"""PTB for the loop's parts: Mikolov's files tokenized by the project's own tokenizer into
a scratch project, and the paper profile's PTB runs planned on it.

The GPU machine has no internet and carries only the git tree, so the files come from a
folder given with ``--ptb DIR`` (``ptb.train.txt``, ``ptb.valid.txt``, ``ptb.test.txt``;
by default the git-ignored ``data/raw/ptb``, where the download stage puts them). They
are tokenized with the profile's ``tokenize.corpora.ptb`` settings into the scratch
project's shards folder (``Layout.shards``, where ``plan_training`` reads them), exactly as
the tokenize stage would.

A run's plan is ``plan_training`` of the profile's request for it, with the knobs the part
sets (steps, epochs, logging; toy widths in a smoke run), in-process (no Ray workers), its
checkpoints under the scratch folder, and no tracking (the part's sink records metrics).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.artifacts import Layout
from pipeline.config import AveragingKind, Params, RunParams
from pipeline.models import registry
from pipeline.models.base import count_parameters
from pipeline.plan import RunPlan, RunRequest, load_checked, plan_training

FILES = ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt")
RUNS = ("gpt-ptb", "congruent_gpt-ptb", "hgpt-ptb", "congruent_hgpt-ptb")
# Smoke widths, each applied where the model's config has the field.
TOY_MODEL = {
    "d_model": 16,
    "n_heads": 2,
    "d_ff": 32,
    "n_layers": 1,
    "d_sentence": 16,
    "sentence_heads": 2,
    "sentence_d_ff": 32,
    "encoder_layers": 1,
    "document_layers": 1,
    "decoder_layers": 1,
}
TOY_BATCH = 2  # documents a step in a smoke run
TOY_BATCH_TOKENS = 256  # a smoke run's token budget where the profile sets one


def missing_files(folder: Path) -> str | None:
    """What is wrong with a ``--ptb`` folder, or None."""
    if not folder.is_dir():
        return f"--ptb {folder}: no such folder"
    absent = [name for name in FILES if not (folder / name).is_file()]
    if absent:
        return (
            f"--ptb {folder}: no {', '.join(absent)} there; copy Mikolov's "
            f"{', '.join(FILES)} into one folder (e.g. data/raw/ptb) and pass it"
        )
    return None


class PTB:
    """The profile's PTB runs on a scratch project holding the tokenized corpus
    (``profile``: its file, or params already read and checked)."""

    def __init__(self, profile: Path | Params, folder: Path, root: Path, smoke: bool) -> None:
        from pipeline.data.tokenize import tokenize_corpus

        self.params: Params = profile if isinstance(profile, Params) else load_checked(profile)
        self.root, self.smoke = root, smoke
        self.record = tokenize_corpus("ptb", folder, Layout(root).shards("ptb"), self.params)

    def request(self, key: str) -> RunRequest:
        return RunRequest.of(self.params, key)

    def plan(self, key: str, **knobs: Any) -> RunPlan:
        """Run ``key`` of the profile with ``knobs`` changed, one seed, in-process."""
        request = self.request(key)
        base = request.knobs
        update: dict[str, Any] = {"seeds": 1, **knobs, **cut_short(base, knobs)}
        if self.smoke:
            fields = registry.spec(request.model).config_cls.model_fields
            toy = {k: v for k, v in TOY_MODEL.items() if k in fields}
            update |= {"model": {**base.model, **toy}, "batch_size": TOY_BATCH}
            update["eval_batch_size"] = TOY_BATCH
            if base.batch_tokens is not None:
                update["batch_tokens"] = TOY_BATCH_TOKENS
        placement = request.placement.model_copy(update={"storage_path": str(self.root / "runs")})
        request = request.model_copy(
            update={"knobs": base.model_copy(update=update), "workers": 0, "placement": placement}
        )
        return plan_training(request, self.root)


def parameters(plan: RunPlan) -> int:
    """The trainable parameters of a plan's model (built on the CPU)."""
    return count_parameters(registry.build_from_config(plan.model, plan.config))


def steps_per_epoch(plan: RunPlan) -> int:
    """Training steps in one epoch of the plan (its first rank's loader, one worker)."""
    from pipeline.train.job import shard_data

    train, _ = shard_data(plan)(0, 1)
    n = len(train)
    cut = plan.knobs.max_batches_per_epoch
    return min(n, cut) if cut is not None else n


def knobs_line(plan: RunPlan) -> str:
    """The knobs that decide a run's speed, as the part prints them."""
    k = plan.knobs
    return (
        f"batch_size {k.batch_size}, batch_tokens {k.batch_tokens}, compile {k.compile}, "
        f"precision {k.precision}"
    )


def cut_short(base: RunParams, knobs: dict[str, Any]) -> dict[str, Any]:
    """What else changes in a profile's run that a part cuts short, so that it keeps the
    rules the train stage checks before its first step (``config.run_rules``), without
    changing what a step costs: the warm-up scaled with the run (a tenth of ``max_steps``;
    the profile's share of its epochs, as ``bench_lm_recipe`` scales it, at most a tenth of
    the run where ``max_batches_per_epoch`` cuts its epochs, as a smoke run's), and no
    averaging where ``max_steps`` ends the run (the throughput part's: its million epochs
    would average only after it)."""
    schedule, warmup = base.schedule, base.schedule.warmup_steps
    if knobs.get("max_steps") is not None:
        averaging = base.averaging.model_copy(update={"kind": AveragingKind.NONE})
        steps = max(1, min(warmup, knobs["max_steps"] // 10))
        return {
            "schedule": schedule.model_copy(update={"warmup_steps": steps}),
            "averaging": averaging,
        }
    if "epochs" in knobs:
        steps = round(warmup * knobs["epochs"] / base.epochs)
        if knobs.get("max_batches_per_epoch") is not None:
            steps = min(steps, knobs["epochs"] * knobs["max_batches_per_epoch"] // 10)
        return {"schedule": schedule.model_copy(update={"warmup_steps": max(1, steps)})}
    return {}
