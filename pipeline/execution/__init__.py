"""How a run uses its device: one :class:`ExecutionPolicy`, built once per run.

Every decision that depends on the device lives here (the one other place that names a
device, ``pipeline.machine``, only says which device a process has): the autocast dtype,
whether and how the training step is compiled (mode, backend, the dynamic-shape settings
that spare recompiles) and FlexAttention's kernel with it, the static shapes a compiled
step's batches are padded to, placing models and moving batches on the device, the fused
optimizer, evaluation's batch size (the largest that fits, agreed by every rank) and the host-sync
check around a step. The training loop, the validation score, the evaluate stage and the
GPU check take a policy; none of them asks which device it runs on. On a CPU a policy built
from the default params changes nothing (no autocast, no compile, no padding, the params'
batch sizes): a CPU run is the plain eager computation. The threads it computes with are
its placement's (``pipeline.machine.cpu_threads``), not the device's.
``docs/DESIGN.md`` ("How to add a GPU optimisation") walks through adding one.
"""

from pipeline.execution.policy import (
    PAD_MULTIPLE,
    CompileSettings,
    Evaluation,
    ExecutionOverrides,
    ExecutionPolicy,
    Padding,
    autocast_dtype,
    compiles,
    flex_backend,
    forked_rng,
)
from pipeline.execution.sizing import (
    LARGE_EVAL_BATCH,
    LargestBatch,
    RankFailed,
    Ranks,
    Status,
    batch_limit,
    out_of_memory,
    ranks_agree,
    require_no_collectives,
)
from pipeline.execution.transfer import moved, pinned, to_device

__all__ = [
    "LARGE_EVAL_BATCH",
    "PAD_MULTIPLE",
    "CompileSettings",
    "Evaluation",
    "ExecutionOverrides",
    "ExecutionPolicy",
    "LargestBatch",
    "Padding",
    "RankFailed",
    "Ranks",
    "Status",
    "autocast_dtype",
    "batch_limit",
    "compiles",
    "flex_backend",
    "forked_rng",
    "moved",
    "out_of_memory",
    "pinned",
    "ranks_agree",
    "require_no_collectives",
    "to_device",
]
