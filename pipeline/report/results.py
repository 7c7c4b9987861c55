"""What the report reads: per run, the evaluate stage's outputs and the train manifest.

- ``metrics/<key>.json`` (git-tracked, ``pipeline.eval.evaluate.metrics_path``): flat
  ``{metric: value}``; with several seeds a value is the mean over seeds and
  ``<metric>_ci95`` the half-width of its 95% interval.
- ``data/eval/<key>/per_example.jsonl``: one row per test example and seed (``seed``,
  ``id``, ``nll_sum``, ``n_tokens``, ``history_tokens``; generate runs add ``hypothesis``,
  ``reference`` and maybe ``hypothesis_beam5``; select runs add ``rank``).
- ``data/train/<key>/manifest.json`` (train metrics, MLflow run) and ``model.pt`` (its
  config, for the parameter count).

The runs expected are those ``params.yaml`` trains (``train.runs`` and ``tune.runs``);
a missing or malformed file is a ``DataError`` naming it (and the line).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import tracking
from pipeline.config import Params
from pipeline.errors import DataError
from pipeline.eval.evaluate import metrics_path as eval_metrics_path
from pipeline.eval.stats import mean_ci
from pipeline.models import registry

EXAMPLES_FILE = "per_example.jsonl"
MANIFEST_FILE = "manifest.json"
CI_SUFFIX = "_ci95"


def eval_dir(root: Path, key: str) -> Path:
    return root / "data" / "eval" / key


def train_dir(root: Path, key: str) -> Path:
    return root / "data" / "train" / key


@dataclass(frozen=True)
class ExpectedRun:
    """A run ``params.yaml`` trains: ``<model>-<corpus>``."""

    key: str
    model: str
    corpus: str
    tuned: bool


def expected_runs(params: Params) -> list[ExpectedRun]:
    """Every trained run (untuned ones first), in ``params.yaml`` order."""
    runs = [ExpectedRun(k, t.model, t.corpus.value, False) for k, t in params.train.runs.items()]
    runs += [ExpectedRun(k, t.model, t.corpus.value, True) for k, t in params.tune.runs.items()]
    return runs


@dataclass(frozen=True)
class ExampleRow:
    """One test example's result for one seed."""

    seed: int | None
    id: str
    nll_sum: float
    n_tokens: int
    history_tokens: int
    hypothesis: str | None = None
    reference: str | None = None
    hypothesis_beam5: str | None = None
    rank: int | None = None

    @property
    def loss(self) -> float:
        """Mean token NLL of this example (nats)."""
        return self.nll_sum / self.n_tokens if self.n_tokens else math.nan


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
class TrainedSeed:
    """One trained model of a run: its seed (None if the manifest does not say), the train
    metrics (``best_valid_loss``, ``steps``, ...) and its MLflow run."""

    seed: int | None
    checkpoint: Path
    metrics: dict[str, float]
    mlflow_uri: str | None
    mlflow_run_id: str | None


@dataclass(frozen=True)
class RunResult:
    """Everything the report knows about one trained and evaluated run."""

    key: str
    model: str
    corpus: str
    task: str
    tuned: bool
    metrics: dict[str, float]
    trained: tuple[TrainedSeed, ...]
    examples: tuple[ExampleRow, ...]
    n_parameters: int
    model_config: dict[str, Any]

    def estimate(self, name: str) -> Estimate | None:
        """``name`` from metrics.json (NaN if the evaluate stage wrote null), else a train
        metric of every seed (``best_valid_loss``) as mean ± CI; None if absent."""
        if name in self.metrics:
            ci = self.metrics.get(f"{name}{CI_SUFFIX}", math.nan)
            return Estimate(self.metrics[name], ci)
        values = [t.metrics[name] for t in self.trained if name in t.metrics]
        if not values or len(values) != len(self.trained):
            return None
        ci = mean_ci(values)
        return Estimate(ci.mean, ci.half_width)

    @property
    def seeds(self) -> list[int | None]:
        return sorted({row.seed for row in self.examples}, key=lambda s: (s is None, s or 0))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(path, "missing; run `dvc repro` (its stage has not run)") from None
    except json.JSONDecodeError as err:
        raise DataError(path, f"not valid JSON ({err.msg})", err.lineno) from None
    if not isinstance(value, dict):
        raise DataError(path, "expected a JSON object")
    return value


