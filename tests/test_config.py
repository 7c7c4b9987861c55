"""params.yaml -> typed params, section by section (``pipeline.config.parse_params``):
defaults, rejections naming the key, and the file we ship. Names and cross-references
(models, corpora, tasks, config overrides) are the params check's: ``tests/plan/test_check.py``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipeline.config import Params, load_params, parse_params, parse_run_key
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def test_shipped_params_validate(shipped: dict) -> None:
    params = parse_params(shipped)
    assert params.corpora == ("chitchat",)
    assert params.corpus("chitchat").generate.max_history == 150
    assert params.corpus("multiwoz").vocab.size == 1505


def with_value(raw: dict, dotted: str, value: object) -> dict:
    """A deep copy of ``raw`` with ``dotted`` set to ``value`` (parents made as needed)."""
    raw = copy.deepcopy(raw)
    node = raw
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return raw


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("tokenize.corpora.chitchat.generate.max_history", 0, "greater than 0"),
        ("tokenize.corpora.chitchat.vocab.kind", "chars", "'word', 'bpe' or 'whitespace'"),
        ("tokenize.corpora.chitchat.vocab.size", "big", "valid integer"),
        ("tokenize.on_error", "ignore", "'raise' or 'skip'"),
        ("download.retries", -1, "greater than or equal to 0"),
        (
            "tokenize.corpora.chitchat.typo_key",
            1,
            "unknown key; allowed here: source, tasks, vocab",
        ),
    ],
)
def test_bad_values_name_the_dotted_key(
    shipped: dict, key: str, value: object, reason: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_params(with_value(shipped, key, value))
    assert err.value.key == key
    assert reason in err.value.reason


def test_cross_field_rules(shipped: dict) -> None:
    with pytest.raises(ConfigError, match="valid \\+ test"):
        parse_params(
            with_value(shipped, "tokenize.corpora.chitchat.split", {"valid": 0.5, "test": 0.5})
        )
    raw = with_value(shipped, "corpora", ["chitchat", "ptb"])
    del raw["tokenize"]["corpora"]["ptb"]
    with pytest.raises(ConfigError, match=r"ptb has no tokenize\.corpora entry") as err:
        parse_params(raw)
    assert err.value.key == "corpora"
    # a name in corpora is a built-in corpus or one declared under tokenize.corpora
    with pytest.raises(ConfigError, match=r"imdb has no tokenize\.corpora entry: add"):
        parse_params(with_value(shipped, "corpora", ["chitchat", "imdb"]))


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


@pytest.fixture(scope="module")
def tiny() -> dict:
    return yaml.safe_load((REPO / "profiles" / "tiny.yaml").read_text())


def _error(raw: dict) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    return err.value


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("train: {defaults: {optimizer: {lr: VALUE}}}", "train.defaults.optimizer.lr"),
        ("train: {models: {gpt: {min_delta: VALUE}}}", "train.models.gpt.min_delta"),
        ("train: {placement: {cpus_per_worker: VALUE}}", "train.placement.cpus_per_worker"),
        (
            "tokenize: {corpora: {chitchat: {split: {valid: VALUE}}}}",
            "tokenize.corpora.chitchat.split.valid",
        ),
        ("download: {timeout_s: VALUE}", "download.timeout_s"),
    ],
)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_are_refused_naming_the_dotted_key(
    section: str, key: str, value: str
) -> None:
    """``lr: .inf`` is refused before any compute, not found later as a diverged run."""
    raw = yaml.safe_load(section.replace("VALUE", value))
    raw.setdefault("tokenize", {}).setdefault("corpora", {}).setdefault("chitchat", {})
    err = _error(raw)
    assert (err.key, err.reason) == (key, "must be a finite number")
    finite = yaml.safe_load(section.replace("VALUE", "0.05"))
    finite.setdefault("tokenize", {}).setdefault("corpora", {}).setdefault("chitchat", {})
    assert isinstance(parse_params(finite), Params)  # the same key takes a finite number


def test_a_built_in_corpus_takes_no_source_and_another_corpus_needs_one(tiny: dict) -> None:
    source = {"format": "chat_jsonl", "file": "data/mine.jsonl"}
    err = _error(with_value(tiny, "tokenize.corpora.chitchat.source", source))
    assert err.key == "tokenize.corpora.chitchat.source"
    assert "chitchat is a built-in corpus; give yours another name" in err.reason

    raw = with_value(tiny, "corpora", ["chitchat", "mychat"])
    err = _error(with_value(raw, "tokenize.corpora.mychat", {"tasks": ["generate"]}))
    assert err.key == "tokenize.corpora.mychat.source"
    assert "'mychat' is no built-in corpus" in err.reason and "declare its file" in err.reason
    # declared with a source, the same name is a corpus like any other
    params = parse_params(with_value(raw, "tokenize.corpora.mychat", {"source": source}))
    assert params.corpora == ("chitchat", "mychat")
    assert params.corpus("mychat").source is not None
    assert params.corpus("mychat").source.file == "data/mine.jsonl"


def test_run_keys_parse_back() -> None:
    assert parse_run_key("hgpt-ptb-l1_1_4") == ("hgpt", "ptb", "l1_1_4")
    assert parse_run_key("hier-multiwoz") == ("hier", "multiwoz", None)
    # whether the corpus exists is the params check's business, not the key's
    assert parse_run_key("hier-mychat") == ("hier", "mychat", None)
    for bad in ("hier", "-chitchat", "hier-", "a-chitchat-b-c"):
        with pytest.raises(ConfigError, match="no run key"):
            parse_run_key(bad)


def test_variant_names_are_checked_and_tuned_runs_have_none(tiny: dict) -> None:
    run = {"model": "unet", "corpus": "chitchat", "variant": "X"}
    err = _error(with_value(tiny, "train.runs.unet-chitchat-X", run))
    assert err.key == "train.runs.unet-chitchat-X.variant"
    tuned = {"model": "hier", "corpus": "chitchat", "variant": "x"}
    err = _error(with_value(tiny, "tune.runs.hier-chitchat-x", tuned))
    assert err.key.startswith("tune.runs.hier-chitchat-x") and "no variants" in err.reason


def test_unknown_keys_name_the_closest_allowed_key(tiny: dict) -> None:
    err = _error(with_value(tiny, "trainn", {"runs": {}}))
    assert err.key == "trainn"
    assert err.reason.startswith("unknown key; did you mean 'train'? allowed here: corpora,")
    err = _error(with_value(tiny, "train.defaults.optimiser", {"lr": 0.1}))
    assert (err.key, "did you mean 'optimizer'?" in err.reason) == (
        "train.defaults.optimiser",
        True,
    )
    err = _error(with_value(tiny, "train.runs.unet-chitchat.overrides.epoch", 2))
    assert err.key == "train.runs.unet-chitchat.overrides.epoch"
    assert "did you mean 'epochs'?" in err.reason


def test_scale_holds_only_the_workers_and_placement_the_rest(tiny: dict) -> None:
    """Placement moved out of ``train.scale`` (it is no DVC dependency): a placement key
    left under scale is refused, pointing at where it now lives."""
    err = _error(with_value(tiny, "train.scale.use_gpu", True))
    assert err.key == "train.scale.use_gpu"
    assert err.reason == "unknown key; allowed here: num_workers"
    err = _error(with_value(tiny, "train.placement.placement_strategy", "SPREAD"))
    assert err.key == "train.placement.placement_strategy"
    assert "did you mean 'strategy'?" in err.reason
    params = parse_params(with_value(tiny, "train.placement.strategy", "SPREAD"))
    assert params.train.placement.strategy == "SPREAD"


def test_evaluate_corpora_replace_only_the_keys_they_set() -> None:
    params = parse_params(
        {
            "tokenize": {"corpora": {"chitchat": {}}},
            "evaluate": {
                "max_batches": 10,
                "models": {"hier": [{"strategy": "greedy"}, {"strategy": "beam"}]},
                "corpora": {
                    "ptb": {"max_batches": None},
                    "multiwoz21": {"decodes": [{"strategy": "greedy"}]},
                },
            },
        }
    )
    ev = params.evaluate
    assert ev.for_corpus("chitchat").max_batches == 10
    assert [d.suffix for d in ev.for_corpus("chitchat").decodes_for("hier")] == ["", "_beam5"]
    assert ev.for_corpus("ptb").max_batches is None
    assert ev.for_corpus("ptb").decodes_for("hier") == ev.decodes_for("hier")
    multiwoz = ev.for_corpus("multiwoz21")
    assert multiwoz.max_batches == 10 and [d.suffix for d in multiwoz.decodes_for("hier")] == [""]
