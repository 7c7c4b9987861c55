"""The params check (``pipeline.plan.checked``/``load_checked``): names and cross-references
of ``params.yaml`` against the model registry and the corpora, each error naming the dotted
key to fix, before any stage computes. Section-level rules are ``tests/test_config.py``'s."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipeline.config import Params, SourceFormat, parse_params
from pipeline.errors import ConfigError
from pipeline.plan import check_params, checked, load_checked
from tests.test_config import with_value

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny() -> dict:
    return yaml.safe_load((REPO / "profiles" / "tiny.yaml").read_text())


def _error(raw: dict) -> ConfigError:
    """The check's error for ``raw``, whose sections alone are valid (so the error is the
    cross-reference check's, not a section's)."""
    params = parse_params(raw)
    with pytest.raises(ConfigError) as err:
        check_params(params)
    with pytest.raises(ConfigError) as again:
        checked(raw)
    assert (again.value.key, again.value.reason) == (err.value.key, err.value.reason)
    return err.value


@pytest.mark.parametrize(
    "name",
    [
        "params.yaml",
        *("profiles/tiny.yaml", "profiles/paper.yaml", "profiles/study.yaml"),
        "profiles/custom.yaml",  # run end to end, with shorter trainings: test_custom_profile
    ],
)
def test_shipped_profiles_validate_with_their_names_and_references(name: str) -> None:
    assert isinstance(load_checked(REPO / name), Params)


def test_misspelled_model_key_is_rejected_with_the_closest_name(tiny: dict) -> None:
    err = _error(with_value(tiny, "train.models.hierr", {"clip_norm": 0.5}))
    assert err.key == "train.models.hierr"
    assert err.reason.startswith("no model named 'hierr'; did you mean 'hier'? registered: ")
    assert "hrt_last" in err.reason


def test_run_of_a_model_that_does_not_exist_names_its_key(tiny: dict) -> None:
    run = {"model": "transfomer", "corpus": "chitchat"}
    err = _error(with_value(tiny, "train.runs.transfomer-chitchat", run))
    assert err.key == "train.runs.transfomer-chitchat.model"
    assert "did you mean 'transformer'?" in err.reason
    raw = with_value(tiny, "tune.runs.hierr-chitchat", {"model": "hierr", "corpus": "chitchat"})
    with pytest.raises(ConfigError) as tuned:
        checked(raw)
    assert tuned.value.key == "tune.runs.hierr-chitchat"  # no tune.spaces entry comes first


def test_run_on_a_corpus_outside_corpora_names_its_key(tiny: dict) -> None:
    raw = with_value(tiny, "train.runs.transformer-ptb", {"model": "transformer", "corpus": "ptb"})
    err = _error(raw)
    assert err.key == "train.runs.transformer-ptb.corpus"
    assert "'ptb' is not in corpora: ['chitchat']" in err.reason and "add it" in err.reason


def test_a_variants_model_overrides_are_checked_like_any_runs(tiny: dict) -> None:
    run = {
        "model": "unet",
        "corpus": "chitchat",
        "variant": "x",
        "overrides": {"model": {"n_layerz": 2}},
    }
    err = _error(with_value(tiny, "train.runs.unet-chitchat-x", run))
    assert err.key == "train.runs.unet-chitchat-x.overrides.model.n_layerz"
    assert "did you mean 'n_layers'?" in err.reason


def test_model_task_must_be_a_task_of_the_corpus(tiny: dict) -> None:
    raw = with_value(tiny, "tokenize.corpora.chitchat.tasks", ["generate", "lm"])
    err = _error(raw)
    assert err.key == "train.runs.transformer_ranker-chitchat"
    assert "transformer_ranker is a select model but chitchat only yields" in err.reason
    assert "add select to tokenize.corpora.chitchat.tasks" in err.reason


def test_an_act_model_needs_a_corpus_with_acts_and_takes_their_inventory(tiny: dict) -> None:
    raw = with_value(
        tiny, "train.runs.hier_pp-chitchat", {"model": "hier_pp", "corpus": "chitchat"}
    )
    err = _error(raw)
    assert err.key == "train.runs.hier_pp-chitchat.corpus"
    assert "hier_pp reads the dialogue acts of its corpus, and this corpus has none" in err.reason
    err = _error(with_value(tiny, "train.models.hier_pp.model.n_acts", 44))
    assert err.key == "train.models.hier_pp.model.n_acts"
    assert "comes from the data" in err.reason


@pytest.mark.parametrize("form", list(SourceFormat))
def test_an_act_model_on_a_declared_corpus_follows_its_formats_acts_trait(
    tiny: dict, form: SourceFormat
) -> None:
    """The check asks the format's row (``SourceFormat.traits.acts``), not its name."""
    raw = with_value(tiny, "corpora", [*tiny["corpora"], "mine"])
    raw = with_value(raw, "tokenize.corpora.mine.source", {"format": form.value, "file": "d"})
    raw = with_value(raw, "train.runs.hier_pp-mine", {"model": "hier_pp", "corpus": "mine"})
    if form.traits.acts:
        checked(raw)
        return
    err = _error(raw)
    assert err.key == "train.runs.hier_pp-mine.corpus"
    assert "hier_pp reads the dialogue acts of its corpus, and this corpus has none" in err.reason


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
    err = _error(with_value(tiny, key, value))
    assert err.key == key + where
    assert reason in err.reason


