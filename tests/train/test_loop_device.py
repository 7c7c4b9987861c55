"""The loop's paths for a GPU, exercised on CPU: the compiled step (against eager) and its
padded batches, the host-sync check around a step, and validation backing off from
out-of-memory."""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.data.batch import GenerateBatch
from pipeline.execution import PAD_MULTIPLE, ExecutionOverrides, ExecutionPolicy
from pipeline.models.base import LossOutput
from pipeline.train import loop
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.context import LocalContext
from pipeline.train.loop import train_local, train_worker
from tests.train.helpers import VOCAB, PoolFactory, ToyConfig, ToyFactory, ToyModel
from tests.train.test_loop import ListSink, _SyncSpy, make_job

EAGER = ExecutionOverrides(compile_backend="eager")  # compiles with no code generated


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
                      execution=ExecutionOverrides(backend))  # fmt: skip
        train_local(job)
        runs[mode] = (_losses(sink), TrainingState.read(tmp_path / mode / "run" / CHECKPOINT_FILE))
    (eager, plain), (compiled, state) = runs["off"], runs["on"]
    assert len(eager) == len(compiled) == 8
    assert compiled == pytest.approx(eager, rel=2**-8)  # bf16 has 8 bits of mantissa
    assert set(state.model) == set(plain.model) == set(ToyFactory()().state_dict())
    for key, value in plain.model.items():
        assert torch.allclose(state.model[key], value, atol=1e-4), key


