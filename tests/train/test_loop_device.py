"""The loop's paths for a GPU, exercised on CPU: the compiled step (against eager), the
host-sync check around a step, and validation backing off from out-of-memory."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.config.train import CompileMode
from pipeline.data.batch import GenerateBatch
from pipeline.models.base import LossOutput
from pipeline.train import loop, steps
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.loop import train_local
from tests.train.helpers import VOCAB, PoolFactory, ToyConfig, ToyFactory, ToyModel
from tests.train.test_loop import ListSink, _SyncSpy, make_job

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class _NoCompile(ToyModel):
    supports_compile = False  # as a recurrent model's class says


def test_auto_compiles_on_cuda_only_and_not_a_model_that_breaks_the_graph() -> None:
    toy = ToyFactory()()
    rnn = _NoCompile(ToyConfig(vocab_size=VOCAB))
    assert steps.compiles(CompileMode.AUTO, CUDA, toy)
    assert not steps.compiles(CompileMode.AUTO, CPU, toy)  # measured 0.74x on CPU
    assert not steps.compiles(CompileMode.AUTO, CUDA, rnn)
    assert steps.compiles(CompileMode.ON, CPU, rnn) and steps.compiles(CompileMode.ON, CPU, toy)
    assert not steps.compiles(CompileMode.OFF, CUDA, toy)


def _losses(sink: ListSink) -> list[float]:
    return [m["train_loss"] for _, m in sink.log if "train_loss" in m]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_compiled_step_trains_as_eager_and_checkpoints_the_plain_model(
    tmp_path: Path, backend: str
) -> None:
    """Compile on (the toy model: padded lengths vary from batch to batch), against the
    same run eager: the losses of every step agree within bf16's resolution, and the
    checkpoint holds the model's own keys (no compile wrapper's prefix)."""
    runs = {}
    for mode in ("off", "on"):
        sink = ListSink([])
        job = replace(make_job(tmp_path / mode, sink=sink, epochs=1, compile=mode),
                      compile_backend=backend)  # fmt: skip
        train_local(job)
        runs[mode] = (_losses(sink), TrainingState.read(tmp_path / mode / "run" / CHECKPOINT_FILE))
    (eager, plain), (compiled, state) = runs["off"], runs["on"]
    assert len(eager) == len(compiled) == 8
    assert compiled == pytest.approx(eager, rel=2**-8)  # bf16 has 8 bits of mantissa
    assert set(state.model) == set(plain.model) == set(ToyFactory()().state_dict())
    for key, value in plain.model.items():
        assert torch.allclose(state.model[key], value, atol=1e-4), key


def test_a_compiled_run_pads_lengths_to_a_multiple(tmp_path: Path, monkeypatch) -> None:
    asked = []
    original = PoolFactory.__call__

    def spy(self, rank, world, options=None):
        asked.append(options)
        return original(self, rank, world, options)

    monkeypatch.setattr(PoolFactory, "__call__", spy)
    train_local(replace(make_job(tmp_path, epochs=1, compile="on"), compile_backend="eager"))
    train_local(make_job(tmp_path / "eager", epochs=1))
    assert [o.pad_to for o in asked] == [steps.PAD_MULTIPLE, 1]
    assert [o.eval_batch_size for o in asked] == [None, None]  # CPU: the params' batch


def test_the_host_sync_check_sets_and_restores_the_debug_mode(monkeypatch) -> None:
    modes: list[object] = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with steps.host_sync_check("error", CUDA):
        assert modes == ["error"]
    assert modes == ["error", 0]
    with steps.host_sync_check("error", CPU), steps.host_sync_check(None, CUDA):
        pass
    assert modes == ["error", 0]  # nothing on CPU, nothing without a mode
    with pytest.raises(RuntimeError), steps.host_sync_check("warn", CUDA):
        raise RuntimeError("a step failed")
    assert modes == ["error", 0, "warn", 0]  # restored on the way out


def test_the_checked_part_of_every_step_reads_nothing_from_the_device(
    tmp_path: Path, monkeypatch
) -> None:
    """What ``sync_debug`` guards (forward to optimizer step, schedule and average) never
    reads a tensor into Python, at logged steps included: their reads come after it."""
    item = torch.Tensor.item  # Adam's step counter is a CPU tensor: no device to wait for
    monkeypatch.setattr(sys.modules["torch.optim.adam"], "_get_value", lambda x: item(x))
    spy = _SyncSpy(monkeypatch)
    inside: list[int] = []
    outside = steps.host_sync_check

    def counted(mode, device):
        assert mode == ("error" if inside else None)  # the first step of a process is not
        before = len(spy.reads)
        with outside(mode, device):
            yield
        inside.append(len(spy.reads) - before)

    monkeypatch.setattr(loop, "host_sync_check", steps.contextlib.contextmanager(counted))
    job = replace(
        make_job(tmp_path, epochs=2, log_every=3, averaging={"kind": "ema", "epochs": 1}),
        sync_debug="error",
    )
    train_local(job)
    assert len(inside) == 16 and set(inside) == {0}
    assert spy.reads  # the logged steps and evaluations did read, outside


# --------------------------------------------------------------------------- validation


class _OutOfMemory(ToyModel):
    """Raises CUDA's out-of-memory error for validation batches above ``fits`` examples."""

    def __init__(self, fits: int, sizes: list[int]) -> None:
        super().__init__(ToyConfig(vocab_size=VOCAB, d_model=8))
        self.fits, self.sizes = fits, sizes

    def loss(self, batch: GenerateBatch) -> LossOutput:
        if not self.training:
            self.sizes.append(batch.batch_size)
            if batch.batch_size > self.fits:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().loss(batch)


@dataclass(frozen=True)
class _OutOfMemoryFactory:
    fits: int
    sizes: list

    def __call__(self) -> nn.Module:
        return _OutOfMemory(self.fits, self.sizes)


def test_validation_halves_its_batch_on_out_of_memory_and_remembers_it(
    tmp_path: Path, capsys
) -> None:
    sizes: list[int] = []
    params = {"epochs": 2, "eval_batch_size": 8}
    data = PoolFactory(n_train=32, n_valid=8, valid_from_train=True, eval_batch=8)
    sink = ListSink([])
    job = replace(make_job(tmp_path / "oom", sink=sink, **params), data=data,
                  model=_OutOfMemoryFactory(2, sizes))  # fmt: skip
    train_local(job)
    # the first validation tries 8, then 4, then 2 (twice: 8 examples), the second starts at 2
    assert sizes == [8, 4, 2, 2, 2, 2, 2, 2, 2, 2]
    assert "evaluation out of memory at batch 8: trying 4" in capsys.readouterr().err
    fits = ListSink([])
    small = replace(make_job(tmp_path / "fits", sink=fits, epochs=2, eval_batch_size=2),
                    data=replace(data, eval_batch=2), model=_OutOfMemoryFactory(2, []))  # fmt: skip
    train_local(small)
    valid = [m["valid_loss"] for _, m in sink.log if "valid_loss" in m]
    assert valid == pytest.approx([m["valid_loss"] for _, m in fits.log if "valid_loss" in m])
    assert all(math.isfinite(v) for v in valid)


def test_validation_with_a_batch_of_one_that_does_not_fit_fails(tmp_path: Path) -> None:
    job = replace(make_job(tmp_path, epochs=1, eval_batch_size=2),
                  data=PoolFactory(eval_batch=2), model=_OutOfMemoryFactory(0, []))  # fmt: skip
    with pytest.raises(torch.cuda.OutOfMemoryError):
        train_local(job)
