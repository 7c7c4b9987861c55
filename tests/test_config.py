"""params.yaml -> typed params, section by section (``pipeline.config.parse_params``):
defaults, rejections naming the key, and the file we ship. Names and cross-references
(models, corpora, tasks, config overrides) are the params check's: ``tests/plan/test_check.py``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipeline.config import (
    Params,
    load_params,
    params_file,
    parse_params,
    parse_run_key,
    read_params,
)
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


def test_new_run_knobs_are_off_by_default(tiny: dict) -> None:
    knobs = parse_params(tiny).train.run("gpt", "chitchat")
    assert knobs.compile == "auto" and knobs.batch_tokens is None
    assert knobs.averaging.kind == "none" and knobs.schedule.kind == "none"
    assert (knobs.schedule.min_lr, knobs.schedule.decay_steps) == (0.0, None)


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("train.defaults.compile", "yes", "'auto', 'on', 'off' or 'reduce-overhead'"),
        ("train.defaults.batch_tokens", 0, "greater than 0"),
        ("train.models.gpt.averaging.kind", "swa", "'none', 'uniform' or 'ema'"),
        ("train.models.gpt.averaging.ema_decay", 1.0, "less than 1"),
        ("train.models.gpt.averaging.lr_factor", 0, "greater than 0"),
        ("train.runs.gpt-chitchat.overrides.averaging.epochs", 0, "greater than 0"),
        ("train.defaults.schedule.kind", "cosinus", "'cosine'"),
        ("train.defaults.schedule.min_lr", -1e-5, "greater than or equal to 0"),
    ],
)
def test_new_knobs_refuse_bad_values_naming_the_key(
    tiny: dict, key: str, value: object, reason: str
) -> None:
    err = _error(with_value(tiny, key, value))
    assert err.key == key and reason in err.reason


def test_knobs_that_bound_each_other_are_checked_where_they_meet(tiny: dict) -> None:
    """Averaging's epochs set for a model, the run's epochs in its overrides: the merged
    run is what must hold, and the error names the key that sets the bound knob."""
    raw = with_value(tiny, "train.models.gpt.averaging", {"kind": "uniform", "epochs": 3})
    err = _error(raw)  # train.defaults.epochs is 1
    assert err.key == "train.models.gpt.averaging.epochs"
    assert err.reason.startswith("3 averaged epochs in a run of 1 epochs: make it at most")
    run = "train.runs.gpt-chitchat"
    params = parse_params(with_value(raw, run, {"model": "gpt", "corpus": "chitchat",
                                                "overrides": {"epochs": 5}}))  # fmt: skip
    assert params.train.run("gpt", "chitchat").averaging.epochs == 3
    # only what a run trains is checked: no run of hgpt here (a tune trial sets its epochs)
    assert parse_params(
        with_value(tiny, "train.models.hgpt.averaging", {"kind": "ema", "epochs": 2})
    )
    cosine = {"kind": "cosine", "warmup_steps": 10, "decay_steps": 10}
    err = _error(with_value(tiny, f"{run}.overrides.schedule", cosine))
    assert err.key == f"{run}.overrides.schedule.decay_steps"
    assert err.reason.startswith("10 must exceed warmup_steps (10)")
    err = _error(with_value(tiny, "train.defaults.schedule", {"kind": "cosine", "min_lr": 1.0}))
    assert err.key == "train.defaults.schedule.min_lr"
    assert "is above optimizer.lr" in err.reason


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


# --------------------------------------------------------------------------- the file itself


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_the_shipped_files_read_as_pyyaml_reads_them() -> None:
    for path in [REPO / "params.yaml", *sorted((REPO / "profiles").glob("*.yaml"))]:
        assert read_params(path) == yaml.safe_load(path.read_text()), path


def test_a_run_written_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    """PyYAML keeps the second copy silently, and the train stage trained it."""
    lines = (REPO / "params.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("    unet-chitchat:"))
    second = (
        "    transformer-chitchat: {model: transformer, corpus: chitchat, overrides: {epochs: 1}}"
    )
    lines.insert(at + 1, second)  # two runs after the first copy
    first = 1 + next(
        i for i, line in enumerate(lines) if line.startswith("    transformer-chitchat:")
    )
    with pytest.raises(ConfigError) as err:
        load_params(_write(tmp_path, "\n".join(lines)))
    assert str(err.value) == (
        f"train.runs.transformer-chitchat: written twice, at lines {first} and {at + 2}; keep one"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "corpora: [chitchat]\ntrain: {}\ncorpora: [ptb]\n",
            "corpora: written twice, at lines 1 and 3",
        ),
        ("a:\n  - {x: 1}\n  - {y: 1, y: 2}\n", "a.1.y: written twice, at line 3"),
        ("a: {1: x, 0x1: y}\n", "a.0x1: written twice, at line 1"),  # one key, as YAML loads it
        ("a:\n  b: &b {x: 1, x: 2}\nc: *b\n", "a.b.x: written twice, at line 2"),
    ],
)
def test_a_key_written_twice_is_refused_at_any_depth(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        read_params(_write(tmp_path, text))
    assert str(err.value).startswith(message)


def test_a_merged_key_may_still_be_overridden(tmp_path: Path) -> None:
    text = "base: &base {lr: 0.1, epochs: 2}\nrun:\n  <<: *base\n  lr: 0.2\n"
    assert read_params(_write(tmp_path, text))["run"] == {"lr": 0.2, "epochs": 2}


class _Refused(yaml.SafeLoader):
    """A loader that fails the test if the reader parses anything at all."""

    def __init__(self, stream: object) -> None:
        raise AssertionError("the file was parsed")


def test_a_20_mb_params_file_is_refused_before_it_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DVC took 76 s over this file, and `dvc status` did not answer in 240 s."""
    path = tmp_path / "params.yaml"
    with path.open("w") as out:
        out.write("corpora: [chitchat]\nnotes:\n")
        out.writelines(f"  - note number {i:>12} of a very long list\n" for i in range(500_000))
    assert path.stat().st_size >= 20_000_000
    monkeypatch.setattr(params_file, "_LOADER", _Refused)
    with pytest.raises(ConfigError) as err:
        load_params(path)
    size = path.stat().st_size / 1e6
    assert str(err.value) == (
        f"params: {path} is {size:.1f} MB; the limit is 1 MB: a params file holds settings "
        "(the shipped one is 10 kB); check that this is the file you meant"
    )


