"""Batches onto the device: each when taken on a CPU, one ahead on CUDA (the CUDA path runs
without a GPU, on batches that record how they are moved)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from pipeline.execution import to_device
from tests.batches import random_generate_batch
from tests.train.helpers import VOCAB


def _pulled(items: Iterable, log: list) -> Iterator:
    """``items``, appending each to ``log`` when it is pulled."""
    for item in items:
        log.append(item)
        yield item


def test_to_device_on_cpu_moves_each_batch_when_taken():
    batches = [random_generate_batch(2, VOCAB, seed=s) for s in range(4)]
    pulled: list = []
    moved = to_device(_pulled(batches, pulled), torch.device("cpu"))
    first = next(moved)
    assert len(pulled) == 1 and torch.equal(first.target_ids, batches[0].target_ids)
    rest = list(moved)
    assert len(rest) == 3 and len(pulled) == 4
    for got, want in zip(rest, batches[1:], strict=True):
        assert torch.equal(got.target_ids, want.target_ids)
        assert torch.equal(got.history.input_ids, want.history.input_ids)


@dataclass
class _FakeBatch:
    """Records how ``to_device`` moves it (the CUDA path runs without a GPU)."""

    index: int
    log: list

    def pin_memory(self) -> _FakeBatch:
        self.log.append(("pin", self.index))
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> _FakeBatch:
        self.log.append(("copy", self.index, device.type, non_blocking))
        return self


def test_to_device_on_cuda_copies_one_batch_ahead():
    log: list = []
    pulled: list = []
    batches = [_FakeBatch(i, log) for i in range(4)]
    moved = to_device(_pulled(batches, pulled), torch.device("cuda"))
    assert next(moved).index == 0
    # batch 1 was pinned and its copy queued before batch 0 was handed out
    assert log == [("pin", 0), ("copy", 0, "cuda", True), ("pin", 1), ("copy", 1, "cuda", True)]
    assert next(moved).index == 1 and len(pulled) == 3
    moved.close()  # the consumer stops early: nothing more is pulled
    assert len(pulled) == 3
    log.clear()
    assert [b.index for b in to_device(iter(batches), torch.device("cuda"))] == [0, 1, 2, 3]
    assert [e for e in log if e[0] == "copy"] == [("copy", i, "cuda", True) for i in range(4)]
    assert list(to_device(iter([]), torch.device("cuda"))) == []