_ROW_FIELDS = {f for f in ExampleRow.__dataclass_fields__}
_REQUIRED = ("seed", "id", "nll_sum", "n_tokens", "history_tokens")


def read_examples(path: Path) -> tuple[ExampleRow, ...]:
    """The rows of a ``per_example.jsonl`` (unknown keys ignored: the evaluate stage may
    add fields the report does not use)."""
    rows = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise DataError(path, "missing; run `dvc repro` (the evaluate stage has not run)") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(path, f"not valid JSON ({err.msg})", number) from None
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise DataError(path, f"row lacks {missing}", number)
        try:
            rows.append(
                ExampleRow(
                    **{k: v for k, v in raw.items() if k in _ROW_FIELDS and k != "id"},
                    id=str(raw["id"]),
                )
            )
        except TypeError as err:
            raise DataError(path, f"bad row ({err})", number) from None
    if not rows:
        raise DataError(path, "no examples")
    return tuple(rows)


def _n_parameters(model: str, path: Path) -> tuple[int, dict[str, Any]]:
    """Trainable parameters of the exported model (rebuilt from its config: counting
    the state dict would also count buffers)."""
    from pipeline.models.base import count_parameters
    from pipeline.train.checkpoint import load_checkpoint

    state = load_checkpoint(path)
    config = state["model_config"]
    cfg = registry.spec(model).config_cls.model_validate(config)
    return count_parameters(registry.build_from_config(model, cfg)), config


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def read_trained(root: Path, train: Path) -> tuple[TrainedSeed, ...]:
    """The trained seeds of a run's ``manifest.json``: its ``seeds`` list (one entry per
    seed), or the manifest itself for a single-seed run."""
    path = train / MANIFEST_FILE
    manifest = _read_json(path)
    trained = []
    for entry in manifest.get("seeds") or [manifest]:
        if "checkpoint" not in entry:
            raise DataError(path, "a seed entry has no 'checkpoint'; rerun the train stage")
        checkpoint = Path(entry["checkpoint"])
        mlflow = entry.get("mlflow") or {}
        trained.append(
            TrainedSeed(
                seed=entry.get("seed"),
                checkpoint=checkpoint if checkpoint.is_absolute() else root / checkpoint,
                metrics={k: _number(v) for k, v in (entry.get("metrics") or {}).items()},
                mlflow_uri=tracking.resolve_uri(mlflow["tracking_uri"], root)
                if mlflow.get("tracking_uri")
                else None,
                mlflow_run_id=mlflow.get("run_id"),
            )
        )
    return tuple(trained)


def load_run(root: Path, run: ExpectedRun) -> RunResult:
    """Read one run's eval outputs and train manifest."""
    evals = eval_dir(root, run.key)
    metrics_path = eval_metrics_path(root, run.key)
    metrics = _read_json(metrics_path)
    bad = [k for k, v in metrics.items() if v is not None and not isinstance(v, int | float)]
    if bad:
        raise DataError(metrics_path, f"metrics must be numbers; {bad} are not")
    trained = read_trained(root, train_dir(root, run.key))
    n_params, config = _n_parameters(run.model, trained[0].checkpoint)
    return RunResult(
        key=run.key,
        model=run.model,
        corpus=run.corpus,
        task=registry.spec(run.model).task.value,
        tuned=run.tuned,
        metrics={k: _number(v) for k, v in metrics.items()},
        trained=trained,
        examples=read_examples(evals / EXAMPLES_FILE),
        n_parameters=n_params,
        model_config=config,
    )


def load_results(params: Params, root: Path) -> list[RunResult]:
    """Every trained run's results, in ``params.yaml`` order."""
    return [load_run(root, run) for run in expected_runs(params)]
