"""The train stage's logic (``pipeline.train.training``): a run's plan trained, exported and
tracked, tiny end to end. What the plan decides before any compute is
``tests/plan/test_run.py``'s."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch

from pipeline import cli, cluster, tracking
from pipeline.artifacts import MANIFEST_FILE, MODEL_FILE, TrainRecord
from pipeline.config import PlacementParams
from pipeline.data import tokenize
from pipeline.data.loader import load_vocab
from pipeline.decode import DecodeConfig, generate
from pipeline.errors import ConfigError, DataError, TrainingDiverged
from pipeline.models.saved import load_model
from pipeline.plan import RunRequest, checked, plan_training
from pipeline.serving import ServingSpec, generate_batch
from pipeline.train import tracked
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.context import PREVIOUS_FILE
from pipeline.train.training import train_plan, train_seeds
from tests.train.conftest import TOKENIZE, stage_params, tokenized

KEY = "transformer-chitchat"


@pytest.fixture
def own(project, tmp_path) -> Path:
    """A project of its own: training in the shared one would resume its runs."""
    root = tmp_path / "project"
    shutil.copytree(project / "data" / "shards", root / "data" / "shards")
    return root


def _request(raw: dict, key: str = KEY) -> RunRequest:
    return RunRequest.of(checked(raw), key)


def _untracked(**train) -> dict:
    raw = stage_params(tracking={"enabled": False})
    raw["train"]["defaults"] |= train
    return raw


@pytest.mark.slow
def test_a_variant_trains_into_its_own_folder_and_mlflow_model(own, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{own / 'mlflow.db'}")
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
    params = checked(raw)
    record = train_seeds(RunRequest.of(params, "transformer-chitchat-wide"), own, False)
    (seed,) = record.seeds
    assert seed.checkpoint == "data/train/transformer-chitchat-wide/model.pt"
    assert seed.mlflow.registered_model == "hiertx-transformer-chitchat-wide"
    assert load_model(own / seed.checkpoint).config.d_ff == 64
    assert TrainRecord.read(own / "data/train/transformer-chitchat-wide" / MANIFEST_FILE) == record
    with pytest.raises(ConfigError, match="no run 'transformer-chitchat' in train"):
        RunRequest.of(params, KEY)


@pytest.mark.slow
def test_train_stage_end_to_end_with_mlflow_and_pyfunc(project, monkeypatch):
    uri = f"sqlite:///{project / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    request = _request(stage_params())
    record = train_seeds(request, project, False)
    plan = plan_training(request, project)

    out = project / "data" / "train" / "transformer-chitchat"
    assert TrainRecord.read(out / MANIFEST_FILE) == record
    assert record.task == "generate" and record.workers == 0
    assert record.placement == PlacementParams()
    (seed,) = record.seeds
    assert seed.checkpoint == "data/train/transformer-chitchat/model.pt"
    assert seed.run_name == plan.name and seed.seed == 1234
    assert seed.run_checkpoint == f"runs/ray/{plan.name}/{CHECKPOINT_FILE}"
    assert seed.metrics["steps"] == 6 and seed.metrics["epochs"] == 2
    assert seed.metrics["wall_s"] > 0  # what the study's report states per run
    assert "cores" in record.machine and "torch " in record.machine
    mf = seed.mlflow
    assert mf.model_version == "1" and mf.registered_model == "hiertx-transformer-chitchat"
    assert not mf.fallback and mf.experiment == "hiertx-generate-chitchat"
    # the export is the checkpoint's kept weights, with what rebuilds them
    state = TrainingState.read(project / seed.run_checkpoint)
    model = load_model(out / MODEL_FILE)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state.best_model[k]), k
    assert model.config == plan.config

    client = mlflow.tracking.MlflowClient(uri)
    run = client.get_run(mf.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.optimizer.lr"] == "0.003"
    assert run.data.params["identity.code"] == plan.code
    assert run.data.params["identity.data"] == plan.data
    assert run.data.tags["hiertx.model"] == "transformer" and "hiertx.git_commit" in run.data.tags
    assert run.data.tags["hiertx.run_key"] == plan.name
    assert len(client.get_metric_history(run.info.run_id, "curves/valid_loss")) == 2
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
    vocab = load_vocab(project / "data" / "shards" / "chitchat")
    spec = ServingSpec("generate", max_history=40, max_utterances=4, max_response=12)
    assert ServingSpec.of(plan.task, plan.corpus_params) == spec
    with torch.no_grad():
        ref = generate(model, generate_batch(history, vocab, spec), DecodeConfig(max_length=12))
    expected = [vocab.decode(r[:n].tolist()) for r, n in zip(ref.tokens, ref.lengths, strict=True)]
    assert list(answers) == expected and all(isinstance(a, str) for a in answers)


@pytest.mark.slow
def test_rerun_of_a_trained_config_keeps_its_mlflow_history(own, tmp_path, monkeypatch):
    """`dvc repro -f -s train@...` (or an experiment back at earlier params) resumes the
    finished checkpoint: the run that holds the learning curves must go on, and the
    registered version must point at it."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    request = _request(stage_params())
    first = train_seeds(request, own, False).seeds[0].mlflow
    # recorded relative to the project: a copied or moved project reads its own store
    assert first.tracking_uri == "sqlite:///mlflow.db"
    assert first.checkpoint_uri == f"runs:/{first.run_id}/checkpoint/model.pt"
    uri = tracking.resolve_uri(first.tracking_uri, own)
    assert uri == f"sqlite:///{own.resolve() / 'mlflow.db'}"
    curve = tracking.metric_history(uri, first.run_id, "valid_loss")
    assert len(curve) == 2

    again = train_seeds(request, own, False).seeds[0].mlflow
    assert again.run_id == first.run_id and again.model_version == "2"
    client = mlflow.tracking.MlflowClient(uri)
    assert client.get_run(again.run_id).info.status == "FINISHED"
    assert tracking.metric_history(uri, again.run_id, "valid_loss") == curve
    version = client.get_model_version(again.registered_model, again.model_version)
    assert version.run_id == first.run_id
    # `chat --run` finds the registered model from anywhere, through the relative store
    monkeypatch.chdir(tmp_path)
    args = cli.parser().parse_args(["chat", "--run", KEY, "--root", str(own)])
    before = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    assert cli.load(args).spec.task == "generate"
    # loading leaves MLflow's process-wide URI (and the variable it exports) as they were
    assert (mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")) == before
    assert not (tmp_path / "mlflow.db").exists()

    # without the checkpoint the training starts over: a run of its own, whole again
    shutil.rmtree(own / "runs" / "ray")
    fresh = train_seeds(request, own, False).seeds[0].mlflow
    assert fresh.run_id != first.run_id
    assert tracking.metric_history(uri, fresh.run_id, "valid_loss") == [
        (step, pytest.approx(value, rel=1e-5)) for step, value in curve
    ]


def _said(capsys) -> list[str]:
    """The stage's lines about its seeds (what it prints first for each)."""
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if line.startswith("train transformer-chitchat")]


