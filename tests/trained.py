"""A model written as a trained run through the stage contract, as the train stage would."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from pipeline.artifacts import (
    MANIFEST_FILE,
    MODEL_FILE,
    Layout,
    MlflowRef,
    SavedModel,
    TrainedSeed,
    TrainRecord,
)
from pipeline.config import Precision, run_key
from pipeline.models import registry


def write_trained(
    root: Path,
    model_name: str,
    model: nn.Module,
    corpus: str = "chitchat",
    metrics: dict[str, float] | None = None,
    mlflow: MlflowRef | None = None,
    variant: str | None = None,
    precision: Precision = Precision.AUTO,
) -> str:
    """``data/train/<key>/{model.pt,manifest.json}`` holding ``model`` as seed 0, trained
    at ``precision``; the key."""
    key = run_key(model_name, corpus, variant)
    layout = Layout(root)
    task = registry.spec(model_name).task.value
    checkpoint = layout.train_out(key) / MODEL_FILE
    config = model.config.model_dump(mode="json")
    SavedModel(model_name, config, task, model.state_dict()).write(checkpoint)
    seed = TrainedSeed(
        seed=0,
        run_name=f"train-{key}",
        checkpoint=layout.relative(checkpoint),
        run_checkpoint="",
        metrics=metrics or {"best_valid_loss": 4.0, "steps": 20},
        mlflow=mlflow,
    )
    record = TrainRecord(model=model_name, corpus=corpus, task=task, seeds=[seed],
                         precision=precision)  # fmt: skip
    record.write(layout.train_out(key) / MANIFEST_FILE)
    return key
