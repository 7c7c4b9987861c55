"""``pipeline.machine``: the threads a worker computes with. What a record says about the
machine is checked where records are written (``tests/train/test_run.py``)."""

from __future__ import annotations

import pytest
import torch

from pipeline.machine import cpu_threads


@pytest.mark.parametrize(("cpus", "threads"), [(2.0, 2), (1.5, 1), (0.25, 1), (3.0, 3)])
def test_a_worker_computes_with_a_thread_per_whole_core_and_at_least_one(cpus, threads):
    before = torch.get_num_threads()
    with cpu_threads(cpus) as granted:
        assert granted == threads
        assert torch.get_num_threads() == threads
    assert torch.get_num_threads() == before


def test_the_callers_threads_come_back_when_the_block_fails():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"), cpu_threads(before + 2):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