def test_search_spaces_and_decodings_name_real_models_and_fields(tiny: dict) -> None:
    dim = {"kind": "int", "low": 1, "high": 2}
    err = _error(with_value(tiny, "tune.spaces.hier.model.n_hedas", dim))
    assert err.key == "tune.spaces.hier.model.n_hedas"
    assert "did you mean 'n_heads'?" in err.reason
    err = _error(
        with_value(
            tiny, "tune.spaces.hier", {"model": {"n_heads": dim}, "per_head": {"d_fff": dim}}
        )
    )
    assert err.key == "tune.spaces.hier.per_head.d_fff" and "did you mean 'd_ff'?" in err.reason
    err = _error(with_value(tiny, "tune.spaces.heir", {"model": {"n_heads": dim}}))
    assert err.key == "tune.spaces.heir" and "did you mean 'hier'?" in err.reason
    err = _error(with_value(tiny, "evaluate.models.transformr", [{"strategy": "greedy"}]))
    assert err.key == "evaluate.models.transformr"
    err = _error(with_value(tiny, "evaluate.models.transformer_ranker", [{"strategy": "greedy"}]))
    assert "select model; decodings apply to generate models only" in err.reason
    err = _error(with_value(tiny, "tune.runs.hier-chitchat.overrides", {"epochs": 3}))
    assert err.key == "tune.runs.hier-chitchat.overrides"
    assert "move these keys to train.models.hier" in err.reason


@pytest.mark.parametrize(
    "key",
    [
        "train.defaults.batch_size",
        "train.models.gpt.batch_size",
        "train.runs.unet-chitchat.overrides.batch_size",
    ],
)
def test_a_batch_that_does_not_split_over_the_workers_names_where_it_is_set(
    tiny: dict, key: str
) -> None:
    two = with_value(tiny, "train.scale.num_workers", 2)
    assert isinstance(checked(two), Params)  # tiny's batch of 8 splits over 2 workers
    bad = with_value(two, key, 3)
    err = _error(bad)
    assert err.key == key  # the most specific key that sets it
    assert "must divide by train.scale.num_workers=2" in err.reason
    assert "make it 4" in err.reason
    # one worker (or in-process) takes any batch
    assert isinstance(checked(with_value(bad, "train.scale.num_workers", 1)), Params)


