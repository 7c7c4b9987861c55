"""A batch maps every tensor it holds, nested histories included, and keeps the rest."""

from __future__ import annotations

import pytest
import torch

from pipeline.data.batch import History
from tests.batches import chitchat_select_batch, random_generate_batch, tensors

BATCHES = {
    "generate": lambda: random_generate_batch(3, 40, n_acts=4),
    "select": lambda: chitchat_select_batch(2, 3)[0],
}


@pytest.mark.parametrize("kind", BATCHES)
def test_map_tensors_maps_the_nested_history_too_and_keeps_other_fields(kind: str) -> None:
    batch = BATCHES[kind]()
    seen: list[torch.Tensor] = []

    def doubled(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t * 2

    mapped = batch.map_tensors(doubled)
    assert type(mapped) is type(batch) and type(mapped.history) is History
    assert [id(t) for t in seen] == [id(t) for t in tensors(batch)]
    assert len(seen) > len(tensors(batch.history)) > 0
    assert all(torch.equal(a, b * 2) for a, b in zip(tensors(mapped), tensors(batch), strict=True))
    assert mapped.dialogue_id == batch.dialogue_id
