"""The registry: the public names, their task kinds, and config errors naming the field."""

from __future__ import annotations

import pytest

from pipeline.artifacts import DataSizes
from pipeline.errors import ConfigError
from pipeline.models import registry
from pipeline.models.base import LanguageModel, SelectModel, Seq2SeqModel
from pipeline.names import Task

GENERATE = [
    "transformer", "adj_transformer", "transformer_skip", "transformer_skip_conv", "unet",
    "unet_linear", "unet_per_layer_att", "s2sa", "hred", "vhred", "vhcr", "hier", "hier_cls",
    "set", "mat", "hier_pp", "set_pp", "hier_joint",
]  # fmt: skip
SELECT = [
    "hrt_last", "hrt_all", "dual_lstm", "hier_lstm", "transformer_ranker",
    "transformer_last_ranker", "ensemble", "with_none",
]  # fmt: skip
LM = ["gpt", "congruent_gpt", "hgpt", "congruent_hgpt"]


def test_every_public_name_is_registered_with_its_task() -> None:
    assert registry.names() == sorted(GENERATE + SELECT + LM)
    assert registry.names(Task.GENERATE) == sorted(GENERATE)
    assert registry.names("select") == sorted(SELECT)
    assert registry.names(Task.LM) == sorted(LM)


@pytest.mark.parametrize("name", GENERATE + SELECT + LM)
def test_model_class_matches_task(name: str) -> None:
    base = {
        Task.GENERATE: Seq2SeqModel,
        Task.SELECT: SelectModel,
        Task.LM: LanguageModel,
    }
    spec = registry.spec(name)
    sizes = DataSizes(vocab_size=64, n_acts=5)
    model = registry.build_from_config(name, registry.make_config(name, sizes))
    assert isinstance(model, base[spec.task])
    assert model.config.vocab_size == 64


def test_unknown_model_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError, match="choose one of") as err:
        registry.spec("unet3")
    assert err.value.key == "model"


def test_unknown_and_out_of_range_fields_are_named() -> None:
    with pytest.raises(ConfigError) as err:
        registry.make_config("transformer", 100, n_hedas=4)
    assert err.value.key == "transformer.n_hedas"
    with pytest.raises(ConfigError) as err:
        registry.make_config("gpt", 100, n_heads=7)
    assert err.value.key == "gpt.n_heads"
    assert "divide" in err.value.reason


def test_presets_cannot_be_overridden() -> None:
    with pytest.raises(ConfigError, match="fixed"):
        registry.make_config("congruent_gpt", 100, congruent=False)