@pytest.mark.slow
def test_the_stage_says_whether_it_resumes_and_why_it_starts_fresh(own, capsys):
    params = _untracked(epochs=1)
    plan = plan_training(_request(params), own)
    label = "train transformer-chitchat (seed 1234)"
    train_plan(plan, show_progress=False)
    assert _said(capsys) == [
        f"{label}: starting fresh as {plan.name}: the first run of this key, in this process"
    ]
    train_plan(plan, show_progress=False)
    assert _said(capsys) == [
        f"{label}: resuming {plan.name} from step 3 (same code, params and data), in this process"
    ]
    longer = plan_training(_request(_untracked(epochs=2)), own)
    train_plan(longer, show_progress=False)
    assert _said(capsys) == [
        f"{label}: starting fresh as {longer.name}: the params changed since {plan.name}, "
        "in this process"
    ]


@pytest.mark.slow
def test_every_seed_trains_as_its_own_run_into_its_own_folder(own):
    request = _request(_untracked(epochs=1, seeds=2, seed=7))
    record = train_seeds(request, own, show_progress=False)
    plan = plan_training(request, own)
    assert [s.seed for s in record.seeds] == [7, 1007]
    assert [s.run_name for s in record.seeds] == [plan.for_seed(i).name for i in (0, 1)]
    assert [s.checkpoint for s in record.seeds] == [
        f"data/train/{KEY}/seed-{i}/model.pt" for i in (0, 1)
    ]
    weights = [load_model(own / s.checkpoint).state_dict() for s in record.seeds]
    assert any(not torch.equal(v, weights[1][k]) for k, v in weights[0].items())
    assert TrainRecord.read(own / f"data/train/{KEY}" / MANIFEST_FILE) == record
    assert not (own / f"data/train/{KEY}" / MODEL_FILE).exists()


