"""Evaluation's batch size on a GPU, on CPU: the batch limit at another size, the back-off
from out-of-memory, and the ranks agreeing on the size after one of them ran out."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.config import Precision
from pipeline.execution import (
    ExecutionPolicy,
    LargestBatch,
    RankFailed,
    Status,
    batch_limit,
    out_of_memory,
)
from tests.gloo import gloo_group, run_ranks

CUDA = torch.device("cuda")
MODEL = nn.Linear(2, 2)  # the plain module an evaluation runs


def _out_of_memory() -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")


def test_a_batch_limit_covers_the_same_examples_at_another_size() -> None:
    assert batch_limit(None, 32, 8) is None
    assert batch_limit(3, 32, 32) == 3
    assert batch_limit(3, 32, 8) == 12  # 96 examples either way
    assert batch_limit(3, 32, 5) == 20  # at least the 96: 100


def test_out_of_memory_halves_the_batch_and_the_size_is_remembered(capsys) -> None:
    tried: list[int] = []

    def attempt(size: int) -> str:
        tried.append(size)
        if size > 100:
            raise _out_of_memory()
        return f"done at {size}"

    largest = LargestBatch()
    assert largest.run(attempt, 512) == "done at 64"
    assert tried == [512, 256, 128, 64] and largest.size == 64
    assert "evaluation out of memory at batch 512: trying 256" in capsys.readouterr().err
    assert largest.run(attempt, 512) == "done at 64" and tried[4:] == [64]  # remembered
    with pytest.raises(torch.cuda.OutOfMemoryError):
        LargestBatch().run(lambda size: attempt(1000), 3)  # tries 3, then 1, then gives up
    with pytest.raises(ValueError, match="not memory"):  # other errors pass through at once
        LargestBatch().run(lambda size: (_ for _ in ()).throw(ValueError("not memory")), 8)


class _Collective:
    """``agree`` of each of ``n`` ranks running in threads: the all-reduce's barrier."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=30)
        self.outcomes: list[tuple[Status, str]] = [(Status.OK, "")] * n

    def agree(self, rank: int):
        def agree(status: Status, message: str) -> list[tuple[Status, str]]:
            self.outcomes[rank] = (status, message)
            self.barrier.wait()
            answer = list(self.outcomes)
            self.barrier.wait()  # every rank has read the outcomes before the next round
            return answer

        return agree


def _ranks(
    fits: list[int], start: int = 512, fails: dict[int, Exception] | None = None
) -> tuple[list[list[int]], list[object]]:
    """Each rank's evaluation in a thread, rank r fitting ``fits[r]`` examples and raising
    ``fails[r]`` (when given) at its first attempt: the sizes each tried, and what each
    returned (its size) or raised."""
    collective = _Collective(len(fits))
    tried: list[list[int]] = [[] for _ in fits]
    outcome: list[object] = [None] * len(fits)

    def rank(r: int) -> None:
        def attempt(size: int) -> int:
            tried[r].append(size)
            if fails and r in fails:
                raise fails[r]
            if size > fits[r]:
                raise _out_of_memory()
            return size

        try:
            outcome[r] = LargestBatch().run(attempt, start, collective.agree(r))
        except Exception as err:
            outcome[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(fits))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return tried, outcome


def test_the_ranks_halve_together_when_one_runs_out_of_memory(capsys) -> None:
    """Rank 1 fits 100 examples, rank 0 all of them: both end at 64, halving from 512
    together (rank 0 alone would have kept 512 and sliced another plan than rank 1)."""
    tried, outcome = _ranks([10_000, 100])
    assert tried == [[512, 256, 128, 64]] * 2 and outcome == [64, 64]
    err = capsys.readouterr().err
    assert "evaluation out of memory at batch 512 (another rank's): trying 256" in err
    assert "evaluation out of memory at batch 512: trying 256" in err


def test_a_batch_of_one_that_does_not_fit_one_rank_stops_every_rank() -> None:
    tried, outcome = _ranks([10_000, 0], start=2)
    assert tried == [[2, 1]] * 2
    assert isinstance(outcome[0], torch.cuda.OutOfMemoryError)
    assert "on another rank at a batch of one" in str(outcome[0])
    assert isinstance(outcome[1], torch.cuda.OutOfMemoryError)


def test_an_error_on_one_rank_stops_every_rank_at_once() -> None:
    """Rank 1's attempt raises a ValueError: it raises that error, rank 0 (whose attempt
    ran) a RankFailed naming rank 1 and its message, neither trying again."""
    boom = ValueError("bad batch")
    tried, outcome = _ranks([10_000, 10_000], start=8, fails={1: boom})
    assert tried == [[8], [8]]
    assert outcome[1] is boom
    assert isinstance(outcome[0], RankFailed)
    assert "rank 1's attempt at a batch of 8 raised ValueError: bad batch" in str(outcome[0])


