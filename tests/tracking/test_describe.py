"""What the MLflow UI shows of the pipeline's records: every experiment the tracking code
creates has its kind and a description, every run MLflow's source tags and a description,
names tell experiments and runs apart, the learning curves come first; the fallback store
and ``sync-mlflow`` carry all of it."""

from __future__ import annotations

import socket
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from mlflow.utils import mlflow_tags

from pipeline import tracking
from pipeline.tracking import Tracker, describe, store
from pipeline.tracking.sync import sync_store

TAGS = {
    tracking.TAG_MODEL: "hier",
    tracking.TAG_CORPUS: "chitchat",
    tracking.TAG_TASK: "generate",
    tracking.TAG_STAGE: "train",
    tracking.TAG_GIT: "0123456789abcdef0123456789abcdef01234567+dirty",
}
EXP = tracking.experiment_name("generate", "chitchat")


@pytest.fixture
def uri(tmp_path) -> str:
    return store.sqlite_uri(tmp_path / "mlflow.db")


@pytest.fixture(autouse=True)
def _no_retries(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def _closed_port_uri() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there now


def _experiment_tags(uri: str, name: str) -> dict[str, str]:
    found = MlflowClient(uri).get_experiment_by_name(name)
    assert found is not None, f"no experiment {name} in {uri}"
    return dict(found.tags)


def _run_tags(uri: str, run_id: str) -> dict[str, str]:
    return dict(MlflowClient(uri).get_run(run_id).data.tags)


def test_the_tag_names_are_mlflows_own_and_the_ui_knows_the_kind():
    assert describe.NOTE == mlflow_tags.MLFLOW_RUN_NOTE
    assert describe.SOURCE_NAME == mlflow_tags.MLFLOW_SOURCE_NAME
    assert describe.SOURCE_TYPE == mlflow_tags.MLFLOW_SOURCE_TYPE
    assert describe.GIT_COMMIT == mlflow_tags.MLFLOW_GIT_COMMIT
    assert describe.GIT_DIRTY == mlflow_tags.MLFLOW_GIT_DIRTY
    assert describe.USER == mlflow_tags.MLFLOW_USER
    # the kind's tag and value as the installed UI reads them (no Python constant has them)
    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    main = "\n".join(p.read_text(errors="replace") for p in bundle.glob("main.*.js"))
    assert f'"{describe.EXPERIMENT_KIND}"' in main
    assert f'CUSTOM_MODEL_DEVELOPMENT="{describe.CUSTOM_MODEL_DEVELOPMENT}"' in main


def test_names_tell_experiments_apart_after_their_last_slash():
    names = [tracking.experiment_name(t, "chitchat") for t in ("generate", "select", "lm")]
    names.append(tracking.report_experiment_name())
    assert names == [
        "hiertx-generate-chitchat",
        "hiertx-select-chitchat",
        "hiertx-lm-chitchat",
        "hiertx-report",
    ]
    # what the UI's breadcrumb shows of each (the part after the last "/")
    assert len({n.split("/")[-1] for n in names}) == len(names)
    assert tracking.experiment_name("lm", "wiki", "team/hiertx").split("/")[-1] == (
        "hiertx-lm-wiki"
    )
    # a store made before holds them under these names: renamed, they keep their runs
    former = [tracking.former_experiment_name(t, "chitchat") for t in ("generate", "select")]
    former.append(tracking.former_report_experiment_name())
    assert [f.replace("/", "-") for f in former] == [names[0], names[1], names[3]]


def test_every_experiment_and_run_is_described_with_its_source(uri):
    t = Tracker.start(
        uri, uri, EXP, "hier 1a2b3", tags=TAGS, source="train@hier-chitchat", description="d"
    )
    t.end()
    exp = _experiment_tags(uri, EXP)
    assert exp[describe.EXPERIMENT_KIND] == "custom_model_development"
    assert exp[describe.NOTE] == tracking.describe_task("generate", "chitchat")
    run = _run_tags(uri, t.run_id)
    assert run[describe.NOTE] == "d"
    assert run[describe.SOURCE_NAME] == "train@hier-chitchat"
    assert run[describe.SOURCE_TYPE] == "LOCAL" and run[describe.USER]
    # MLflow's commit is the bare hash; the uncommitted changes are its own tag
    assert run[describe.GIT_COMMIT] == "0123456789abcdef0123456789abcdef01234567"
    assert run[describe.GIT_DIRTY] == "true"
    assert run[tracking.TAG_GIT] == TAGS[tracking.TAG_GIT]  # the project's tag unchanged

    # a caller that says nothing (the report stage) still gets a source and descriptions
    report = tracking.report_experiment_name()
    r = Tracker.start(uri, uri, report, "report", tags={tracking.TAG_STAGE: "report"})
    r.end()
    assert "reports/report.md" in _experiment_tags(uri, report)[describe.NOTE]
    assert _experiment_tags(uri, report)[describe.EXPERIMENT_KIND] == "custom_model_development"
    run = _run_tags(uri, r.run_id)
    assert run[describe.SOURCE_NAME] == "report" and "report" in run[describe.NOTE]
    assert describe.GIT_COMMIT not in run  # no commit known: none invented


def test_an_older_experiment_gets_its_kind_and_keeps_a_description_edited_in_the_ui(uri):
    client = store.mlflow_client(uri)
    client.create_experiment(EXP, tags={describe.NOTE: "mine"})  # as a store made before
    t = Tracker.start(uri, uri, EXP, "x", tags=TAGS, resume_key="k")
    client.set_tag(t.run_id, describe.NOTE, "edited")
    t.end("KILLED")
    again = Tracker.start(uri, uri, EXP, "x", tags=TAGS, resume_key="k", description="new")
    assert again.run_id == t.run_id
    tags = _experiment_tags(uri, EXP)
    assert tags[describe.NOTE] == "mine"
    assert tags[describe.EXPERIMENT_KIND] == "custom_model_development"
    assert _run_tags(uri, t.run_id)[describe.NOTE] == "edited"


def test_a_store_holding_the_former_name_renames_it_and_its_runs_go_on(uri):
    old = tracking.former_experiment_name("generate", "chitchat")
    first = Tracker.start(uri, uri, old, "x", tags=TAGS, resume_key="k")
    first.log_metrics({"loss": 2.0}, step=1)
    first.end()
    again = Tracker.start(
        uri, uri, EXP, "x", tags=TAGS, resume_key="k", reuse="any", former_experiment=old
    )
    assert again.run_id == first.run_id
    client = MlflowClient(uri)
    assert client.get_experiment_by_name(old) is None
    assert client.get_run(again.run_id).info.experiment_id == (
        client.get_experiment_by_name(EXP).experiment_id
    )


def test_a_trial_takes_the_source_of_its_search(uri):
    parent = Tracker.start(uri, uri, EXP, "hier search 1a2b3", tags=TAGS, source="tune@hier")
    trial_tags = {**TAGS, tracking.TAG_STAGE: "tune", tracking.TAG_TRIAL: "ab_00001"}
    del trial_tags[tracking.TAG_GIT]  # as the search's trials are tagged
    child = Tracker.start(uri, uri, EXP, "trial-ab_00001", trial_tags, parent.run_id)
    child.end()
    parent.end()
    run = _run_tags(uri, child.run_id)
    assert run[describe.SOURCE_NAME] == "tune@hier"
    assert run[describe.GIT_COMMIT] == _run_tags(uri, parent.run_id)[describe.GIT_COMMIT]
    assert "Tune trial ab_00001" in run[describe.NOTE]


def test_the_learning_curves_open_the_charts_and_readers_find_them(uri):
    t = Tracker.start(uri, uri, EXP, "x", tags=TAGS)
    sink = t.sink()  # what the training loop logs through
    sink.log_metrics({"train_loss": 3.0, "valid_loss": 2.5}, step=5)
    sink.log_metrics({"valid_loss": 2.0}, step=10)
    t.log_metrics({"eval/bleu": 0.1, "final_steps": 10.0}, step=0)
    t.end()
    keys = set(MlflowClient(uri).get_run(t.run_id).data.metrics)
    assert keys == {"curves/train_loss", "curves/valid_loss", "eval/bleu", "final_steps"}
    # the UI sorts prefixed sections alphabetically, before the un-prefixed "Model metrics"
    sections = sorted({k.split("/")[0] for k in keys if "/" in k})
    assert sections[0] == describe.CURVES
    assert tracking.metric_history(uri, t.run_id, "valid_loss") == [(5, 2.5), (10, 2.0)]

    older = Tracker.start(uri, uri, EXP, "y", tags=TAGS)  # logged before there were sections
    older.log_metrics({"valid_loss": 4.0}, step=3)
    older.end()
    assert tracking.metric_history(uri, older.run_id, "valid_loss") == [(3, 4.0)]


def test_the_fallback_store_and_its_sync_carry_kinds_and_descriptions(tmp_path):
    fallback = tracking.fallback_uri(tmp_path)
    with pytest.warns(store.TrackingUnavailable):
        t = Tracker.start(
            _closed_port_uri(),
            fallback,
            EXP,
            "hier 1a2b3",
            tags=TAGS,
            source="train@hier-chitchat",
            description="a training",
            experiment_description="the task",
        )
    assert t.fell_back
    t.end()
    target = store.sqlite_uri(tmp_path / "server.db")
    report = sync_store(fallback, target)
    assert report.copied == [t.run_id]
    assert report.experiments == {
        EXP: MlflowClient(target).get_experiment_by_name(EXP).experiment_id
    }
    for where in (fallback, target):
        exp = _experiment_tags(where, EXP)
        assert exp[describe.EXPERIMENT_KIND] == "custom_model_development"
        assert exp[describe.NOTE] == "the task"
        run = MlflowClient(where).search_runs(
            [MlflowClient(where).get_experiment_by_name(EXP).experiment_id]
        )[0]
        assert run.info.run_name == "hier 1a2b3"
        assert run.data.tags[describe.NOTE] == "a training"
        assert run.data.tags[describe.SOURCE_NAME] == "train@hier-chitchat"


def test_ui_links_open_the_runs_table_in_the_model_training_view():
    assert tracking.ui_url("http://mlflow:5000/", "7") == (
        "http://mlflow:5000/#/experiments/7/runs?workflowType=machine_learning"
    )
    assert tracking.ui_url("sqlite:///mlflow.db", "7", "abc") == (
        "http://127.0.0.1:5000/#/experiments/7/runs/abc?workflowType=machine_learning"
    )
