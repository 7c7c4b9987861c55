"""Evaluation's batch size on a GPU, on CPU: the batch limit at another size, the back-off
from out-of-memory, and the ranks agreeing on the size after one of them ran out."""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline.config import Precision
from pipeline.execution import ExecutionPolicy, LargestBatch, batch_limit

CUDA = torch.device("cuda")


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
    """``any_rank`` of each of ``n`` ranks running in threads: the all-reduce's barrier."""

    def __init__(self, n: int) -> None:
        self.barrier, self.flags = threading.Barrier(n, timeout=30), [False] * n

    def any_rank(self, rank: int):
        def any_rank(flag: bool) -> bool:
            self.flags[rank] = flag
            self.barrier.wait()
            answer = any(self.flags)
            self.barrier.wait()  # every rank has read the flags before the next round
            return answer

        return any_rank


def _ranks(fits: list[int], start: int = 512) -> tuple[list[list[int]], list[object]]:
    """Each rank's evaluation in a thread, rank r fitting ``fits[r]`` examples: the sizes
    each tried, and what each returned (its size) or raised."""
    collective = _Collective(len(fits))
    tried: list[list[int]] = [[] for _ in fits]
    outcome: list[object] = [None] * len(fits)

    def rank(r: int) -> None:
        def attempt(size: int) -> int:
            tried[r].append(size)
            if size > fits[r]:
                raise _out_of_memory()
            return size

        try:
            outcome[r] = LargestBatch().run(attempt, start, collective.any_rank(r))
        except torch.cuda.OutOfMemoryError as err:
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
    assert "on another rank at a batch of one" in str(outcome[0])
    assert isinstance(outcome[1], torch.cuda.OutOfMemoryError)


def test_an_evaluation_runs_at_the_size_found_and_the_limit_scaled_to_it() -> None:
    policy = ExecutionPolicy.for_evaluation(Precision.AUTO, CUDA)
    evaluation = policy.evaluation(32, limit=None)
    calls: list[tuple[int, int | None]] = []

    def attempt(size: int, limit: int | None) -> int:
        calls.append((size, limit))
        if size > 128:
            raise _out_of_memory()
        return size

    assert evaluation.run(attempt) == 128 and evaluation.size == 128
    assert calls == [(512, None), (256, None), (128, None)]
    quick = policy.evaluation(32, limit=3)  # a quick run's first 3 batches, not grown
    assert quick.run(attempt) == 32 and calls[-1] == (32, 3)
    shared = policy.evaluation(32, largest=evaluation.largest)  # the stage's next seed
    assert shared.run(attempt) == 128 and calls[-1] == (128, None)