def test_every_stage_script_stops_at_bad_params_before_any_work(
    tiny: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stages import check, download, tokenize

    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(with_value(tiny, "train.models.hierr", {"clip_norm": 0.5})))
    out = tmp_path / "out"
    assert download.main(["chitchat", "--params", str(bad), "--out", str(out)]) == 1
    args = ["chitchat", "--params", str(bad), "--raw", str(out), "--out", str(out)]
    assert tokenize.main(args) == 1
    assert check.main(["--params", str(bad), "--out", str(out / "sources")]) == 1
    assert not out.exists()
    assert capsys.readouterr().err.count("train.models.hierr: no model named 'hierr'") == 3


def test_the_check_stage_declares_each_corpus_source_and_a_valid_change_keeps_them(
    tiny: dict, tmp_path: Path
) -> None:
    """The check stage's output is what each download depends on: one declaration per
    corpus of ``corpora:``, rewritten byte for byte by a change that does not touch it."""
    from pipeline.artifacts import SourceDeclaration
    from stages import check

    good = tmp_path / "params.yaml"
    good.write_text(yaml.safe_dump(tiny))
    out = tmp_path / "sources"
    assert check.main(["--params", str(good), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["chitchat.json"]
    declared = out / "chitchat.json"
    assert SourceDeclaration.read(declared) == SourceDeclaration(corpus="chitchat", source=None)
    before = declared.read_bytes()
    good.write_text(yaml.safe_dump(with_value(tiny, "evaluate.n_samples", 3)))
    assert check.main(["--params", str(good), "--out", str(out)]) == 0
    assert declared.read_bytes() == before
    # a corpus added gets its declaration; taken out again, it leaves none behind
    more = with_value(tiny, "corpora", ["chitchat", "ptb"])
    good.write_text(yaml.safe_dump(with_value(more, "tokenize.corpora.ptb", {})))
    assert check.main(["--params", str(good), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["chitchat.json", "ptb.json"]
    good.write_text(yaml.safe_dump(tiny))
    assert check.main(["--params", str(good), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["chitchat.json"]


def test_download_skip_is_checked_against_the_corpus_and_train_on() -> None:
    corpora = {"multiwoz21": {"tasks": ["generate"]}}
    base = {"corpora": ["multiwoz21"], "tokenize": {"corpora": corpora}}
    err = _error({**base, "download": {"skip": {"multiwoz21": ["train"]}}})
    assert err.key == "download.skip.multiwoz21"
    assert "train_on: valid" in str(err)
    err = _error({**base, "download": {"skip": {"chitchat": ["train"]}}})
    assert err.key == "download.skip.chitchat" and "no per-split files" in str(err)
    corpora["multiwoz21"]["train_on"] = "valid"  # type: ignore[assignment]
    params = checked({**base, "download": {"skip": {"multiwoz21": ["train"]}}})
    assert params.download.skip == {"multiwoz21": ("train",)}


def test_selecting_on_the_multiwoz_score_needs_a_multiwoz_generate_run(tiny: dict) -> None:
    err = _error(with_value(tiny, "train.defaults.select_by", "multiwoz_score"))
    assert err.key == "train.defaults.select_by"
    assert "multiwoz_score scores MultiWOZ responses" in err.reason
    assert "on chitchat: select it by valid_loss" in err.reason
    run = "train.runs.transformer-chitchat.overrides.select_by"
    assert _error(with_value(tiny, run, "multiwoz_score")).key == run
    with pytest.raises(ConfigError) as bleu:
        checked(with_value(tiny, "train.defaults.select_by", "bleu"))
    assert bleu.value.key == "train.defaults.select_by" and "valid_loss" in bleu.value.reason


def test_selecting_on_the_mrr_needs_a_select_run(tiny: dict) -> None:
    """``select_by: mrr`` ranks candidates: a generate or lm run is refused by its key."""
    err = _error(with_value(tiny, "train.defaults.select_by", "mrr"))
    assert err.key == "train.defaults.select_by"
    assert "mrr ranks a select model's candidates" in err.reason
    assert "but run transformer-chitchat is a generate model on chitchat" in err.reason
    ranker = "train.models.transformer_ranker.select_by"
    assert (
        checked(with_value(tiny, ranker, "mrr"))
        .train.run("transformer_ranker", "chitchat")
        .select_by
        == "mrr"
    )
    run = "train.runs.gpt-chitchat.overrides.select_by"
    assert _error(with_value(tiny, run, "mrr")).key == run


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


def test_a_corpus_s_lm_validation_is_its_lm_test_protocol(tiny: dict) -> None:
    """The weights an LM keeps are chosen on the protocol its test is reported on:
    ``tokenize.corpora.<c>.lm.validation`` must equal the corpus's evaluate protocol."""
    raw = copy.deepcopy(tiny)
    corpus = next(name for name, c in raw["tokenize"]["corpora"].items() if "lm" in c["tasks"])
    stream = {"protocol": "stream", "context_tokens": 20}
    raw["evaluate"].setdefault("corpora", {})[corpus] = {"lm": stream}
    err = _error(raw)
    assert err.key == f"tokenize.corpora.{corpus}.lm.validation"
    assert "give both the same settings" in err.reason
    raw["tokenize"]["corpora"][corpus].setdefault("lm", {})["validation"] = stream
    checked(raw)


@pytest.mark.parametrize(
    ("storage", "reason"),
    [
        ("http://host/runs", "http:// is no filesystem checkpoints can be written to"),
        ("ftp://host/runs", "ftp:// is no filesystem"),
        ("s3://", "names no bucket: give s3://<bucket>/<prefix>"),
        ("gs:///runs", "names no bucket"),
    ],
)
def test_a_storage_uri_no_run_can_write_to_is_refused_naming_its_setting(
    tiny: dict, monkeypatch: pytest.MonkeyPatch, storage: str, reason: str
) -> None:
    monkeypatch.delenv("HIERTX_STORAGE_PATH", raising=False)
    err = _error(with_value(tiny, "train.placement.storage_path", storage))
    assert err.key == "train.placement.storage_path" and reason in err.reason
    monkeypatch.setenv("HIERTX_STORAGE_PATH", storage)
    err = _error(tiny)
    assert err.key == "$HIERTX_STORAGE_PATH" and reason in err.reason
    # a local path, or a URI of a scheme pyarrow opens, passes (nothing reached)
    monkeypatch.setenv("HIERTX_STORAGE_PATH", "/mnt/shared/runs")
    assert isinstance(checked(with_value(tiny, "train.placement.storage_path", "gs://b/r")), Params)


def test_the_check_stage_opens_the_storage_uri_as_the_runs_will(
    tiny: dict, tmp_path: Path, s3, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Before any stage computes: a bucket that does not exist, or a URI pyarrow cannot
    open, fails the check naming the setting it came from; a bucket that answers passes."""
    from stages import check

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny))
    out = ["--params", str(params), "--out", str(tmp_path / "sources")]
    monkeypatch.setenv("HIERTX_STORAGE_PATH", f"s3://{s3.new_bucket()}/runs")
    assert check.main(out) == 0
    monkeypatch.setenv("HIERTX_STORAGE_PATH", "s3://no-such-bucket/runs")
    assert check.main(out) == 1
    err = capsys.readouterr().err
    assert "$HIERTX_STORAGE_PATH: s3://no-such-bucket/runs: the bucket" in err
    assert "does not exist: create it" in err
    monkeypatch.delenv("HIERTX_STORAGE_PATH")
    params.write_text(
        yaml.safe_dump(with_value(tiny, "train.placement.storage_path", "hdfs://nowhere/runs"))
    )
    assert check.main(out) == 1
    assert "train.placement.storage_path: pyarrow cannot open hdfs://nowhere/runs" in (
        capsys.readouterr().err
    )
