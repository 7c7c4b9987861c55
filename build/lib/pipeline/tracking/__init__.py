"""MLflow tracking: the ONE place that knows experiments, run names, tags, artifacts and the
model registry. ``store``: where records live and how to read them; ``tracker``: logging to
a run from any process, with a local fallback; ``describe``: names, tags and descriptions as
the MLflow UI shows them; ``sync``: carrying fallback runs to a server
(``python -m pipeline sync-mlflow``). Nothing here knows what is logged (the training code
logs its own model through ``Tracker.call``)."""

from pipeline.tracking.describe import (
    describe_task,
    experiment_name,
    former_experiment_name,
    former_report_experiment_name,
    report_experiment_name,
    ui_url,
)
from pipeline.tracking.store import (
    CURVES,
    TAG_CORPUS,
    TAG_GIT,
    TAG_INPUT,
    TAG_MODEL,
    TAG_STAGE,
    TAG_TASK,
    TAG_TRIAL,
    TAG_VARIANT,
    TRACKING_URI_ENV,
    configure_env,
    dvc_input_hashes,
    fallback_uri,
    metric_history,
    portable_uri,
    registered_model_name,
    resolve_uri,
    system_info,
    tracking_uri,
)
from pipeline.tracking.tracker import NullTracker, RunRef, Tracker

__all__ = [
    "CURVES",
    "TAG_CORPUS",
    "TAG_GIT",
    "TAG_INPUT",
    "TAG_MODEL",
    "TAG_STAGE",
    "TAG_TASK",
    "TAG_TRIAL",
    "TAG_VARIANT",
    "TRACKING_URI_ENV",
    "NullTracker",
    "RunRef",
    "Tracker",
    "configure_env",
    "describe_task",
    "dvc_input_hashes",
    "experiment_name",
    "fallback_uri",
    "former_experiment_name",
    "former_report_experiment_name",
    "metric_history",
    "portable_uri",
    "registered_model_name",
    "report_experiment_name",
    "resolve_uri",
    "system_info",
    "tracking_uri",
    "ui_url",
]
