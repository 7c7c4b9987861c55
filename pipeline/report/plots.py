"""The report's figures, PNG files drawn with matplotlib's object API on the Agg canvas
(no pyplot: no global state, no display needed).

- ``learning_curves``: validation loss per step of every run, one panel per task;
- ``metric_bars``: each run's headline metric with its 95% interval;
- ``length_vs_loss``: history length against per-example test loss (U-Net paper, Table 7);
- ``attention_masks``: the UT- and CT-masks of one real history (HIER paper, Figure 2);
- ``unet_widths``: the width, head size and relative length of each U-Net encoder layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pipeline.data.batch import History
from pipeline.eval.catalogue import HEADLINE
from pipeline.models import masks
from pipeline.models.unet import UNetConfig
from pipeline.names import Task
from pipeline.report.results import RunResult

DPI = 110
# What each task validates on (the overview's columns say the same).
AXIS_LABELS = {
    Task.GENERATE: "cross-entropy (nats/token)",
    Task.LM: "cross-entropy (nats/token)",
    Task.SELECT: "ranking loss (nats: the ranker's model.loss)",
}


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def _grid(n: int, width: float = 5.0, height: float = 3.6) -> tuple[Figure, list]:
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


@dataclass(frozen=True)
class Curve:
    """Validation loss of one run against the optimizer step."""

    key: str
    task: Task
    steps: tuple[int, ...]
    values: tuple[float, ...]


def learning_curves(curves: Sequence[Curve], path: Path) -> Path:
    """Validation loss per step, a panel per task (their losses are not comparable)."""
    tasks = list(dict.fromkeys(c.task for c in curves)) or ["(no curves)"]
    fig, axes = _grid(len(tasks), 6.0, 4.0)
    for ax, task in zip(axes, tasks, strict=True):
        for curve in (c for c in curves if c.task == task):
            ax.plot(curve.steps, curve.values, marker="o", markersize=3, label=curve.key)
        ax.set_title(f"{task}: validation loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(AXIS_LABELS.get(task, "validation loss"))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(
                0.5, 0.5, "no validation history in MLflow", ha="center", transform=ax.transAxes
            )
    return _save(fig, path)


def metric_bars(
    runs: Sequence[RunResult], path: Path, chance: dict[str, float] | None = None
) -> Path:
    """Each run's headline metric (mean with 95% interval), a panel per task and corpus;
    ``chance[corpus]``: the chance level of the select headline (a dashed line)."""
    groups = list(dict.fromkeys((r.task, r.corpus) for r in runs))
    fig, axes = _grid(max(len(groups), 1), 5.5, 4.0)
    for ax, (task, corpus) in zip(axes, groups, strict=False):
        metric = HEADLINE[task]
        chosen = [r for r in runs if (r.task, r.corpus) == (task, corpus)]
        chosen = [r for r in chosen if r.estimate(metric.key) is not None]
        means = [r.estimate(metric.key).mean for r in chosen]  # type: ignore[union-attr]
        errors = [r.estimate(metric.key).ci95 for r in chosen]  # type: ignore[union-attr]
        errors = [0.0 if math.isnan(e) else e for e in errors]
        x = np.arange(len(chosen))
        # no interval (one seed): no error bar, not a bar of zero height with caps
        yerr = errors if any(errors) else None
        ax.bar(x, means, yerr=yerr, capsize=4, color="tab:blue", alpha=0.8)
        ax.set_xticks(x, [r.label for r in chosen], rotation=35, ha="right", fontsize=8)
        better = "lower" if metric.better.value == "lower" else "higher"
        ax.set_title(f"{corpus} / {task}: {metric.label} ({better} is better)")
        ax.grid(axis="y", alpha=0.3)
        level = (chance or {}).get(corpus) if task == Task.SELECT else None
        if level is not None:
            ax.axhline(level, color="tab:red", ls="--", lw=1, label=f"chance ({level:.2f})")
            ax.legend(fontsize=7)
        for xi, mean in zip(x, means, strict=True):  # inside the bar: clear of error bars
            ax.text(
                xi,
                mean / 2,
                f"{mean:.{metric.digits}f}",
                ha="center",
                color="white",
                fontsize=8,
                fontweight="bold",
            )
    return _save(fig, path)


MAX_POINTS = 3000


def length_vs_loss(runs: Sequence[RunResult], path: Path, seed: int = 0) -> Path:
    """History length (tokens) against per-example test loss, a panel per run with the
    Pearson r the evaluate stage measured (at most ``MAX_POINTS`` points drawn)."""
    fig, axes = _grid(max(len(runs), 1), 4.2, 3.4)
    rng = np.random.default_rng(seed)
    for ax, run in zip(axes, runs, strict=False):
        rows = [r for r in run.examples if r.n_tokens > 0]
        if len(rows) > MAX_POINTS:
            rows = [rows[i] for i in sorted(rng.choice(len(rows), MAX_POINTS, replace=False))]
        few = len(rows) < 500  # few points: make them visible
        ax.scatter(
            [r.history_tokens for r in rows],
            [r.loss for r in rows],
            s=16 if few else 4,
            alpha=0.6 if few else 0.35,
            lw=0,
        )
        r = run.estimate("length_loss_pearson_r")
        title = run.key if r is None else f"{run.key} (r = {r.mean:.3f})"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("history length (tokens)")
        ax.set_ylabel("test loss (nats/token)")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def attention_masks(history: History, tokens: Sequence[str], path: Path, title: str) -> Path:
    """UT-mask, HIER CT-mask and its transpose variant of one history (batch of one),
    tokens on both axes: black = may attend, as in the HIER paper's Figure 2."""
    if history.input_ids.shape[0] != 1:
        raise ValueError("attention_masks: pass a history batch of exactly one example")
    panels = [
        ("UT-mask (utterance layers)", masks.utterance_mask(history)),
        ("CT-mask, HIER (context layers)", masks.context_mask(history, masks.ContextMask.HIER)),
        ("CT-mask, HIER-NAACL variant", masks.context_mask(history, "hier_naacl")),
    ]
    n = int(history.input_mask[0].sum())
    if len(tokens) != n:
        raise ValueError(f"attention_masks: {len(tokens)} token labels for {n} real tokens")
    size = max(4.0, 0.16 * n + 1.5)
    fig = Figure(figsize=(3 * size, size + 0.8), layout="constrained")
    axes = fig.subplots(1, 3)
    utterance = history.utt_index[0, :n].tolist()
    for ax, (name, mask) in zip(axes, panels, strict=True):
        ax.imshow(mask[0, :n, :n].numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="none")
        ax.set_title(name, fontsize=10)
        ax.set_xticks(range(n), tokens, rotation=90, fontsize=6)
        ax.set_yticks(range(n), tokens, fontsize=6)
        ax.set_xlabel("key token")
        ax.set_ylabel("query token")
        # utterance boundaries
        for i in range(1, n):
            if utterance[i] != utterance[i - 1]:
                ax.axhline(i - 0.5, color="tab:red", lw=0.6)
                ax.axvline(i - 0.5, color="tab:red", lw=0.6)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def unet_widths(configs: Sequence[tuple[str, UNetConfig]], path: Path) -> Path:
    """Per encoder layer: output width and per-head size (bars) and the sequence length
    relative to the input (line: halved by each down layer, restored by each up layer)."""
    fig, axes = _grid(max(len(configs), 1), 5.5, 3.8)
    for ax, (label, cfg) in zip(axes, configs, strict=False):
        levels = cfg.levels
        names = ["in"] + [f"down{i}" for i in range(1, cfg.n_down + 1)]
        names += [f"up{i}" for i in range(cfg.n_down, 0, -1)] + ["out"]
        x = np.arange(len(levels))
        ax.bar(x - 0.2, cfg.widths, 0.4, label="width (d_out)")
        ax.bar(x + 0.2, cfg.head_sizes, 0.4, label="per-head size")
        for xi, w in zip(x, cfg.widths, strict=True):
            ax.annotate(str(w), (xi - 0.2, w), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, names, fontsize=8)
        ax.set_ylabel("units")
        ax.set_title(label, fontsize=9)
        twin = ax.twinx()
        relative = [0.5**level if cfg.down_up else 1.0 for level in levels]
        twin.plot(x, relative, color="tab:red", marker="o", label="relative length")
        # head-room above the bars and the line for a legend that hides nothing
        ax.set_ylim(0, max(cfg.widths) * 1.4)
        twin.set_ylim(0, 1.45)
        twin.set_ylabel("length / input length", color="tab:red")
        handles = ax.get_legend_handles_labels()
        lines = twin.get_legend_handles_labels()
        ax.legend(
            handles[0] + lines[0], handles[1] + lines[1], loc="upper center", ncol=3, fontsize=7
        )
    return _save(fig, path)
