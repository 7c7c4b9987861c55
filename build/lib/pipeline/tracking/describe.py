"""What the MLflow UI shows of the pipeline's records (MLflow 3's server UI, checked by
``tests/tracking/test_mlflow_ui.py`` in headless Chromium).

- Experiments carry ``mlflow.experimentKind = custom_model_development`` (the UI's
  "Machine learning" kind): MLflow 3 before its "GenAI | Model training" switch opens such
  an experiment on its runs table, not on the GenAI overview ("Traces 0 ... No data
  available"). MLflow 3.17's UI decides by that switch instead (a new browser: GenAI); the
  links :func:`ui_url` makes open the runs table there too.
- The experiment header and breadcrumb show only the part of an experiment's name after its
  last ``/``: names are ``<prefix>-<task>-<corpus>`` (:func:`experiment_name`), so that part
  tells ``generate``, ``select`` and ``lm`` of one corpus apart.
- Runs carry MLflow's own source tags (the "Source" column shows the DVC stage that made the
  run, the run page its git commit) and a one-line description (``mlflow.note.content``),
  as do experiments; the training code describes its runs and registered models itself.
- Metric sections: the charts of a run (and of an experiment) put sections named by a
  metric-key prefix (``eval/``) in alphabetical order before the un-prefixed "Model metrics"
  (MLflow's ``RunsChartsCardConfig.getBaseChartAndSectionConfigs``). The training loop's
  metrics are logged as ``curves/<name>`` (:data:`CURVES`), a section that sorts first: the
  learning curves open the page, the evaluation's bars follow.
"""

from __future__ import annotations

import getpass
import sys
from collections.abc import Mapping
from pathlib import Path

from pipeline.tracking.store import (
    CURVES,
    TAG_CORPUS,
    TAG_GIT,
    TAG_MODEL,
    TAG_STAGE,
    TAG_TASK,
    TAG_TRIAL,
)

# MLflow's own tag names (mlflow.utils.mlflow_tags; tests check they still match)
EXPERIMENT_KIND = "mlflow.experimentKind"
CUSTOM_MODEL_DEVELOPMENT = "custom_model_development"  # the UI's "Machine learning" kind
NOTE = "mlflow.note.content"  # the description of a run or an experiment
SOURCE_NAME = "mlflow.source.name"
SOURCE_TYPE = "mlflow.source.type"
GIT_COMMIT = "mlflow.source.git.commit"
GIT_DIRTY = "mlflow.source.git.dirty"
USER = "mlflow.user"
SOURCE_TAGS = (SOURCE_NAME, SOURCE_TYPE, GIT_COMMIT, GIT_DIRTY, USER)  # a trial inherits them

DIRTY = "+dirty"  # how pipeline.machine.code_version marks uncommitted changes
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
WORKFLOW = "workflowType=machine_learning"  # the UI's "Model training" view (ui_url)

TASKS = {
    "generate": "response generation (history -> response)",
    "select": "response selection (context + candidates -> scores)",
    "lm": "language modelling (documents of sentences)",
}


def experiment_name(task: str, corpus: str, prefix: str = "hiertx") -> str:
    """``<prefix>-<task>-<corpus>``: one experiment per task and corpus. No ``/`` after the
    prefix: the UI names an experiment by what follows its last ``/``, and
    ``hiertx/generate/chitchat``, ``hiertx/select/chitchat`` all read "chitchat" there."""
    return f"{prefix}-{task}-{corpus}"


def former_experiment_name(task: str, corpus: str, prefix: str = "hiertx") -> str:
    """The name :func:`experiment_name` gave before: a store that has it renames it (its
    runs, which resumed trainings go on in, stay in the renamed experiment)."""
    return f"{prefix}/{task}/{corpus}"


def report_experiment_name(prefix: str = "hiertx") -> str:
    """The experiment holding the report stage's runs (tables and plots as artifacts)."""
    return f"{prefix}-report"


def former_report_experiment_name(prefix: str = "hiertx") -> str:
    """The name :func:`report_experiment_name` gave before (renamed like
    :func:`former_experiment_name`)."""
    return f"{prefix}/report"


