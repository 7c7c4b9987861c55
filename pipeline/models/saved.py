"""From an exported model file to a model: the one way evaluate, the report, serving and
the CLI load what the train stage exported (``artifacts.SavedModel``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError
from torch import nn

from pipeline.artifacts import SavedModel
from pipeline.config.validation import config_error
from pipeline.errors import ConfigError, DataError
from pipeline.models import registry


def load_model(path: str | Path) -> nn.Module:
    """The model exported to ``path``, rebuilt through the registry from its stored name
    and config, weights loaded, in eval mode on the CPU (an evaluation places it on its
    device: ``ExecutionPolicy.place``)."""
    saved = SavedModel.read(path)
    try:
        spec = registry.spec(saved.model_name)
        config = spec.config_cls.model_validate(saved.model_config)
    except ConfigError as err:
        raise DataError(path, f"{err.reason}; {SavedModel.WHAT}") from None
    except ValidationError as err:
        bad = config_error(err, saved.model_name)
        raise DataError(path, f"model config is invalid ({bad}); {SavedModel.WHAT}") from None
    model = registry.build_from_config(saved.model_name, config)
    try:
        model.load_state_dict(saved.weights)
    except RuntimeError as err:
        raise DataError(path, f"weights do not fit {saved.model_name} ({err})") from None
    return model.eval()
