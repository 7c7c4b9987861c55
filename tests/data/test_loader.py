"""Collate (padding, masks) and the rank-aware, length-bucketed batch loader."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.artifacts import VOCAB_FILE
from pipeline.config import Params
from pipeline.data.batch import GenerateBatch, LMBatch, SelectBatch
from pipeline.data.loader import (
    BatchLoader,
    collate,
    load_vocab,
    open_split,
    read_manifest,
)
from pipeline.data.plans import plan_batches
from pipeline.data.records import (
    KNOWLEDGE_PRIOR,
    KNOWLEDGE_SUGGESTED,
    GenerateExample,
    LMExample,
    SelectExample,
)
from pipeline.data.tokenize import tokenize_corpus
from pipeline.errors import DataError
from pipeline.names import Task


def arr(*values: int, dtype: type = np.int32) -> np.ndarray:
    return np.array(values, dtype=dtype)


def test_collate_generate_pads_and_masks() -> None:
    a = GenerateExample(
        "a",
        1,
        arr(2, 7, 3),
        arr(0, 0, 0),
        arr(0, 1, 2),
        arr(2, 2, 2),
        arr(2, 9, 9, 3),
        acts=arr(0, 3),
        belief_ids=arr(2, 3),
        act_ids=arr(2, 5, 3),
    )
    b = GenerateExample("b", 4, arr(8, 3, 2, 6, 3), arr(0, 0, 1, 1, 1), arr(0, 1, 0, 1, 2),
                        arr(1, 1, 2, 2, 2), arr(2, 3), acts=arr(), belief_ids=arr(2, 4, 4, 3),
                        act_ids=arr(2, 3))  # fmt: skip
    batch = collate([a, b], n_acts=5)
    assert isinstance(batch, GenerateBatch) and batch.batch_size == 2
    h = batch.history
    assert h.input_ids.tolist() == [[2, 7, 3, 0, 0], [8, 3, 2, 6, 3]]
    assert h.input_mask.tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert h.utt_index.tolist() == [[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]
    assert h.utt_pos.tolist() == [[0, 1, 2, 0, 0], [0, 1, 0, 1, 2]]
    assert h.speaker.tolist() == [[2, 2, 2, 0, 0], [1, 1, 2, 2, 2]]
    assert batch.target_ids.tolist() == [[2, 9, 9, 3], [2, 3, 0, 0]]
    assert batch.target_mask.tolist() == [[True] * 4, [True, True, False, False]]
    assert batch.turn.tolist() == [1, 4] and batch.dialogue_id == ("a", "b")
    assert batch.acts.tolist() == [[1, 0, 0, 1, 0], [0, 0, 0, 0, 0]]
    assert batch.belief_ids.tolist() == [[2, 3, 0, 0], [2, 4, 4, 3]]
    assert batch.act_ids.tolist() == [[2, 5, 3], [2, 3, 0]]
    assert h.input_ids.dtype == torch.long and h.input_mask.dtype == torch.bool
    plain = collate(
        [GenerateExample("c", 1, arr(2, 3), arr(0, 0), arr(0, 1), arr(1, 1), arr(2, 3))]
    )
    assert plain.acts is None and plain.belief_ids is None
    with pytest.raises(ValueError, match="n_acts"):
        collate([a])


def test_collate_select_pads_candidates_labels_and_knowledge() -> None:
    a = SelectExample(
        "a",
        1,
        arr(2, 5, 3),
        arr(0, 0, 0),
        arr(0, 1, 2),
        arr(2, 2, 2),
        (arr(2, 6, 3), arr(2, 7, 7, 7, 3)),
        arr(0, 1, dtype=np.int8),
        arr(0, KNOWLEDGE_PRIOR, 0, dtype=np.int8),
        (arr(0, 3, 0, dtype=np.int8), arr(0, 0, 2, 0, 0, dtype=np.int8)),
    )
    b = SelectExample("b", 2, arr(2, 3), arr(0, 0), arr(0, 1), arr(1, 1),
                      (arr(2, 9, 3), arr(2, 3), arr(2, 8, 3)), arr(1, 0, 1, dtype=np.int8),
                      arr(0, 0, dtype=np.int8),
                      (arr(0, 0, 0, dtype=np.int8), arr(0, 0, dtype=np.int8),
                       arr(0, KNOWLEDGE_SUGGESTED, 0, dtype=np.int8)))  # fmt: skip
    batch = collate([a, b])
    assert isinstance(batch, SelectBatch)
    assert batch.candidate_ids.shape == (2, 3, 5)
    assert batch.candidate_ids[0].tolist() == [[2, 6, 3, 0, 0], [2, 7, 7, 7, 3], [0] * 5]
    assert batch.candidate_mask[0].tolist() == [
        [True] * 3 + [False] * 2, [True] * 5, [False] * 5,
    ]  # fmt: skip
    assert batch.candidate_mask[1, 1].tolist() == [True, True, False, False, False]
    assert batch.labels.tolist() == [[0, 1, 0], [1, 0, 1]]
    assert batch.context_knowledge.shape == (2, 3, 2)
    assert batch.context_knowledge[0, :, 0].tolist() == [0, 1, 0]
    assert batch.candidate_knowledge.shape == (2, 3, 5, 2)
    assert batch.candidate_knowledge[0, 0, 1].tolist() == [1.0, 1.0]  # both bits
    assert batch.candidate_knowledge[1, 2, 1].tolist() == [0.0, 1.0]


def test_collate_lm_flat_is_the_concatenated_sentences() -> None:
    docs = [LMExample("a", 0, (arr(5, 6, 3), arr(7, 3))), LMExample("b", 4, (arr(8, 3),))]
    batch = collate(docs)
    assert isinstance(batch, LMBatch)
    assert batch.sentences.tolist() == [[[5, 6, 3], [7, 3, 0]], [[8, 3, 0], [0, 0, 0]]]
    assert batch.sentence_mask.sum().item() == 7 == batch.flat_mask.sum().item()
    assert batch.flat_ids.tolist() == [[5, 6, 3, 7, 3], [8, 3, 0, 0, 0]]
    assert torch.equal(batch.sentences[batch.sentence_mask], batch.flat_ids[batch.flat_mask])


def test_collate_rejects_mixed_or_empty_batches() -> None:
    with pytest.raises(ValueError, match="empty"):
        collate([])
    g = GenerateExample("a", 1, arr(2, 3), arr(0, 0), arr(0, 1), arr(1, 1), arr(2, 3))
    with pytest.raises(TypeError, match="one task kind"):
        collate([g, LMExample("b", 0, (arr(3),))])


# --------------------------------------------------------------------------- batching


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 120),
    batch_size=st.integers(1, 9),
    world_size=st.integers(1, 5),
    shuffle=st.booleans(),
    bucket=st.booleans(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_rank_slices_are_disjoint_equal_and_covering(
    n, batch_size, world_size, shuffle, bucket, drop_last, epoch
) -> None:
    lengths = np.random.default_rng(n).integers(1, 60, n)
    plan = plan_batches(lengths, batch_size, shuffle=shuffle, seed=7, epoch=epoch,
                        bucket=bucket, drop_last=drop_last, world_size=world_size)  # fmt: skip
    ranks = [plan[r::world_size] for r in range(world_size)]
    assert len({len(r) for r in ranks}) == 1  # every rank the same number of batches
    full, partial = divmod(n, batch_size)
    expected = full // world_size if drop_last else -(-(full + (partial > 0)) // world_size)
    assert len(ranks[0]) == expected
    seen = Counter(i for batch in plan for i in batch)
    assert all(batch for batch in plan) and all(len(b) <= batch_size for b in plan)
    if drop_last:
        assert all(len(b) == batch_size for b in plan) and max(seen.values(), default=1) == 1
    elif n >= expected * world_size:
        assert sorted(seen) == list(range(n)) and set(seen.values()) <= {1}  # exactly once
    else:  # fewer examples than ranks x batches: some repeat so that ranks stay in step
        assert sorted(seen) == list(range(n))
    if not drop_last and n >= expected * world_size:
        per_rank = [{i for b in r for i in b} for r in ranks]
        assert sum(len(s) for s in per_rank) == n  # disjoint


def test_plan_is_seeded_by_seed_and_epoch() -> None:
    lengths = np.arange(100) % 17
    plan = lambda **kw: plan_batches(lengths, 8, **kw)  # noqa: E731
    assert plan(seed=1, epoch=0) == plan(seed=1, epoch=0)
    assert plan(seed=1, epoch=0) != plan(seed=1, epoch=1)
    assert plan(seed=1, epoch=0) != plan(seed=2, epoch=0)
    assert plan(shuffle=False, bucket=False) == [
        list(range(i, min(i + 8, 100))) for i in range(0, 100, 8)
    ]


def test_bucketing_cuts_padding() -> None:
    lengths = np.random.default_rng(0).integers(1, 200, 2000)

    def padding(bucket: bool) -> int:
        plan = plan_batches(lengths, 16, seed=0, bucket=bucket)
        return sum(len(b) * lengths[b].max() - lengths[b].sum() for b in plan)

    assert padding(True) < 0.2 * padding(False)


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def chitchat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards") / "chitchat"
    settings = {"tasks": ["generate", "select", "lm"], "max_dialogues": 25,
                "select": {"n_candidates_train": 4, "n_candidates_eval": 12}}  # fmt: skip
    params = Params.model_validate({"tokenize": {"corpora": {"chitchat": settings}}})
    tokenize_corpus("chitchat", None, root, params)
    return root


@pytest.mark.slow
def test_loader_over_real_shards(chitchat: Path) -> None:
    vocab = load_vocab(chitchat)
    manifest = read_manifest(chitchat)
    assert len(vocab) == manifest.vocab_size
    for task, kind in (
        (Task.GENERATE, GenerateBatch),
        (Task.SELECT, SelectBatch),
        (Task.LM, LMBatch),
    ):
        dataset = open_split(chitchat, task, "train")
        assert len(dataset) == manifest.rows(task, "train") > 0
        loaders = [BatchLoader(dataset, 8, seed=3, rank=r, world_size=2) for r in range(2)]
        batches = [list(loader) for loader in loaders]
        assert len(batches[0]) == len(batches[1]) == len(loaders[0])
        ids = [d for rank in batches for b in rank for d in b.dialogue_id]
        assert len(ids) == len(dataset)  # every example once across the ranks
        assert all(isinstance(b, kind) for b in batches[0])
    batch = next(iter(BatchLoader(open_split(chitchat, Task.SELECT, "valid"), 4, shuffle=False)))
    assert batch.candidate_ids.shape[1] == 12 and batch.labels.sum().item() == 4
    first = next(iter(BatchLoader(open_split(chitchat, Task.GENERATE, "train"), 4, shuffle=False)))
    assert vocab.decode(first.target_ids[0]).strip()


@pytest.mark.slow
def test_batches_by_tokens_over_real_shards(chitchat: Path) -> None:
    for task in (Task.GENERATE, Task.SELECT, Task.LM):
        dataset = open_split(chitchat, task, "train")
        counts = dataset.token_counts()
        example = dataset[3]
        if task == Task.LM:
            assert counts[3] == sum(len(s) for s in example.sentences)
        elif task == Task.SELECT:
            tokens = sum(len(c) for c in example.candidate_ids) + len(example.input_ids)
            assert counts[3] == tokens
        else:
            assert counts[3] == len(example.input_ids) + len(example.target_ids)
        budget = int(counts.max()) * 3
        loaders = [BatchLoader(dataset, 1, seed=3, rank=r, world_size=2, batch_tokens=budget)
                   for r in range(2)]  # fmt: skip
        for epoch in (0, 1):
            plans = []
            for loader in loaders:
                loader.set_epoch(epoch)
                plans.append(loader.batches())
                assert len(loader) == len(plans[-1])  # every rank the same count
            assert len(plans[0]) == len(plans[1])
            assert sorted(i for plan in plans for b in plan for i in b) == list(range(len(dataset)))
        batches = list(loaders[0])
        assert len(batches) == len(loaders[0])
        for batch, indices in zip(batches, loaders[0].batches(), strict=True):
            # the budget holds the examples' own sizes; a compiled step's static shapes
            # (execution.Padding) pad after the loader (tests/execution)
            assert batch.batch_size == len(indices)
            assert len(indices) * counts[indices].max() <= budget or len(indices) == 1


def test_vocab_must_match_the_manifest(chitchat: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(chitchat, copy)
    text = (copy / VOCAB_FILE).read_text()
    assert '"lowercase": true' in text
    (copy / VOCAB_FILE).write_text(text.replace('"lowercase": true', '"lowercase": false'))
    with pytest.raises(DataError, match="hash"):
        load_vocab(copy)


def test_overwritten_token_ids_stop_the_loader_naming_file_and_stage(
    chitchat: Path, tmp_path: Path
) -> None:
    """4,000 bytes of token ids overwritten in place: the file keeps its size and passes
    Arrow's full validation (any int32 is a valid value), so only the manifest's sha256
    catches it, when a stage opens the split, before any batch."""
    copy = tmp_path / "chitchat"
    shutil.copytree(chitchat, copy)
    shard = copy / "generate" / "train-00000.arrow"
    mapped = pa.memory_map(str(shard))
    values = pa.ipc.open_file(mapped).get_batch(0).column("input_ids").values.buffers()[1]
    offset = values.address - mapped.read_buffer().address  # where the ids lie in the file
    assert values.size > 8000
    with shard.open("r+b") as f:
        f.seek(offset + 2000)
        f.write(np.full(1000, 2**31 - 1, dtype=np.int32).tobytes())
    mapped.close()
    with pytest.raises(DataError) as err:
        next(iter(BatchLoader(open_split(copy, Task.GENERATE, "train"), 8)))
    assert str(err.value).startswith(f"{shard}: sha256 differs from the manifest")
    assert "dvc repro -f tokenize@chitchat" in str(err.value)


@pytest.mark.slow
def test_worker_processes_give_the_same_batches(chitchat: Path) -> None:
    dataset = open_split(chitchat, Task.GENERATE, "valid")
    inline = list(BatchLoader(dataset, 5, seed=1))
    workers = list(BatchLoader(dataset, 5, seed=1, num_workers=1))
    assert len(inline) == len(workers)
    for a, b in zip(inline, workers, strict=True):
        assert (
            torch.equal(a.history.input_ids, b.history.input_ids) and a.dialogue_id == b.dialogue_id
        )