def test_an_in_process_run_computes_with_its_workers_cores_as_torch_threads(own, monkeypatch):
    """``train.placement.cpus_per_worker`` is a worker's torch threads in the stage's own
    process as on a Ray worker: ``make repro`` runs a stage per core, each on its share."""
    from pipeline.train import training

    threads: list[int] = []
    timed = training._timed

    def counted(plan, show_progress):
        threads.append(torch.get_num_threads())
        return timed(plan, show_progress)

    monkeypatch.setattr(training, "_timed", counted)
    raw = _untracked(epochs=1, max_batches_per_epoch=2, eval_every=2, max_eval_batches=1)
    raw["train"]["placement"] = {"cpus_per_worker": 2}
    before = torch.get_num_threads()
    train_seeds(_request(raw), own, show_progress=False)
    assert threads == [2] != [before]
    assert torch.get_num_threads() == before


def _torn(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.slow
def test_a_run_without_an_intact_checkpoint_says_how_to_start_over(own):
    plan = plan_training(_request(_untracked(epochs=2)), own)
    train_plan(plan, show_progress=False)
    run = Path(plan.storage) / plan.name
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        _torn(run / name)
    plan.model_file.unlink()
    with (
        pytest.warns(UserWarning, match="passing over a checkpoint"),
        pytest.raises(DataError) as caught,
    ):
        train_plan(plan, show_progress=False)
    message = str(caught.value)
    assert "no intact checkpoint to resume from" in message and str(run) in message
    assert "start the run over" in message
    # the command that does it: the run's folder removed, its DVC stage run again
    assert message.endswith(plan.restart)
    assert not plan.model_file.exists()


def _diverging() -> RunRequest:
    raw = stage_params()
    # Adam's first step moves every weight by about lr: the second step's loss is not finite
    raw["train"]["defaults"] |= {"optimizer": {"lr": 1.0e6}, "checkpoint_every": 1}
    return _request(raw)


@pytest.mark.slow
def test_a_diverging_run_exports_nothing_and_fails_its_mlflow_run(own, monkeypatch):
    uri = f"sqlite:///{own / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    plan = plan_training(_diverging(), own)
    with pytest.raises(TrainingDiverged) as caught:
        train_seeds(_diverging(), own, show_progress=False)
    message = str(caught.value)
    assert message.startswith(f"{plan.label} diverged at step 2: the training loss is not finite")
    assert "optimizer.lr (1e+06)" in message
    assert not plan.model_file.exists()
    assert not (plan.layout.train_out(KEY) / MANIFEST_FILE).exists()
    # the checkpoint kept is step 1's, the last of finite weights
    state = TrainingState.read(Path(plan.storage) / plan.name / CHECKPOINT_FILE)
    assert state.position.step == 1
    assert all(torch.isfinite(v).all() for v in state.model.values())
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("hiertx-generate-chitchat").experiment_id]
    )
    assert run.info.status == "FAILED" and run.data.tags["hiertx.run_key"] == plan.name


