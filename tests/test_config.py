"""params.yaml -> typed params: defaults, rejections naming the key, and the file we ship."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipeline.config import CorpusName, Params, load_params, parse_params, parse_run_key
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
        ("tokenize.corpora.chitchat.typo_key", 1, "unknown key; allowed here: tasks, vocab"),
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


# --------------------------------------------------------------------------- names and refs


@pytest.fixture(scope="module")
def tiny() -> dict:
    return yaml.safe_load((REPO / "profiles" / "tiny.yaml").read_text())


def _error(raw: dict) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    return err.value


def test_shipped_profiles_validate_with_their_names_and_references() -> None:
    for name in (
        "params.yaml",
        "profiles/tiny.yaml",
        "profiles/paper.yaml",
        "profiles/study.yaml",
    ):
        parse_params(yaml.safe_load((REPO / name).read_text()))


def test_misspelled_model_key_is_rejected_with_the_closest_name(tiny: dict) -> None:
    err = _error(_with(tiny, "train.models.hierr", {"clip_norm": 0.5}))
    assert err.key == "train.models.hierr"
    assert err.reason.startswith("no model named 'hierr'; did you mean 'hier'? registered: ")
    assert "hrt_last" in err.reason


def test_run_of_a_model_that_does_not_exist_names_its_key(tiny: dict) -> None:
    run = {"model": "transfomer", "corpus": "chitchat"}
    err = _error(_with(tiny, "train.runs.transfomer-chitchat", run))
    assert err.key == "train.runs.transfomer-chitchat.model"
    assert "did you mean 'transformer'?" in err.reason
    err = _error(_with(tiny, "tune.runs.hierr-chitchat", {"model": "hierr", "corpus": "chitchat"}))
    assert err.key == "tune.runs.hierr-chitchat"  # no tune.spaces entry comes first


def test_run_on_a_corpus_outside_corpora_names_its_key(tiny: dict) -> None:
    raw = _with(tiny, "train.runs.transformer-ptb", {"model": "transformer", "corpus": "ptb"})
    err = _error(raw)
    assert err.key == "train.runs.transformer-ptb.corpus"
    assert "'ptb' is not in corpora: ['chitchat']" in err.reason and "add it" in err.reason


def test_run_keys_parse_back_and_variants_are_checked(tiny: dict) -> None:
    assert parse_run_key("hgpt-ptb-l1_1_4") == ("hgpt", CorpusName.PTB, "l1_1_4")
    assert parse_run_key("hier-multiwoz") == ("hier", CorpusName.MULTIWOZ, None)
    for bad in ("hier", "hier-nowhere", "-chitchat", "a-chitchat-b-c"):
        with pytest.raises(ConfigError, match="no run key"):
            parse_run_key(bad)
    # a variant's model overrides are checked like any run's
    run = {
        "model": "unet",
        "corpus": "chitchat",
        "variant": "x",
        "overrides": {"model": {"n_layerz": 2}},
    }
    err = _error(_with(tiny, "train.runs.unet-chitchat-x", run))
    assert err.key == "train.runs.unet-chitchat-x.overrides.model.n_layerz"
    err = _error(_with(tiny, "train.runs.unet-chitchat-X", {**run, "variant": "X"}))
    assert err.key == "train.runs.unet-chitchat-X.variant"
    tuned = {"model": "hier", "corpus": "chitchat", "variant": "x"}
    err = _error(_with(tiny, "tune.runs.hier-chitchat-x", tuned))
    assert err.key.startswith("tune.runs.hier-chitchat-x") and "no variants" in err.reason


def test_unknown_keys_name_the_closest_allowed_key(tiny: dict) -> None:
    err = _error(_with(tiny, "trainn", {"runs": {}}))
    assert err.key == "trainn"
    assert err.reason.startswith("unknown key; did you mean 'train'? allowed here: corpora,")
    err = _error(_with(tiny, "train.defaults.optimiser", {"lr": 0.1}))
    assert (err.key, "did you mean 'optimizer'?" in err.reason) == (
        "train.defaults.optimiser",
        True,
    )
    err = _error(_with(tiny, "train.runs.unet-chitchat.overrides.epoch", 2))
    assert err.key == "train.runs.unet-chitchat.overrides.epoch"
    assert "did you mean 'epochs'?" in err.reason


def test_model_task_must_be_a_task_of_the_corpus(tiny: dict) -> None:
    raw = _with(tiny, "tokenize.corpora.chitchat.tasks", ["generate", "lm"])
    err = _error(raw)
    assert err.key == "train.runs.transformer_ranker-chitchat"
    assert "transformer_ranker is a select model but chitchat only yields" in err.reason
    assert "add select to tokenize.corpora.chitchat.tasks" in err.reason


def test_an_act_model_needs_a_corpus_with_acts_and_takes_their_inventory(tiny: dict) -> None:
    raw = _with(tiny, "train.runs.hier_pp-chitchat", {"model": "hier_pp", "corpus": "chitchat"})
    err = _error(raw)
    assert err.key == "train.runs.hier_pp-chitchat.corpus"
    assert "hier_pp reads the dialogue acts of its corpus, and this corpus has none" in err.reason
    err = _error(_with(tiny, "train.models.hier_pp.model.n_acts", 44))
    assert err.key == "train.models.hier_pp.model.n_acts"
    assert "comes from the data" in err.reason


@pytest.mark.parametrize(
    ("key", "value", "where", "reason"),
    [
        ("train.models.unet.model.d_modle", 8, "", "unet's config has no field 'd_modle'; did"),
        ("train.models.unet.model.n_heads", 0, "", "greater than or equal to 1"),
        ("train.runs.unet-chitchat.overrides.model.d_ff", -1, "", "greater than or equal to 1"),
        ("train.defaults.model", {"d_hidden": 8}, ".d_hidden", "config has no field 'd_hidden'"),
        ("train.models.unet_linear.model", {"linear_skip": False}, ".linear_skip", "fixed to"),
    ],
)
def test_model_overrides_are_fields_of_the_models_config(
    tiny: dict, key: str, value: object, where: str, reason: str
) -> None:
    err = _error(_with(tiny, key, value))
    assert err.key == key + where
    assert reason in err.reason


def test_search_spaces_and_decodings_name_real_models_and_fields(tiny: dict) -> None:
    dim = {"kind": "int", "low": 1, "high": 2}
    err = _error(_with(tiny, "tune.spaces.hier.model.n_hedas", dim))
    assert err.key == "tune.spaces.hier.model.n_hedas"
    assert "did you mean 'n_heads'?" in err.reason
    err = _error(
        _with(tiny, "tune.spaces.hier", {"model": {"n_heads": dim}, "per_head": {"d_fff": dim}})
    )
    assert err.key == "tune.spaces.hier.per_head.d_fff" and "did you mean 'd_ff'?" in err.reason
    err = _error(_with(tiny, "tune.spaces.heir", {"model": {"n_heads": dim}}))
    assert err.key == "tune.spaces.heir" and "did you mean 'hier'?" in err.reason
    err = _error(_with(tiny, "evaluate.models.transformr", [{"strategy": "greedy"}]))
    assert err.key == "evaluate.models.transformr"
    err = _error(_with(tiny, "evaluate.models.transformer_ranker", [{"strategy": "greedy"}]))
    assert "select model; decodings apply to generate models only" in err.reason
    err = _error(_with(tiny, "tune.runs.hier-chitchat.overrides", {"epochs": 3}))
    assert err.key == "tune.runs.hier-chitchat.overrides"
    assert "move these keys to train.models.hier" in err.reason


def test_every_stage_script_stops_at_bad_params_before_any_work(
    tiny: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stages import check, download, tokenize

    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(_with(tiny, "train.models.hierr", {"clip_norm": 0.5})))
    out = tmp_path / "out"
    assert download.main(["chitchat", "--params", str(bad), "--out", str(out)]) == 1
    args = ["chitchat", "--params", str(bad), "--raw", str(out), "--out", str(out)]
    assert tokenize.main(args) == 1
    assert check.main(["--params", str(bad), "--out", str(out / "checked")]) == 1
    assert not out.exists()
    assert capsys.readouterr().err.count("train.models.hierr: no model named 'hierr'") == 3
    bad.write_text(yaml.safe_dump(tiny))
    assert check.main(["--params", str(bad), "--out", str(out / "checked")]) == 0
    assert (out / "checked").read_text() == check.CHECKED


def test_download_skip_is_checked_against_the_corpus_and_train_on() -> None:
    corpora = {"multiwoz21": {"tasks": ["generate"]}}
    base = {"corpora": ["multiwoz21"], "tokenize": {"corpora": corpora}}
    with pytest.raises(ConfigError) as err:
        parse_params({**base, "download": {"skip": {"multiwoz21": ["train"]}}})
    assert err.value.key == "download.skip.multiwoz21"
    assert "train_on: valid" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_params({**base, "download": {"skip": {"chitchat": ["train"]}}})
    assert err.value.key == "download.skip.chitchat" and "no per-split files" in str(err.value)
    corpora["multiwoz21"]["train_on"] = "valid"  # type: ignore[assignment]
    params = parse_params({**base, "download": {"skip": {"multiwoz21": ["train"]}}})
    assert params.download.skip == {"multiwoz21": ("train",)}


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


def test_selecting_on_the_multiwoz_score_needs_a_multiwoz_generate_run(tiny: dict) -> None:
    err = _error(_with(tiny, "train.defaults.select_by", "multiwoz_score"))
    assert err.key == "train.defaults.select_by"
    assert "multiwoz_score scores MultiWOZ responses" in err.reason
    assert "on chitchat: select it by valid_loss" in err.reason
    run = "train.runs.transformer-chitchat.overrides.select_by"
    assert _error(_with(tiny, run, "multiwoz_score")).key == run
    err = _error(_with(tiny, "train.defaults.select_by", "bleu"))
    assert err.key == "train.defaults.select_by" and "valid_loss" in err.reason


def test_a_variant_selected_on_the_multiwoz_score_names_its_own_key(tiny: dict) -> None:
    """A variant key may hold dots (``l1.5``): the error names the run's own overrides."""
    raw = copy.deepcopy(tiny)
    raw["train"]["runs"]["gpt-chitchat-l1.5"] = {
        "model": "gpt",
        "corpus": "chitchat",
        "variant": "l1.5",
        "overrides": {"select_by": "multiwoz_score"},
    }
    err = _error(raw)
    assert err.key == "train.runs.gpt-chitchat-l1.5.overrides.select_by"
    assert "run gpt-chitchat-l1.5 is a lm model" in err.reason
