"""The execution policy's decisions, for a CPU and (built without one) a GPU: the autocast
dtype of each precision, what compiles and how, the static shapes, the optimizer, the
evaluation's first batch and the host-sync check around a step."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from torch.fx.experimental import _config as fx_config

from pipeline.config import CompileMode, Precision, RunParams
from pipeline.data.batch import GenerateBatch, LMBatch, SelectBatch
from pipeline.data.loader import collate
from pipeline.data.records import SelectExample
from pipeline.execution import (
    LARGE_EVAL_BATCH,
    PAD_MULTIPLE,
    CompileSettings,
    ExecutionOverrides,
    ExecutionPolicy,
    Padding,
    autocast_dtype,
)
from tests.batches import lm_batch_from_sentences, random_generate_batch
from tests.device_guard import scan
from tests.train.helpers import VOCAB, ToyConfig, ToyFactory, ToyModel

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
CHECKED = ExecutionOverrides(sync_debug="error")  # a checked step


class _NoCompile(ToyModel):
    supports_compile = False  # as a recurrent model's class says


def _training(device: torch.device, model=None, **params) -> ExecutionPolicy:
    return ExecutionPolicy.for_training(RunParams(**params), device, model=model)


def test_the_autocast_dtype_follows_the_precision_on_every_device() -> None:
    assert autocast_dtype(Precision.AUTO, CUDA) == torch.bfloat16
    assert autocast_dtype(Precision.AUTO, CPU) is None
    assert autocast_dtype(Precision.BF16, CPU) == autocast_dtype(Precision.BF16, CUDA)
    assert autocast_dtype(Precision.FP32, CUDA) is None  # fp32 is fp32 on a GPU too
    # evaluation: the run's precision, not always bf16 on CUDA
    assert ExecutionPolicy.for_evaluation(Precision.FP32, CUDA).autocast_dtype is None
    assert ExecutionPolicy.for_evaluation(Precision.BF16, CPU).autocast_dtype == torch.bfloat16


def test_the_default_policy_on_a_cpu_does_nothing() -> None:
    policy = _training(CPU, ToyFactory()())
    assert policy == ExecutionPolicy(CPU)
    assert policy.compile is None and not policy.padding.pads and not policy.fused_optimizer
    assert policy.eval_start(32) == 32 and isinstance(policy.autocast(), contextlib.nullcontext)
    batch = random_generate_batch(3, VOCAB, seed=1)
    (moved,) = policy.training_batches([batch])
    assert moved.history.input_ids.shape == batch.history.input_ids.shape


def test_what_compiles_and_how() -> None:
    toy, rnn = ToyFactory()(), _NoCompile(ToyConfig(vocab_size=VOCAB))
    cuda = _training(CUDA, toy)
    assert cuda.compile == CompileSettings("inductor", None, dynamic=True, duck_shapes=False)
    assert cuda.padding == Padding(PAD_MULTIPLE) and cuda.fused_optimizer
    assert cuda.grow_eval_batches and cuda.autocast_dtype == torch.bfloat16
    assert _training(CUDA, rnn).compile is None  # the model says it breaks the graph
    assert _training(CUDA, toy, compile="off").compile is None
    assert _training(CPU, toy).compile is None  # auto: measured 0.74x on CPU
    on = _training(CPU, rnn, compile="on")
    assert on.compile is not None and on.padding == Padding(PAD_MULTIPLE)
    graphs = _training(CUDA, toy, compile="reduce-overhead")
    assert graphs.compile is not None and graphs.compile.cuda_graphs
    assert graphs.padding == Padding(PAD_MULTIPLE, buckets=True)
    overrides = ExecutionOverrides(compile_backend="aot_eager", sync_debug="error")
    backend = ExecutionPolicy.for_training(
        RunParams(compile=CompileMode.ON), CPU, overrides=overrides
    )
    assert backend.compile is not None and backend.compile.backend == "aot_eager"
    assert not backend.compile.cuda_graphs and backend.sync_debug == "error"


def test_bucketed_lengths_are_few_and_waste_at_most_a_quarter() -> None:
    assert [Padding(8).width(n) for n in (0, 1, 8, 9, 33, 100)] == [0, 8, 8, 16, 40, 104]
    assert Padding().width(37) == 37 and not Padding().pads
    buckets = Padding(8, buckets=True)
    widths = sorted({buckets.width(n) for n in range(1, 1025)})
    assert widths[:12] == [8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert len(widths) == 4 + 4 * 5  # 8-32, then four per octave up to 1024
    assert all(n <= buckets.width(n) <= max(n + 7, 1.25 * n) for n in range(1, 1025))


def _assert_padded_like(batch, padded, width) -> None:
    """Every tensor of ``padded`` holds ``batch``'s at its start, zeros after it on the
    token axes, the other axes as they were."""
    for f in dataclasses.fields(batch):
        old, new = getattr(batch, f.name), getattr(padded, f.name)
        if dataclasses.is_dataclass(old):
            _assert_padded_like(old, new, width)
        elif isinstance(old, torch.Tensor):
            axis = type(batch).TOKEN_AXES.get(f.name)
            shape = list(old.shape)
            if axis is not None:
                shape[axis] = width(old.shape[axis])
            assert list(new.shape) == shape, f.name
            assert torch.equal(new[tuple(slice(0, n) for n in old.shape)], old), f.name
            assert int(new.count_nonzero()) == int(old.count_nonzero()), f.name
        else:
            assert new == old


def _select_example(n: int) -> SelectExample:
    """A select example of an ``n``-token history and two candidates, with knowledge."""
    tokens = np.arange(2, n + 2)
    return SelectExample(
        f"d{n}", 1, tokens, np.zeros(n, np.int64), np.arange(n), np.ones(n, np.int64),
        (tokens[:2], tokens), np.array([0, 1], np.int8), np.ones(n, np.int8),
        (np.ones(2, np.int8), np.full(n, 2, np.int8)),
    )  # fmt: skip


def test_padding_keeps_every_token_and_pads_only_token_axes() -> None:
    lm = lm_batch_from_sentences([[[5, 6, 2], [7, 2]], [[8, 9, 10, 11, 2]]])
    generate = random_generate_batch(3, VOCAB, seed=2)
    select = collate([_select_example(2), _select_example(5)])
    for batch, kind in ((lm, LMBatch), (generate, GenerateBatch), (select, SelectBatch)):
        padding = Padding(8, buckets=True)
        padded = padding.apply(batch)
        assert isinstance(padded, kind)
        _assert_padded_like(batch, padded, padding.width)
    assert Padding().apply(lm) is lm
    counts = lm_batch_from_sentences([[[5, 2]] * 3])  # sentence counts are not token axes
    assert Padding(8).apply(counts).sentences.shape == (1, 3, 8)


def test_evaluation_starts_large_on_cuda_and_as_configured_elsewhere() -> None:
    cuda = ExecutionPolicy.for_evaluation(Precision.AUTO, CUDA)
    assert ExecutionPolicy.for_evaluation(Precision.AUTO, CPU).eval_start(32) == 32
    assert cuda.eval_start(32) == LARGE_EVAL_BATCH and cuda.eval_start(4096) == 4096
    assert dataclasses.replace(cuda, world_size=4).eval_start(32) == 4 * LARGE_EVAL_BATCH
    assert cuda.eval_start(32, grow=False) == 32  # a size the params set on purpose
    assert cuda.evaluation(32, limit=3).start == 32  # a quick run: its first batches
    assert cuda.evaluation(32).start == LARGE_EVAL_BATCH


def test_a_step_sets_the_shape_settings_and_the_sync_check(monkeypatch) -> None:
    modes: list[object] = []
    marks: list[int] = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    toy = ToyFactory()()
    checked = ExecutionPolicy.for_training(RunParams(), CUDA, toy, overrides=CHECKED)
    with checked.step():
        assert modes == ["error"] and not fx_config.use_duck_shape
    assert modes == ["error", 0] and fx_config.use_duck_shape and marks == []
    with checked.step(checked=False):  # a process's first step compiles and allocates
        pass
    with pytest.raises(RuntimeError), checked.step():
        raise RuntimeError("a step failed")
    assert modes == ["error", 0, "error", 0]  # restored on the way out
    cpu = ExecutionPolicy.for_training(RunParams(), CPU, toy, overrides=CHECKED)
    with cpu.step(), _training(CUDA, toy).step():
        pass
    assert modes == ["error", 0, "error", 0]  # nothing on CPU, nothing without a mode
    with _training(CUDA, toy, compile="reduce-overhead").step():
        assert marks == [1]  # a new CUDA-graph step


# The stated exceptions outside ``pipeline/execution/`` (the policy, its sizing and its
# transfers, which may hold any of them), with the lines each may hold.
ALLOWED = {
    # where a process's device is found (default_device) and whether it has a GPU (has_gpu)
    ("pipeline/machine.py", "device check"): 2,
    # on_gpu: a model's pass picks its kernel by where its tensors are (static shapes that
    # spare host reads on CUDA, FlexAttention's CUDA kernels); models cannot import the
    # policy (layers import downward), which sets the kernel's backend (``kernels``)
    ("pipeline/models/base.py", "device check"): 1,
    # FlexAttention's kernel compiled with the backend the policy names (flex_backend)
    ("pipeline/models/flex.py", "compile"): 1,
}


def test_device_decisions_live_in_the_execution_policy() -> None:
    """Nothing in ``pipeline/`` or ``stages/`` autocasts, compiles, tests the device, moves
    to it or pins memory but the execution policy (``pipeline/execution/``) and the stated
    exceptions: ``tests/device_guard.py``'s patterns, as ``bench/``'s guard
    (``tests/bench/test_device_guard.py``) applies them to the benchmarks."""
    found = scan(("pipeline", "stages"))
    outside = {
        key: len(lines)
        for key, lines in found.items()
        if not key[0].startswith("pipeline/execution/")
    }
    assert outside == ALLOWED, {key: found[key] for key in outside}


@pytest.mark.parametrize(
    ("mode", "backend", "chosen"),
    [("off", "inductor", None), ("auto", "aot_eager", "aot_eager"), ("on", "eager", "eager")],
)
def test_flex_attention_on_eager_cuda_follows_the_runs_compile_and_backend(
    mode: str, backend: str, chosen: str | None
) -> None:
    """The decision, made on CPU: ``compile: off`` runs FlexAttention's kernel eager
    (``flex_attention`` itself), any other mode compiles it with the job's backend; the
    choice holds inside a step and an evaluation attempt, and is undone after."""
    from torch.nn.attention.flex_attention import flex_attention

    from pipeline.models import flex

    params = RunParams.model_validate({"compile": mode})
    overrides = ExecutionOverrides(compile_backend=backend)
    policy = ExecutionPolicy.for_training(params, torch.device("cuda"), overrides=overrides)
    assert policy.flex_backend == chosen
    seen = []
    with policy.step(checked=False):
        seen.append(flex.kernel())
    policy.evaluation(4).run(lambda size, limit: seen.append(flex.kernel()), torch.nn.Linear(1, 1))
    expected = flex_attention if chosen is None else flex._compiled_flex(chosen)
    assert seen == [expected, expected]
    assert flex.kernel() is not flex_attention  # outside: Inductor, where no policy chose