def test_a_compiled_run_pads_its_training_batches_to_a_multiple(
    tmp_path: Path, monkeypatch
) -> None:
    """The policy pads the compiled step's batches at the loader's edge (lengths of the
    toy pool vary from batch to batch); an eager run's batches are as collated."""
    widths: list[tuple[int, int]] = []
    original = loop._Run.train_step

    def spy(self, batch):
        widths.append((batch.history.input_ids.shape[1], batch.target_ids.shape[1]))
        return original(self, batch)

    monkeypatch.setattr(loop._Run, "train_step", spy)
    train_local(replace(make_job(tmp_path, epochs=1, compile="on"), execution=EAGER))
    compiled, widths[:] = list(widths), []
    train_local(make_job(tmp_path / "eager", epochs=1))
    assert len(compiled) == len(widths) == 8
    assert all(w % PAD_MULTIPLE == 0 for pair in compiled for w in pair)
    assert any(w % PAD_MULTIPLE for pair in widths for w in pair)  # the eager run: unpadded
    assert all(c == -(-w // 8) * 8 for cs, ws in zip(compiled, widths, strict=True)
               for c, w in zip(cs, ws, strict=True))  # fmt: skip


def test_the_checked_part_of_every_step_reads_nothing_from_the_device(
    tmp_path: Path, monkeypatch
) -> None:
    """What ``sync_debug`` guards (forward to optimizer step, schedule and average) never
    reads a tensor into Python, at logged steps included: their reads come after it."""
    item = torch.Tensor.item  # Adam's step counter is a CPU tensor: no device to wait for
    monkeypatch.setattr(sys.modules["torch.optim.adam"], "_get_value", lambda x: item(x))
    spy = _SyncSpy(monkeypatch)
    inside: list[int] = []
    outside = ExecutionPolicy.step

    def counted(self, checked=True):
        assert self.sync_debug == "error"
        assert checked == bool(inside)  # the first step of a process is not
        before = len(spy.reads)
        with outside(self, checked):
            yield
        inside.append(len(spy.reads) - before)

    monkeypatch.setattr(ExecutionPolicy, "step", contextlib.contextmanager(counted))
    job = replace(
        make_job(tmp_path, epochs=2, log_every=3, averaging={"kind": "ema", "epochs": 1}),
        execution=ExecutionOverrides(sync_debug="error"),
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


class _Autocasts(ToyModel):
    """Records the autocast dtype of every validation batch (None: none)."""

    def __init__(self, seen: list) -> None:
        super().__init__(ToyConfig(vocab_size=VOCAB, d_model=8))
        self.seen = seen

    def loss(self, batch: GenerateBatch) -> LossOutput:
        if not self.training:
            cast = torch.is_autocast_enabled("cpu")
            self.seen.append(torch.get_autocast_dtype("cpu") if cast else None)
        return super().loss(batch)


@dataclass(frozen=True)
class _AutocastsFactory:
    seen: list

    def __call__(self) -> nn.Module:
        return _Autocasts(self.seen)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp32", None)])
def test_validation_runs_at_the_runs_precision(tmp_path: Path, precision, dtype) -> None:
    seen: list = []
    job = replace(make_job(tmp_path, epochs=1, precision=precision),
                  model=_AutocastsFactory(seen))  # fmt: skip
    train_local(job)
    assert seen and set(seen) == {dtype}


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


# --------------------------------------------------------------------------- two ranks


class _GlooContext(LocalContext):
    """A rank of a ``torch.distributed`` gloo group in this process (no Ray): DDP, the
    group's collectives, checkpoints from rank 0 in the rank's own folder."""

    def __init__(self, run_dir: Path, rank: int, world_size: int) -> None:
        super().__init__(run_dir, torch.device("cpu"))
        self.rank, self.world_size = rank, world_size

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return nn.parallel.DistributedDataParallel(model)

    def all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(values)
        return values

    def gather(self, value):
        out: list = [None] * self.world_size
        torch.distributed.all_gather_object(out, value)
        return out


@dataclass(frozen=True)
class _RankOutOfMemoryFactory:
    """``_OutOfMemory`` fitting ``fits[rank]`` validation examples on each rank."""

    fits: tuple[int, ...]
    sizes: list

    def __call__(self) -> nn.Module:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return _OutOfMemory(self.fits[rank], self.sizes)


def _ddp_rank(rank: int, folder: Path, job) -> None:
    """One rank of the two-process run: its validation batch sizes and (rank 0) the
    validation losses go to ``<folder>/rank<r>.pt``."""
    torch.set_num_threads(1)  # forked: no OpenMP pool from the parent
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2
    )
    try:
        train_worker(job, _GlooContext(folder / f"rank{rank}", rank, 2))
        sink = job.sink()
        losses = [m["valid_loss"] for _, m in sink.log if "valid_loss" in m]
        torch.save({"sizes": job.model.sizes, "valid": losses}, folder / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_agree_on_the_validation_batch_after_one_runs_out_of_memory(
    tmp_path: Path,
) -> None:
    """DDP over 2 gloo processes; rank 1 runs out of memory above 2 examples of its own
    (4 global), rank 0 never: both halve together from 8 to 4 and keep it, and the
    validation losses are those of one process that fits everything (a rank that halved
    alone evaluated another plan's slice: two examples twice, two never)."""
    params = {"epochs": 2, "eval_batch_size": 8}
    data = PoolFactory(n_train=32, n_valid=8, valid_from_train=True, eval_batch=8)
    one = ListSink([])
    train_local(replace(make_job(tmp_path / "one", sink=one, **params), data=data,
                        model=_OutOfMemoryFactory(100, [])))  # fmt: skip
    job = replace(make_job(tmp_path / "two", sink=ListSink([]), **params), data=data,
                  model=_RankOutOfMemoryFactory((100, 2), []))  # fmt: skip
    torch.multiprocessing.start_processes(_ddp_rank, (tmp_path, job), nprocs=2, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # each rank's local batches: 4 (rank 1 out of memory), then 2 and 2, twice
    assert ranks[0]["sizes"] == ranks[1]["sizes"] == [4, 2, 2, 2, 2]
    single = [m["valid_loss"] for _, m in one.log if "valid_loss" in m]
    assert len(single) == 2 and ranks[0]["valid"] == pytest.approx(single, rel=1e-6)
