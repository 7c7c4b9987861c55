"""What evaluators share on a GPU, on CPU: the batch an evaluation starts from, the batch
limit at another size, and the back-off from out-of-memory."""

from __future__ import annotations

import pytest
import torch

from pipeline.eval.collect import (
    LARGE_EVAL_BATCH,
    LargestBatch,
    batch_limit,
    eval_autocast,
    first_eval_batch,
)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_an_evaluation_starts_large_on_cuda_and_as_configured_elsewhere() -> None:
    assert first_eval_batch(32, CPU) == 32
    assert first_eval_batch(32, CUDA) == LARGE_EVAL_BATCH
    assert first_eval_batch(32, CUDA, devices=4) == 4 * LARGE_EVAL_BATCH
    assert first_eval_batch(4096, CUDA) == 4096
    assert first_eval_batch(32, CUDA, grow=False) == 32  # a quick run, a size set on purpose


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
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
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


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # building it needs no GPU
def test_evaluation_autocasts_to_bf16_on_cuda_only() -> None:
    with eval_autocast(CPU):
        assert not torch.is_autocast_enabled("cpu")
    cast = eval_autocast(CUDA)
    assert isinstance(cast, torch.autocast)
    assert (cast.device, cast.fast_dtype) == ("cuda", torch.bfloat16)
