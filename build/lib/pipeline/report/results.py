"""What the report reads: per run, the evaluate stage's outputs and the train record.

Everything is read through the stage contract (``pipeline.artifacts``): ``metrics/<key>.json``
(flat; with several seeds a value is the mean over seeds and ``<metric>_ci95`` the
half-width of its 95% interval), ``data/eval/<key>/per_example.jsonl``
(:class:`~pipeline.artifacts.ExampleResult` rows), the run's
:class:`~pipeline.artifacts.TrainRecord` (train metrics, MLflow runs) and its exported
model (its config, for the parameter count).

The runs expected are those ``params.yaml`` trains (``train.runs`` and ``tune.runs``);
a missing or malformed file is a ``DataError`` naming it (and the line).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.artifacts import (
    PER_EXAMPLE_FILE,
    ExampleResult,
    Layout,
    TrainedSeed,
    read_examples,
    read_metrics,
    read_train,
)
from pipeline.config import Params, run_label
from pipeline.eval.catalogue import CI_SUFFIX
from pipeline.eval.stats import mean_ci
from pipeline.models import registry
from pipeline.models.base import count_parameters
from pipeline.models.saved import load_model
from pipeline.names import Task


@dataclass(frozen=True)
class ExpectedRun:
    """A run ``params.yaml`` trains: ``<model>-<corpus>[-<variant>]``."""

    key: str
    model: str
    corpus: str
    tuned: bool
    variant: str | None = None


def expected_runs(params: Params) -> list[ExpectedRun]:
    """Every trained run (untuned ones first), in ``params.yaml`` order."""
    runs = [
        ExpectedRun(k, t.model, t.corpus, False, t.variant) for k, t in params.train.runs.items()
    ]
    runs += [ExpectedRun(k, t.model, t.corpus, True) for k, t in params.tune.runs.items()]
    return runs


@dataclass(frozen=True)
class Estimate:
    """A metric's mean over seeds with its 95% half-width (NaN: one seed, no estimate)."""

    mean: float
    ci95: float

    def format(self, digits: int) -> str:
        if math.isnan(self.ci95):
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.ci95:.{digits}f}"


@dataclass(frozen=True)
class RunResult:
    """Everything the report knows about one trained and evaluated run."""

    key: str
    model: str
    corpus: str
    task: Task
    tuned: bool
    metrics: dict[str, float]
    trained: tuple[TrainedSeed, ...]
    examples: tuple[ExampleResult, ...]
    n_parameters: int
    model_config: dict[str, Any]
    variant: str | None = None  # a further run of the same model and corpus (a sweep)

    @property
    def label(self) -> str:
        """The run's row name: ``hgpt``, or ``hgpt (l2_2_2)`` for a variant."""
        return run_label(self.model, self.variant)

    def estimate(self, name: str) -> Estimate | None:
        """``name`` from metrics.json (NaN if the evaluate stage wrote null), else a train
        metric of every seed (``best_valid_loss``) as mean ± CI; None if absent."""
        if name in self.metrics:
            ci = self.metrics.get(f"{name}{CI_SUFFIX}", math.nan)
            return Estimate(self.metrics[name], ci)
        values = [t.metric(name) for t in self.trained if t.metrics.get(name) is not None]
        if not values or len(values) != len(self.trained):
            return None
        ci = mean_ci(values)
        return Estimate(ci.mean, ci.half_width)

    @property
    def seeds(self) -> list[int]:
        return sorted({row.seed for row in self.examples})


def _n_parameters(path: Path) -> tuple[int, dict[str, Any]]:
    """Trainable parameters of an exported model, and its config."""
    model = load_model(path)
    return count_parameters(model), model.config.model_dump(mode="json")


def load_run(root: Path, run: ExpectedRun) -> RunResult:
    """Read one run's eval outputs and train record."""
    layout = Layout(root)
    metrics = read_metrics(layout.metrics(run.key))
    trained = tuple(read_train(layout, run.key).seeds)
    n_params, config = _n_parameters(layout.resolve(trained[0].checkpoint))
    return RunResult(
        key=run.key,
        model=run.model,
        corpus=run.corpus,
        task=registry.spec(run.model).task,
        tuned=run.tuned,
        metrics=metrics,
        trained=trained,
        examples=read_examples(layout.eval_out(run.key) / PER_EXAMPLE_FILE),
        n_parameters=n_params,
        model_config=config,
        variant=run.variant,
    )


def load_results(params: Params, root: Path) -> list[RunResult]:
    """Every trained run's results, in ``params.yaml`` order."""
    return [load_run(root, run) for run in expected_runs(params)]
