"""From params to what a stage will do: the params check (``check``: names and
cross-references against the model registry and the corpora) and the run plan (``run``:
one frozen, picklable value per training or search, ``code``: the code in its identity).
Stages start from :func:`load_checked`; the train and tune stages build plans from it."""

from pipeline.plan.check import check_params, checked, load_checked
from pipeline.plan.run import (
    SEED_STRIDE,
    RunIdentity,
    RunPlan,
    RunRequest,
    plan_search,
    plan_training,
)

__all__ = [
    "SEED_STRIDE",
    "RunIdentity",
    "RunPlan",
    "RunRequest",
    "check_params",
    "checked",
    "load_checked",
    "plan_search",
    "plan_training",
]
