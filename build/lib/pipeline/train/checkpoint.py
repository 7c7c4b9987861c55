"""Training checkpoints: everything a killed run needs to continue as if never stopped.

A :class:`TrainingState` is a versioned tensor record (``artifacts.files``): model,
optimizer and scheduler state, the training position (:class:`Progress`), every rank's RNG
state, the best weights so far, the averaged weights and their step count (parameter
averaging, ``train.averaging``) and the model's name and config. It loads with
``torch.load(weights_only=True)``, is written atomically, and a file of another format or
with a field missing or renamed fails when read, naming the file.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pipeline.artifacts import SavedModel, TensorRecord
from pipeline.eval.perplexity import perplexity_of
from pipeline.names import Task

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class Progress:
    """Where training stands. ``batch_in_epoch`` counts the batches of ``epoch`` already
    trained on (a resumed run skips them); ``bad_evals`` the evaluations since the best."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best_loss: float = math.inf  # the validation loss of the kept weights
    best_score: float = -math.inf  # their validation score, when the run selects on one
    best_step: int = 0
    bad_evals: int = 0
    last_eval_step: int = -1
    finished: bool = False
    stop_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Progress:
        return cls(**raw)


@dataclass(frozen=True)
class TrainingState(TensorRecord):
    """One checkpoint of a training run (rank 0 writes it; ``rng`` holds every rank's)."""

    FORMAT = 3  # 2: no average, average_count; 1: an unchecked dict of the same keys
    WHAT = "a training checkpoint (the run can start over: see the stage's message)"

    model_name: str
    model_config: dict[str, Any]
    task: str
    model: dict[str, torch.Tensor]
    best_model: dict[str, torch.Tensor] | None
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    progress: dict[str, Any]
    rng: list[dict[str, Any]]
    metrics: dict[str, float]
    seed: int
    average: dict[str, torch.Tensor] | None  # the averaged model's state_dict, once begun
    average_count: int  # the optimizer steps averaged

    @property
    def position(self) -> Progress:
        return Progress.from_dict(self.progress)

    def exported(self, metrics: dict[str, float], run_name: str) -> SavedModel:
        """The model this run keeps: its best weights (else the averaged ones, else the
        final ones), with what rebuilds it."""
        return SavedModel(
            model_name=self.model_name,
            model_config=self.model_config,
            task=self.task,
            weights=self.best_model or self.average or self.model,
            metrics=metrics,
            run_name=run_name,
        )


def cpu_state(module_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached CPU copy of a ``state_dict`` (the best weights kept while training goes on)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module_state.items()}


def final_metrics(progress: Progress, task: Task | str) -> dict[str, float]:
    """A run's outcome: the validation loss (and perplexity) of the kept weights (the
    lowest, unless the run selects on a score: then ``best_valid_score`` too), where, and
    how long."""
    out = {
        "best_valid_loss": progress.best_loss,
        "best_step": float(progress.best_step),
        "steps": float(progress.step),
        "epochs": float(progress.epoch),
    }
    if Task(task) != Task.SELECT:
        out["best_valid_ppl"] = perplexity_of(progress.best_loss)
    if math.isfinite(progress.best_score):
        out["best_valid_score"] = progress.best_score
    return out


def summary(state: TrainingState) -> dict[str, float]:
    """The final metrics recorded in a checkpoint."""
    return final_metrics(state.position, state.task)
