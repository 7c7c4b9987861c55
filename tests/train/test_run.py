"""The train stage's logic: params checked before compute, then a tiny end-to-end run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch

from pipeline import cli, tracking
from pipeline.artifacts import (
    BEST_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    Layout,
    TrainRecord,
    TuneRecord,
    load_model,
)
from pipeline.config import parse_params
from pipeline.data.loader import load_vocab
from pipeline.decode import DecodeConfig, generate
from pipeline.errors import ConfigError, DataError
from pipeline.serving import ServingSpec, generate_batch
from pipeline.train.run import plan_train, plan_tune
from pipeline.train.seeds import train_seeds
from tests.train.conftest import TINY_TRANSFORMER, stage_params


def _error(raw: dict, project: Path, model: str = "transformer") -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        plan_train(parse_params(raw), model, "chitchat", Layout(project))
    return caught.value


def test_bad_params_name_the_key_before_any_compute(project):
    with pytest.raises(ConfigError) as caught:
        parse_params(stage_params(train={"defaults": {"optimizer": {"lr": -1}}}))
    assert caught.value.key == "train.defaults.optimizer.lr"

    raw = stage_params()
    raw["train"]["models"]["transformer"]["model"] = {"n_heads": 0}
    assert _error(raw, project).key == "train.models.transformer.model.n_heads"

    raw = stage_params()
    raw["train"]["scale"] = {"num_workers": 2}
    raw["train"]["defaults"]["batch_size"] = 15
    assert _error(raw, project).key == "train.batch_size"

    raw = stage_params()
    raw["train"]["runs"]["hrt_last-chitchat"] = {"model": "hrt_last", "corpus": "chitchat"}
    err = _error(raw, project, "hrt_last")
    assert err.key == "train.runs.hrt_last-chitchat" and "select model" in err.reason

    with pytest.raises(ConfigError, match=r"runs\.oops: must be named 'transformer-chitchat'"):
        parse_params(
            stage_params(train={"runs": {"oops": {"model": "transformer", "corpus": "chitchat"}}})
        )


def test_tuned_run_needs_the_tune_result_and_uses_it(project, tmp_path):
    raw = stage_params()
    run = raw["train"].pop("runs")
    raw["train"]["runs"] = {}
    raw["tune"] = {
        "runs": run,
        "spaces": {"transformer": {"model": {"n_heads": {"kind": "int", "low": 1, "high": 2}}}},
    }
    layout = Layout(project)
    with pytest.raises(DataError, match=r"best\.json: missing: run the tune stage"):
        plan_train(parse_params(raw), "transformer", "chitchat", layout)
    best = layout.tune_out("transformer-chitchat") / BEST_FILE
    best.parent.mkdir(parents=True)
    best.write_text(json.dumps({"config": {"n_heads": 1}, "optimizer": {"lr": 0.01}}))
    with pytest.raises(DataError, match=r"best.json: not a valid TuneRecord \(model: Field"):
        plan_train(parse_params(raw), "transformer", "chitchat", layout)
    TuneRecord(
        model="transformer",
        corpus="chitchat",
        search="tune-x",
        config={"n_heads": 1},
        optimizer={"lr": 0.01},
        valid_loss=4.0,
        trial_id="t0",
        trials=2,
        errored_trials=0,
    ).write(best)
    try:
        plan = plan_train(parse_params(raw), "transformer", "chitchat", layout)
    finally:
        best.unlink()
    assert plan.config["n_heads"] == 1 and plan.config["d_model"] == 16
    assert plan.params.optimizer.lr == 0.01 and plan.tuned_from is not None

    raw["tune"]["spaces"]["transformer"]["model"]["n_hedas"] = {"kind": "int", "low": 1, "high": 2}
    with pytest.raises(ConfigError) as caught:
        plan_tune(parse_params(raw), "transformer", "chitchat", layout)
    assert caught.value.key == "tune.spaces.transformer.model.n_hedas"


def test_per_model_and_per_run_overrides_merge_over_defaults():
    raw = stage_params()
    raw["train"]["models"]["transformer"]["optimizer"] = {"lr": 0.5}
    raw["train"]["runs"]["transformer-chitchat"]["overrides"] = {
        "epochs": 9,
        "model": {"d_ff": 64},
        "optimizer": {"betas": [0.8, 0.9]},
    }
    run = parse_params(raw).train.run("transformer", "chitchat")
    assert run.epochs == 9 and run.batch_size == 16  # run, defaults
    assert run.optimizer.lr == 0.5 and run.optimizer.betas == (0.8, 0.9)  # model, run
    assert run.model == {**run.model, "d_ff": 64, "d_model": 16}


def test_a_variant_is_one_more_run_of_the_pair_with_its_own_overrides():
    raw = stage_params()
    raw["train"]["runs"]["transformer-chitchat-wide"] = {
        "model": "transformer",
        "corpus": "chitchat",
        "variant": "wide",
        "overrides": {"model": {"d_ff": 64}},
    }
    train = parse_params(raw).train
    assert train.run("transformer", "chitchat", "wide").model["d_ff"] == 64
    assert train.run("transformer", "chitchat").model == {**TINY_TRANSFORMER}
    assert train.runs["transformer-chitchat-wide"].label == "transformer (wide)"
    # the key names the variant
    raw["train"]["runs"]["transformer-chitchat-broad"] = raw["train"]["runs"].pop(
        "transformer-chitchat-wide"
    )
    with pytest.raises(ConfigError, match=r"must be named 'transformer-chitchat-wide'"):
        parse_params(raw)


@pytest.mark.slow
def test_a_variant_trains_into_its_own_folder_and_mlflow_model(project, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    raw = stage_params()
    raw["train"]["defaults"] |= {"epochs": 1, "max_batches_per_epoch": 2}
    raw["train"]["runs"] = {
        "transformer-chitchat-wide": {
            "model": "transformer",
            "corpus": "chitchat",
            "variant": "wide",
            "overrides": {"model": {"d_ff": 64}},
        }
    }
    own = project / "variant"
    shutil.copytree(project / "data" / "shards", own / "data" / "shards")
    params = parse_params(raw)
    record = train_seeds(params, "transformer", "chitchat", own, False, variant="wide")
    (seed,) = record.seeds
    assert seed.checkpoint == "data/train/transformer-chitchat-wide/model.pt"
    assert seed.mlflow.registered_model == "hiertx-transformer-chitchat-wide"
    assert load_model(own / seed.checkpoint).config.d_ff == 64
    with pytest.raises(ConfigError, match="transformer-chitchat is in neither"):
        plan_train(params, "transformer", "chitchat", Layout(own))


@pytest.mark.slow
def test_train_stage_end_to_end_with_mlflow_and_pyfunc(project, monkeypatch):
    uri = f"sqlite:///{project / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    record = train_seeds(parse_params(stage_params()), "transformer", "chitchat", project, False)

    out = project / "data" / "train" / "transformer-chitchat"
    assert TrainRecord.read(out / MANIFEST_FILE) == record
    (seed,) = record.seeds
    assert seed.checkpoint == "data/train/transformer-chitchat/model.pt"
    assert seed.metrics["steps"] == 6 and seed.metrics["epochs"] == 2
    assert seed.metrics["wall_s"] > 0  # what the study's report states per run
    assert "cores" in record.machine and "torch " in record.machine
    mf = seed.mlflow
    assert mf.model_version == "1" and mf.registered_model == "hiertx-transformer-chitchat"
    assert not mf.fallback and mf.experiment == "hiertx/generate/chitchat"

    client = mlflow.tracking.MlflowClient(uri)
    run = client.get_run(mf.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.optimizer.lr"] == "0.003"
    assert run.data.tags["hiertx.model"] == "transformer" and "hiertx.git_commit" in run.data.tags
    assert len(client.get_metric_history(run.info.run_id, "valid_loss")) == 2
    artifacts = {
        a.path
        for folder in ("tokenizer", "checkpoint", "samples")
        for a in client.list_artifacts(run.info.run_id, folder)
    }
    assert artifacts == {"tokenizer/vocab.json", "checkpoint/model.pt", "samples/generations.txt"}

    # the registered pyfunc answers like the exported checkpoint decoded in-process
    history = [["hi , how are you today ?", "good thanks , and you ?"], ["what do you do ?"]]
    pyfunc = mlflow.pyfunc.load_model(f"models:/{mf.registered_model}/{mf.model_version}")
    answers = pyfunc.predict(pd.DataFrame({"history": history}))
    model = load_model(out / MODEL_FILE)
    vocab = load_vocab(project / "data" / "shards" / "chitchat")
    spec = ServingSpec("generate", max_history=40, max_utterances=4, max_response=12)
    with torch.no_grad():
        ref = generate(model, generate_batch(history, vocab, spec), DecodeConfig(max_length=12))
    expected = [vocab.decode(r[:n].tolist()) for r, n in zip(ref.tokens, ref.lengths, strict=True)]
    assert list(answers) == expected and all(isinstance(a, str) for a in answers)


@pytest.mark.slow
def test_rerun_of_a_trained_config_keeps_its_mlflow_history(project, tmp_path, monkeypatch):
    """`dvc repro -f -s train@...` (or an experiment back at earlier params) resumes the
    finished checkpoint: the run that holds the learning curves must go on, and the
    registered version must point at it."""
    own = tmp_path / "project"
    shutil.copytree(project / "data" / "shards", own / "data" / "shards")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = parse_params(stage_params())
    first = train_seeds(params, "transformer", "chitchat", own, False).seeds[0].mlflow
    # recorded relative to the project: a copied or moved project reads its own store
    assert first.tracking_uri == "sqlite:///mlflow.db"
    assert first.checkpoint_uri == f"runs:/{first.run_id}/checkpoint/model.pt"
    uri = tracking.resolve_uri(first.tracking_uri, own)
    assert uri == f"sqlite:///{own.resolve() / 'mlflow.db'}"
    curve = tracking.metric_history(uri, first.run_id, "valid_loss")
    assert len(curve) == 2

    again = train_seeds(params, "transformer", "chitchat", own, False).seeds[0].mlflow
    assert again.run_id == first.run_id and again.model_version == "2"
    client = mlflow.tracking.MlflowClient(uri)
    assert client.get_run(again.run_id).info.status == "FINISHED"
    assert tracking.metric_history(uri, again.run_id, "valid_loss") == curve
    version = client.get_model_version(again.registered_model, again.model_version)
    assert version.run_id == first.run_id
    # `chat --run` finds the registered model from anywhere, through the relative store
    monkeypatch.chdir(tmp_path)
    args = cli.parser().parse_args(["chat", "--run", "transformer-chitchat", "--root", str(own)])
    try:
        assert cli.load(args).spec.task == "generate"
    finally:
        mlflow.set_tracking_uri(None)  # cli.load sets the process-wide URI
    assert not (tmp_path / "mlflow.db").exists()

    # without the checkpoint the training starts over: a run of its own, whole again
    shutil.rmtree(own / "runs" / "ray")
    fresh = train_seeds(params, "transformer", "chitchat", own, False).seeds[0].mlflow
    assert fresh.run_id != first.run_id
    assert tracking.metric_history(uri, fresh.run_id, "valid_loss") == [
        (step, pytest.approx(value, rel=1e-5)) for step, value in curve
    ]