def test_a_cublas_allocation_failure_is_out_of_memory_and_other_runtime_errors_are_not(
    capsys,
) -> None:
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`")
    assert out_of_memory(cublas) and out_of_memory(_out_of_memory())
    assert not out_of_memory(RuntimeError("shape mismatch")) and not out_of_memory(KeyError())
    tried: list[int] = []

    def attempt(size: int) -> int:
        tried.append(size)
        if size > 2:
            raise cublas
        return size

    assert LargestBatch().run(attempt, 8) == 2 and tried == [8, 4, 2]
    assert "evaluation out of memory at batch 8: trying 4" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="shape mismatch"):
        LargestBatch().run(lambda size: (_ for _ in ()).throw(RuntimeError("shape mismatch")), 8)


def test_an_evaluation_runs_at_the_size_found_and_the_limit_scaled_to_it() -> None:
    policy = ExecutionPolicy.for_evaluation(Precision.AUTO, CUDA)
    evaluation = policy.evaluation(32, limit=None)
    calls: list[tuple[int, int | None]] = []

    def attempt(size: int, limit: int | None) -> int:
        calls.append((size, limit))
        if size > 128:
            raise _out_of_memory()
        return size

    assert evaluation.run(attempt, MODEL) == 128 and evaluation.size == 128
    assert calls == [(512, None), (256, None), (128, None)]
    quick = policy.evaluation(32, limit=3)  # a quick run's first 3 batches, not grown
    assert quick.run(attempt, MODEL) == 32 and calls[-1] == (32, 3)
    shared = policy.evaluation(32, largest=evaluation.largest)  # the stage's next seed
    assert shared.run(attempt, MODEL) == 128 and calls[-1] == (128, None)


# --------------------------------------------------------------------------- two gloo ranks


def _outcome(run) -> tuple[str, str]:
    """The type and message of what ``run()`` raised, or ("returned", its value)."""
    try:
        return "returned", str(run())
    except Exception as err:
        return type(err).__name__, str(err)


def _gloo_rank(rank: int, folder: Path) -> None:
    """One rank of a 2-process gloo group (``tests.gloo``: a rank left waiting fails the
    test instead of hanging it): an evaluation whose attempt raises on rank 1, one that
    runs out of memory as cuBLAS says it on rank 0 above 2 examples, and one given a
    DDP-wrapped model; what each did goes to ``<folder>/rank<r>.pt``."""
    with gloo_group(rank, 2, folder) as ranks:
        policy = ExecutionPolicy(torch.device("cpu"), world_size=2)
        tried: list[int] = []

        def fails(size: int, limit: int | None) -> int:
            if rank == 1:
                raise ValueError("bad batch on rank 1")
            return size

        def cublas(size: int, limit: int | None) -> int:
            tried.append(size)
            if rank == 0 and size > 2:
                raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED")
            return size

        model = nn.Linear(2, 2)
        wrapped = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        got = {
            "error": _outcome(lambda: policy.evaluation(8, ranks=ranks).run(fails, model)),
            "oom": _outcome(lambda: policy.evaluation(8, ranks=ranks).run(cublas, model)),
            "tried": tried,
            "ddp": _outcome(lambda: policy.evaluation(8, ranks=ranks).run(cublas, wrapped)),
        }
        torch.save(got, folder / f"rank{rank}.pt")


@pytest.mark.slow
def test_two_gloo_ranks_raise_together_halve_together_and_refuse_ddp(tmp_path: Path) -> None:
    """Rank 1's attempt raises: rank 1 raises its error, rank 0 a RankFailed naming it
    (neither waits for the other until the group's timeout). cuBLAS's allocation failure
    on rank 0 halves both ranks from 8 to 2. A DDP-wrapped model is refused on both."""
    run_ranks(_gloo_rank, (tmp_path,))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[1]["error"] == ("ValueError", "bad batch on rank 1")
    kind, message = ranks[0]["error"]
    assert kind == "RankFailed"
    assert "rank 1's attempt at a batch of 8 raised ValueError: bad batch on rank 1" in message
    assert ranks[0]["oom"] == ranks[1]["oom"] == ("returned", "2")
    assert ranks[0]["tried"] == ranks[1]["tried"] == [8, 4, 2]
    for got in ranks:
        kind, message = got["ddp"]
        assert kind == "ValueError" and "DistributedDataParallel" in message


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_cache_is_released_where_the_policy_has_one(device: str, monkeypatch) -> None:
    """After an evaluation the policy's device gets its cached memory back: on CUDA, and
    never on a CPU policy, even in a process that sees a GPU."""
    released: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    policy = ExecutionPolicy.for_evaluation(Precision.FP32, torch.device(device))
    assert policy.evaluation(4).run(lambda size, limit: size, MODEL) == (
        4 if device == "cpu" else 512
    )
    assert bool(released) == (device == "cuda")