def experiment_tags(description: str) -> dict[str, str]:
    """The tags every experiment of the pipeline carries: its kind and its description."""
    return {EXPERIMENT_KIND: CUSTOM_MODEL_DEVELOPMENT, NOTE: description}


def describe_experiment(name: str, tags: Mapping[str, str]) -> str:
    """A default description of the experiment ``name`` from the tags of a run it holds."""
    if tags.get(TAG_STAGE) == "report":
        return (
            "The report stage's runs (`dvc repro report`): reports/report.md, its tables "
            "(tables.json) and figures as artifacts; the hiertx.covers.* tags name the "
            "training runs each report covers."
        )
    task, corpus = tags.get(TAG_TASK), tags.get(TAG_CORPUS)
    if task and corpus:
        return describe_task(task, corpus)
    return f"hiertx runs ({name}), logged by the pipeline's stages (dvc.yaml)."


def describe_task(task: str, corpus: str) -> str:
    """An experiment's description: which task on which corpus, and what its runs are."""
    return (
        f"Task {task}: {TASKS.get(task, task)} on the corpus {corpus}. One run per training "
        "of a model and seed (`dvc repro train@<run>`), a Tune search as a parent run with "
        f"its trials as children. Learning curves under {CURVES}/*, test metrics under "
        "eval/* (the evaluate stage)."
    )


def describe_run(tags: Mapping[str, str], run_name: str) -> str:
    """A default description of a run from its hiertx tags (callers that know more, such as
    the training's key params, pass their own)."""
    model, corpus, stage = tags.get(TAG_MODEL), tags.get(TAG_CORPUS), tags.get(TAG_STAGE)
    if tags.get(TAG_TRIAL):
        return (
            f"Tune trial {tags[TAG_TRIAL]} of the search for {model} on {corpus}: the "
            "sampled values are the params sampled.*; its parent run holds the search."
        )
    if stage == "report":
        return "The report (reports/report.md) with its tables and figures as artifacts."
    if model and corpus:
        return f"A {stage or 'hiertx'} run of {model} on {corpus}."
    return f"hiertx run {run_name}."


def source_tags(source: str, commit: str | None) -> dict[str, str]:
    """MLflow's source tags: the UI's "Source" column shows ``source`` (the DVC stage, or the
    script, that made the run), the run page the git commit (``commit`` as
    ``pipeline.machine.code_version`` gives it: ``+dirty`` becomes ``git.dirty``)."""
    tags = {SOURCE_NAME: source, SOURCE_TYPE: "LOCAL", USER: _user()}
    if commit and commit != "unknown":
        tags[GIT_COMMIT] = commit.removesuffix(DIRTY)
        tags[GIT_DIRTY] = str(commit.endswith(DIRTY)).lower()
    return tags


def default_source(tags: Mapping[str, str]) -> str:
    """What made a run when its caller does not say: the DVC stage its tags name (``report``),
    else the script that runs (``stages/evaluate.py`` shows as ``evaluate.py``)."""
    if tags.get(TAG_STAGE) == "report":
        return "report"
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return script.as_posix() if script is not None and script.name else "python"


def run_tags(
    tags: Mapping[str, str], run_name: str, source: str | None, description: str | None
) -> dict[str, str]:
    """The MLflow tags a run starts with beside its caller's ``tags``: source, user and
    description (``tags`` that name any of them win)."""
    auto = {
        **source_tags(source or default_source(tags), tags.get(TAG_GIT)),
        NOTE: description or describe_run(tags, run_name),
    }
    return {**auto, **tags}


def section_key(key: str, section: str) -> str:
    """``key`` in the chart section ``section`` (none: as it is); keys that name a section
    (``eval/bleu``) keep theirs."""
    return key if not section or "/" in key else f"{section}/{key}"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry
        return "unknown"


def ui_url(uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI's page of an experiment's runs table (or of one run) on the server
    ``uri`` (an ``http(s)://`` tracking URI; a local store: ``mlflow ui``'s default
    address). MLflow 3.17's UI opens an experiment as the switch "GenAI | Model training"
    says (a new browser: GenAI, an empty traces overview), not as its
    ``mlflow.experimentKind`` tag does: ``workflowType=machine_learning`` opens it on its
    runs."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI
    page = f"experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "/runs")
    return f"{base}/#/{page}?{WORKFLOW}"
