"""params.yaml -> typed params: defaults, rejections naming the key, and the file we ship."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipeline.config import CorpusName, Params, load_params, parse_params
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def test_shipped_params_validate(shipped: dict) -> None:
    params = parse_params(shipped)
    assert params.corpora == (CorpusName.CHITCHAT,)
    assert params.corpus("chitchat").generate.max_history == 150
    assert params.corpus("multiwoz").vocab.size == 1505


def _with(raw: dict, dotted: str, value: object) -> dict:
    raw = copy.deepcopy(raw)
    node = raw
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node[key]
    node[leaf] = value
    return raw


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("tokenize.corpora.chitchat.generate.max_history", 0, "greater than 0"),
        ("tokenize.corpora.chitchat.vocab.kind", "chars", "'word' or 'bpe'"),
        ("tokenize.corpora.chitchat.vocab.size", "big", "valid integer"),
        ("tokenize.on_error", "ignore", "'raise' or 'skip'"),
        ("download.retries", -1, "greater than or equal to 0"),
        ("tokenize.corpora.chitchat.typo_key", 1, "Extra inputs are not permitted"),
    ],
)
def test_bad_values_name_the_dotted_key(
    shipped: dict, key: str, value: object, reason: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_params(_with(shipped, key, value))
    assert err.value.key == key
    assert reason in err.value.reason


def test_cross_field_rules(shipped: dict) -> None:
    with pytest.raises(ConfigError, match="valid \\+ test"):
        parse_params(_with(shipped, "tokenize.corpora.chitchat.split", {"valid": 0.5, "test": 0.5}))
    raw = _with(shipped, "corpora", ["chitchat", "ptb"])
    del raw["tokenize"]["corpora"]["ptb"]
    with pytest.raises(ConfigError, match=r"no entry for \['ptb'\]"):
        parse_params(raw)
    with pytest.raises(ConfigError) as err:
        parse_params(_with(shipped, "corpora", ["chitchat", "imdb"]))
    assert err.value.key == "corpora.1"


def test_params_are_frozen(shipped: dict) -> None:
    params = parse_params(shipped)
    with pytest.raises(Exception, match="frozen"):
        params.download.retries = 3  # type: ignore[misc]


def test_load_params_reports_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_params(tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text("corpora: [chitchat\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_params(tmp_path / "params.yaml")


def test_defaults_are_a_valid_params_object() -> None:
    assert isinstance(parse_params({"tokenize": {"corpora": {"chitchat": {}}}}), Params)


def test_cross_field_errors_name_the_field(shipped: dict) -> None:
    raw = copy.deepcopy(shipped)
    raw["tune"]["runs"]["unet-chitchat"] = {"model": "unet", "corpus": "chitchat"}
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    assert err.value.key == "tune.runs.unet-chitchat"
    assert "tune.spaces has no entry for 'unet'" in err.value.reason