def test_a_ray_run_on_other_nodes_needs_a_store_and_storage_they_reach(project, monkeypatch):
    """Workers on other machines log to the MLflow store and checkpoint to the storage: a
    file on this machine's disk is refused before any work, naming what to set."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("HIERTX_STORAGE_PATH", raising=False)
    in_process = plan_training(_request(stage_params()), project)
    monkeypatch.setattr(tracked, "remote_nodes", lambda: pytest.fail("asked Ray"))
    tracked.check_reachable(in_process)  # no Ray workers: nothing to reach

    on_ray = stage_params(train={"scale": {"num_workers": 1}})
    monkeypatch.setattr(tracked, "remote_nodes", lambda: [])  # a one-machine cluster
    tracked.check_reachable(plan_training(_request(on_ray), project))

    monkeypatch.setattr(tracked, "remote_nodes", lambda: ["10.0.0.7"])
    with pytest.raises(ConfigError) as caught:
        tracked.check_reachable(plan_training(_request(on_ray), project))
    assert caught.value.key == "MLFLOW_TRACKING_URI"
    assert "10.0.0.7" in caught.value.reason
    assert "export MLFLOW_TRACKING_URI=http://" in caught.value.reason

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    storage = project / "runs" / "ray"
    monkeypatch.setattr(cluster, "unshared", lambda folder: ["10.0.0.7"])  # nothing shared
    with pytest.raises(ConfigError) as caught:
        tracked.check_reachable(plan_training(_request(on_ray), project))
    assert caught.value.key == "train.placement.storage_path"
    assert str(storage) in caught.value.reason and "10.0.0.7" in caught.value.reason
    untracked = stage_params(train={"scale": {"num_workers": 1}}, tracking={"enabled": False})
    with pytest.raises(ConfigError, match="do not see") as caught:
        tracked.check_reachable(plan_training(_request(untracked), project))
    assert caught.value.key == "train.placement.storage_path"

    # storage on NFS, the project on this machine's disk only
    monkeypatch.setattr(cluster, "unshared", lambda f: [] if f == storage else ["10.0.0.7"])
    with pytest.raises(ConfigError) as caught:
        tracked.check_reachable(plan_training(_request(on_ray), project))
    assert caught.value.key == "project"
    assert str(project / "data") in caught.value.reason and "same path" in caught.value.reason

    monkeypatch.setattr(cluster, "unshared", lambda folder: [])  # both on NFS
    tracked.check_reachable(plan_training(_request(on_ray), project))

    shared = stage_params(
        train={"scale": {"num_workers": 1}, "placement": {"storage_path": "s3://bucket/runs"}}
    )
    seen = []
    monkeypatch.setattr(cluster, "unshared", lambda folder: seen.append(folder) or [])
    tracked.check_reachable(plan_training(_request(shared), project))
    assert seen == [project / "data"]  # an s3:// URI is not a folder to probe


@pytest.mark.slow
def test_a_run_no_validation_chose_exports_nothing_and_fails_its_mlflow_run(tmp_path, monkeypatch):
    """Issue 34: shards with an empty valid split (tokenized before tokenize refused them)
    gave `valid loss inf (best inf at step 0)`, an exported step-0 model, and, tracked, a
    raw StopIteration from the samples with model.pt left behind."""
    settings = copy.deepcopy(TOKENIZE)
    settings["corpora"]["chitchat"]["split"] = {"valid": 0.0, "test": 0.1}
    monkeypatch.setattr(tokenize, "check_every_split", lambda *args: None)  # the old tokenize
    root = tokenized(tmp_path / "project", settings)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    raw = stage_params(tokenize=settings)
    raw["train"]["defaults"] |= {"epochs": 1, "max_batches_per_epoch": 2}
    plan = plan_training(_request(raw), root)
    with pytest.raises(DataError) as caught:
        train_seeds(_request(raw), root, show_progress=False)
    assert str(caught.value) == (
        f"data/shards/chitchat: no validation chose the weights of seed {plan.knobs.seed}: no "
        "evaluation (the last at step 2) gave a finite valid loss: the valid split holds no "
        "generate target token; nothing exported: tokenize chitchat again (`dvc repro "
        "tokenize@chitchat`), which refuses a corpus whose valid split gives no example"
    )
    assert not plan.model_file.exists()
    assert not (plan.layout.train_out(KEY) / MANIFEST_FILE).exists()
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("hiertx-generate-chitchat").experiment_id]
    )
    assert run.info.status == "FAILED"
    # the samples of a model whose valid split is empty: none, not a StopIteration
    state = TrainingState.read(Path(plan.storage) / plan.name / CHECKPOINT_FILE)
    state.exported({}, plan.name).write(tmp_path / MODEL_FILE)
    assert tracked.sample_generations(tmp_path / MODEL_FILE, plan) == ""