def billion_laughs(levels: int) -> str:
    """A "billion laughs" document: each level an anchored list of ten of the level below."""
    lines = ['lol0: &l0 "lol"']
    for i in range(1, levels + 1):
        lines.append(f"lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


class _Unbuilt(params_file._LOADER):  # type: ignore[name-defined, misc]
    """Composes like the reader's loader, but fails the test if a document is built."""

    def construct_document(self, node: object) -> object:
        raise AssertionError("the document was built")


def test_a_billion_laughs_is_refused_before_anything_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DVC failed after 78 s with 'unexpected error - error return without exception set'."""
    # a few aliases of a small anchor stay well within the limit
    assert len(read_params(_write(tmp_path, billion_laughs(3)))["lol3"]) == 10
    path = _write(tmp_path, billion_laughs(9))
    monkeypatch.setattr(params_file, "_LOADER", _Unbuilt)
    with pytest.raises(ConfigError) as err:
        load_params(path)
    # level i expands to 1 + 10 + ... + 10^i values; the document adds its root and 10 keys,
    # and of all that only its 21 nodes are written in the file
    added = 1 + 10 + sum(sum(10**j for j in range(i + 1)) for i in range(10)) - 21
    assert added == 1_234_567_890
    assert str(err.value) == (
        f"params: {path}: its aliases (*name) expand it by {added:,} values; the limit is "
        "100,000: write the repeated settings out, or alias less"
    )


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "corpora: [chitchat]\nloop: &a [1, *a]\n")
    with pytest.raises(ConfigError) as err:
        read_params(path)
    assert str(err.value) == (
        f"params: {path}:2: an alias refers to the node that holds it, so the document never "
        "ends; write the value out"
    )


def test_deep_nesting_binary_files_and_folders_get_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot be read: Is a directory"):
        read_params(tmp_path)
    with pytest.raises(ConfigError, match=r"(not valid YAML|nests deeper)"):
        read_params(_write(tmp_path, "a: " + "[" * 100_000))
    path = tmp_path / "params.yaml"
    path.write_bytes(b"corpora: [\xff\xfe]\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 10\)"):
        read_params(path)
