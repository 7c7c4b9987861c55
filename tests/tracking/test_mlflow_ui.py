"""A training's MLflow run as a researcher meets it: named and described for the runs table,
its registered model described, and, in a real browser (headless Chromium, Debian's
``chromium`` package) against a real ``mlflow server``, its experiment opening on the runs
table with the learning curves first among the charts.

The browser test skips where no Chromium is installed, unless ``HIERTX_REQUIRE_BROWSER=1``
(CI), where it fails instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline import tracking
from pipeline.plan import RunPlan, RunRequest, checked, plan_training
from pipeline.tracking import describe, store
from pipeline.train import tracked
from tests.tracking.browser import REQUIRE_ENV, find_chromium, render
from tests.train.conftest import stage_params, tokenized
from tests.train.mlflow_server import MlflowServer, call

KEY = "transformer-chitchat"
EVAL_METRICS = 29  # as many bars as the evaluate stage logs for a generate run
SCREENSHOTS_ENV = "HIERTX_SCREENSHOTS"  # a folder to keep the screenshots in (else tmp)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[RunPlan, str, str]:
    """A training's run as the pipeline makes it: (plan, store URI, run id)."""
    root = tokenized(tmp_path_factory.mktemp("project"))
    uri = store.sqlite_uri(root / "mlflow.db")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(tracking.TRACKING_URI_ENV, uri)
        plan = plan_training(RunRequest.of(checked(stage_params()), KEY), root)
        tracker = tracked.start_tracker(plan, resumes=False)
    assert isinstance(tracker, tracking.Tracker)
    sink = tracker.sink()  # the training loop's metrics
    for step in range(1, 7):
        sink.log_metrics({"train_loss": 6.0 / step, "lr": 0.003}, step)
        if step % 3 == 0:
            sink.log_metrics({"valid_loss": 5.0 / step, "valid_ppl": 150.0 / step}, step)
    tracker.log_metrics({"final_steps": 6.0}, 6)
    evaluate = tracker.ref.attach()  # the evaluate stage attaches to the run by its ref
    evaluate.log_metrics({f"eval/metric_{i:02d}": i / 10 for i in range(EVAL_METRICS)}, 0)
    tracker.end()
    return plan, uri, tracker.run_id


def test_a_training_run_is_named_for_the_runs_table_and_described(made):
    plan, uri, run_id = made
    run = MlflowClient(uri).get_run(run_id)
    name = tracked.display_name(plan)
    assert run.info.run_name == name == f"transformer {plan.identity().digest[:5]}"
    assert len(name) <= 24  # what the runs table's name column shows uncut
    assert run.data.tags[store.TAG_RUN_KEY] == plan.name  # the whole identity
    tags = run.data.tags
    assert tags[describe.SOURCE_NAME] == plan.dvc_stage == f"train@{KEY}"
    assert tags[describe.NOTE] == tracked.describe_run(plan)
    note = tags[describe.NOTE]
    assert f"seed {plan.knobs.seed}" in note and f"dvc repro train@{KEY}" in note
    assert "2 epochs of 3 batches, batch 16, adam lr 0.003" in note
    exp = MlflowClient(uri).get_experiment(run.info.experiment_id)
    assert exp.name == "hiertx-generate-chitchat"
    assert exp.tags[describe.EXPERIMENT_KIND] == "custom_model_development"
    assert exp.tags[describe.NOTE] == tracking.describe_task("generate", "chitchat")


def test_other_runs_of_an_experiment_get_other_names(made):
    plan = made[0]
    seeds = plan.model_copy(update={"knobs": plan.knobs.model_copy(update={"seeds": 2})})
    names = {tracked.display_name(seeds.for_seed(i)) for i in (0, 1)}
    search = plan.model_copy(update={"stage": "tune"})
    names |= {tracked.display_name(plan), tracked.display_name(search)}
    assert len(names) == 4
    assert all(len(n) <= 24 for n in names), names


def test_the_registered_model_and_its_version_are_described(made):
    plan, uri, run_id = made
    client = MlflowClient(uri)
    name = tracking.registered_model_name(plan.model, plan.corpus)
    client.create_registered_model(name)  # as serving.log_pyfunc registers it: bare
    version = client.create_model_version(name, f"runs:/{run_id}/model", run_id=run_id)
    tracked._describe_version(name, str(version.version), tracked.describe_model(plan), plan)(
        client, run_id
    )
    model = client.get_registered_model(name)
    assert model.description == tracked.describe_model(plan)
    assert f"dvc repro train@{KEY}" in model.description
    described = client.get_model_version(name, str(version.version)).description
    assert described.startswith(tracked.describe_run(plan)) and run_id in described


@pytest.fixture
def chromium() -> str:
    found = find_chromium()
    if found is None:
        message = (
            "no Chromium to drive (install Debian's package: apt-get install -y chromium, "
            "or set $CHROMIUM to a Chrome binary)"
        )
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {message}")
        pytest.skip(message)
    return found


@pytest.mark.slow
def test_the_experiment_opens_on_its_runs_table_in_a_browser(made, chromium, tmp_path):
    plan, uri, run_id = made
    shots = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    server = MlflowServer(tmp_path, backend=uri)
    server.start()
    try:
        by_name = "/api/2.0/mlflow/experiments/get-by-name?experiment_name="
        exp = call(server.url, by_name + "hiertx-generate-chitchat")["experiment"]
        name = tracked.display_name(plan)
        page = render(
            chromium,
            tracking.ui_url(server.url, exp["experiment_id"]),
            f"document.body.innerText.includes({name!r})",
            screenshot=shots / "experiment.png",
        )
        assert page.ready, f"the run {name!r} never showed; the page read:\n{page.text[:2000]}"
        assert f"#/experiments/{exp['experiment_id']}/runs" in page.url
        assert "No data available" not in page.text  # the GenAI traces overview
        assert "hiertx-generate-chitchat" in page.text  # the breadcrumb and header
        assert plan.dvc_stage in page.text  # the Source column
        assert tracking.describe_task("generate", "chitchat")[:60] in page.text

        charts = render(
            chromium,
            tracking.ui_url(server.url, exp["experiment_id"], run_id).replace(
                f"/runs/{run_id}?", f"/runs/{run_id}/model-metrics?"
            ),
            # section headers; the charts below the fold are not rendered
            "document.body.innerText.split('\\n').includes('eval')",
            screenshot=shots / "run-charts.png",
        )
        assert charts.ready, charts.text[:2000]
        # sections in page order: the learning curves, then the evaluation's bars
        lines = charts.text.split("\n")
        assert lines.index("curves") < lines.index("train_loss") < lines.index("eval")
        assert lines.index("valid_loss") < lines.index("eval")
    finally:
        server.stop()
