"""From shards to padded batches: a torch ``Dataset`` per task+split, collate, and a
length-bucketed, rank-aware batch loader.

``BatchLoader`` gives each of ``world_size`` ranks a disjoint slice of the batches and every
rank the SAME number of them (a DDP rank with one batch fewer would wait forever for the
others' gradients). When the batch count does not divide, the largest batches are split
in two until it does, so evaluation still sees every example exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pipeline.artifacts import ACTS_FILE, VOCAB_FILE, TokenizeRecord
from pipeline.data.acts import ActInventory
from pipeline.data.batch import Batch, GenerateBatch, History, LMBatch, SelectBatch
from pipeline.data.plans import plan_batches, plan_token_batches
from pipeline.data.records import (
    N_KNOWLEDGE,
    Example,
    GenerateExample,
    LMExample,
    Rows,
    SelectExample,
)
from pipeline.data.resample import TrainingDraws
from pipeline.data.shards import ShardTable, read_manifest
from pipeline.data.streams import LMFeed, split_stream
from pipeline.data.vocab import Vocab
from pipeline.errors import DataError
from pipeline.names import Task

__all__ = [
    "BatchLoader",
    "ExampleDataset",
    "collate",
    "load_act_inventory",
    "load_vocab",
    "open_split",
    "read_manifest",
]

# Columns whose lengths decide how much padding a batch carries.
_LENGTH_COLUMNS = {
    Task.GENERATE: ("input_ids", "target_ids"),
    Task.SELECT: ("input_ids", "candidate_ids"),
    Task.LM: ("sentences",),
}


def load_vocab(root: str | Path) -> Vocab:
    """The vocabulary of a tokenized corpus folder, checked against its manifest."""
    root = Path(root)
    manifest = read_manifest(root)
    vocab = Vocab.load(root / VOCAB_FILE)
    if vocab.content_hash != manifest.vocab_hash:
        raise DataError(
            root / VOCAB_FILE, "vocabulary does not match the manifest's hash; rerun tokenize"
        )
    return vocab


def load_act_inventory(root: str | Path) -> ActInventory:
    """The MultiWOZ act inventory (multi-hot positions) of a tokenized corpus folder."""
    return ActInventory.load(Path(root) / ACTS_FILE)


class ExampleDataset(Dataset):
    """The examples of one task and split (memory-mapped shards); ``ds[i]`` is an example.

    ``n_acts`` (MultiWOZ) is the width of the multi-hot act vectors :meth:`collate` builds.
    ``draws``: the training select split of a corpus tokenized with
    ``select.resample_negatives`` redraws its candidates (and, with augmentation, its
    contexts) per (seed, epoch, row), as :meth:`set_epoch` last set; None elsewhere, the
    examples then being exactly the stored ones. ``stream``: a language model's split
    read as one text (``feed`` given, and its ``lm`` params asking for it:
    ``data.streams.split_stream``): its examples are windows of it, a training split's
    recut by :meth:`set_epoch`.
    """

    def __init__(
        self, root: str | Path, task: Task | str, split: str, feed: LMFeed | None = None
    ) -> None:
        self.table = ShardTable(root, task, split)
        self.task = self.table.task
        self.split = split
        self.n_acts = self.manifest.n_acts
        self.draws = TrainingDraws.of(self.table, split)
        self.stream = None if feed is None else split_stream(self.table, split, feed)

    @property
    def manifest(self) -> TokenizeRecord:
        return self.table.manifest

    @property
    def by_epoch(self) -> bool:
        """Whether the examples themselves change with the epoch (stream segments)."""
        return self.stream is not None and self.stream.by_epoch

    def __len__(self) -> int:
        return len(self.table) if self.stream is None else len(self.stream)

    def __getitem__(self, index: int) -> Example:
        if self.stream is not None:
            return self.stream[index]
        example = self.table[index]
        if self.draws is None:
            return example
        return self.draws(example, index % len(self))  # type: ignore[arg-type]

    def set_epoch(self, epoch: int, seed: int = 0) -> None:
        """The epoch and run seed that per-epoch draws depend on (no-op without them)."""
        if self.draws is not None:
            self.draws.set_epoch(epoch, seed)
        if self.stream is not None:
            self.stream.set_epoch(epoch, seed)

    def lengths(self) -> np.ndarray:
        """Per-example size used for length bucketing (a stream window's: its tokens)."""
        if self.stream is not None:
            return self.stream.token_counts()
        return self.table.lengths(*_LENGTH_COLUMNS[self.task])

    def token_counts(self) -> np.ndarray:
        """Per example, the tokens it brings to a batch (batches by tokens): history and
        response; history and every candidate; every sentence of a document. The stored
        examples are counted (not a training epoch's redrawn candidates)."""
        if self.task == Task.GENERATE or self.stream is not None:
            return self.lengths()
        column = "candidate_ids" if self.task == Task.SELECT else "sentences"
        counts = np.zeros(len(self), dtype=np.int64)
        for i in range(len(self)):
            example = self.table[i]
            rows = getattr(example, column)
            counts[i] = sum(len(r) for r in rows)
            if self.task == Task.SELECT:
                counts[i] += len(example.input_ids)  # type: ignore[union-attr]
        return counts

    def collate(self, examples: Sequence[Example]) -> Batch:
        return collate(examples, self.n_acts)


def open_split(
    root: str | Path, task: Task | str, split: str, feed: LMFeed | None = None
) -> ExampleDataset:
    """The dataset of ``task`` examples of ``split`` in the tokenized folder ``root``.
    ``feed``: how a language model reads the split (its unit, the run's ``lm`` params:
    ``data.streams.split_stream``); None: the stored examples."""
    return ExampleDataset(root, task, split, feed)


# --------------------------------------------------------------------------- collate


def _pad(rows: Sequence[np.ndarray], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``[B, max len]``, zero-padded on the right."""
    width = max((len(r) for r in rows), default=0)
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out).to(dtype)


def _pad_nested(rows: Sequence[Sequence[np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, max count, max len]`` zero-padded values and their bool mask.

    Rows that are ``Rows`` views (select candidates, LM sentences read from shards) are
    gathered straight from their pool, one numpy call per batch row.
    """
    parts = []
    for row in rows:
        if isinstance(row, Rows):
            refs = np.asarray(row.index, dtype=np.int64)
            starts = row.pool.offsets[refs].astype(np.int64)
            lengths = row.pool.offsets[refs + 1].astype(np.int64) - starts
            values = row.pool.values
        else:
            lengths = np.array([len(a) for a in row], dtype=np.int64)
            starts = np.cumsum(lengths) - lengths
            values = np.concatenate(row) if len(row) else np.zeros(0, dtype=np.int64)
        parts.append((values, starts, lengths))
    count = max((len(p[1]) for p in parts), default=0)
    width = max((int(p[2].max()) for p in parts if len(p[2])), default=0)
    out = np.zeros((len(rows), count, width), dtype=np.int64)
    mask = np.zeros((len(rows), count, width), dtype=bool)
    pos = np.arange(width)
    for b, (values, starts, lengths) in enumerate(parts):
        real = pos[None, :] < lengths[:, None]
        out[b, : len(starts)][real] = values[(starts[:, None] + pos[None, :])[real]]
        mask[b, : len(starts)] = real
    return torch.from_numpy(out), torch.from_numpy(mask)


def _mask(lengths: Sequence[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]


def collate_history(
    input_ids: Sequence[np.ndarray],
    utt_index: Sequence[np.ndarray],
    utt_pos: Sequence[np.ndarray],
    speaker: Sequence[np.ndarray],
) -> History:
    """Per-example history columns -> a right-padded ``History`` batch."""
    ids = _pad(input_ids)
    return History(
        input_ids=ids,
        input_mask=_mask([len(row) for row in input_ids], ids.shape[1]),
        utt_index=_pad(utt_index),
        utt_pos=_pad(utt_pos),
        speaker=_pad(speaker),
    )


def _history(examples: Sequence[GenerateExample | SelectExample]) -> History:
    return collate_history(
        [e.input_ids for e in examples],
        [e.utt_index for e in examples],
        [e.utt_pos for e in examples],
        [e.speaker for e in examples],
    )


def _bits(flags: torch.Tensor) -> torch.Tensor:
    """Per-token bit sets -> ``[..., N_KNOWLEDGE]`` float 0/1 features."""
    return torch.stack([(flags >> k) & 1 for k in range(N_KNOWLEDGE)], dim=-1).float()


def _optional(values: list, name: str) -> bool:
    present = sum(v is not None for v in values)
    if present not in (0, len(values)):
        raise ValueError(f"{name} is set on some examples of the batch and not on others")
    return present > 0


def collate_generate(
    examples: Sequence[GenerateExample], n_acts: int | None = None
) -> GenerateBatch:
    """Generate examples -> ``GenerateBatch`` (``acts`` multi-hot over ``n_acts``)."""
    targets = _pad([e.target_ids for e in examples])
    acts = belief = act_ids = None
    if _optional([e.acts for e in examples], "acts"):
        if n_acts is None:
            raise ValueError("examples carry acts: pass n_acts (the manifest's act inventory size)")
        acts = torch.zeros(len(examples), n_acts)
        for i, e in enumerate(examples):
            acts[i, torch.from_numpy(e.acts.astype(np.int64))] = 1.0
    if _optional([e.belief_ids for e in examples], "belief_ids"):
        belief = _pad([e.belief_ids for e in examples])
    if _optional([e.act_ids for e in examples], "act_ids"):
        act_ids = _pad([e.act_ids for e in examples])
    return GenerateBatch(
        history=_history(examples),
        target_ids=targets,
        target_mask=_mask([len(e.target_ids) for e in examples], targets.shape[1]),
        turn=torch.tensor([e.turn for e in examples], dtype=torch.long),
        dialogue_id=tuple(e.dialogue_id for e in examples),
        acts=acts,
        belief_ids=belief,
        act_ids=act_ids,
    )


def collate_select(examples: Sequence[SelectExample]) -> SelectBatch:
    """Select examples -> ``SelectBatch``; rows with fewer candidates get all-pad candidates
    (``candidate_mask`` all False, label 0)."""
    candidates, mask = _pad_nested([e.candidate_ids for e in examples])
    labels = torch.zeros(candidates.shape[:2])
    for i, e in enumerate(examples):
        labels[i, : len(e.labels)] = torch.from_numpy(e.labels.astype(np.float32))
    ctx_k = cand_k = None
    if _optional([e.context_knowledge for e in examples], "context_knowledge"):
        ctx_k = _bits(_pad([e.context_knowledge for e in examples]))
    if _optional([e.candidate_knowledge for e in examples], "candidate_knowledge"):
        knowledge = [e.candidate_knowledge for e in examples]
        cand_k = _bits(_pad_nested(knowledge)[0])  # type: ignore[arg-type]
    return SelectBatch(
        history=_history(examples),
        candidate_ids=candidates,
        candidate_mask=mask,
        labels=labels,
        dialogue_id=tuple(e.dialogue_id for e in examples),
        context_knowledge=ctx_k,
        candidate_knowledge=cand_k,
    )


def collate_lm(examples: Sequence[LMExample]) -> LMBatch:
    """LM documents -> ``LMBatch`` (sentences ``[B, S, Ls]`` and the same tokens flat)."""
    sentences, mask = _pad_nested([e.sentences for e in examples])
    flat_rows = [np.concatenate(e.sentences) if e.sentences else np.zeros(0) for e in examples]
    flat = _pad(flat_rows)
    context = None
    if _optional([e.context for e in examples], "context"):
        context = torch.tensor([e.context for e in examples], dtype=torch.long)
    return LMBatch(
        sentences=sentences,
        sentence_mask=mask,
        flat_ids=flat,
        flat_mask=_mask([len(r) for r in flat_rows], flat.shape[1]),
        dialogue_id=tuple(e.dialogue_id for e in examples),
        context_tokens=context,
    )


def collate(examples: Sequence[Example], n_acts: int | None = None) -> Batch:
    """Examples of one task kind -> its padded batch (token id 0 and False mark padding;
    every length the batch's longest; static shapes for a compiled step are the execution
    policy's padding, ``Batch.padded``, at the loader's edge)."""
    if not examples:
        raise ValueError("cannot collate an empty batch")
    first = examples[0]
    if any(type(e) is not type(first) for e in examples):
        raise TypeError("a batch must hold examples of one task kind")
    if isinstance(first, GenerateExample):
        return collate_generate(examples, n_acts)  # type: ignore[arg-type]
    if isinstance(first, SelectExample):
        return collate_select(examples)  # type: ignore[arg-type]
    if isinstance(first, LMExample):
        return collate_lm(examples)  # type: ignore[arg-type]
    raise TypeError(f"not an example: {type(first).__name__}")


# --------------------------------------------------------------------------- batching


class BatchLoader:
    """Padded batches of a dataset for one rank; call ``set_epoch`` before each epoch.

    Every rank builds the same epoch plan from (seed, epoch) and takes every
    ``world_size``-th batch from ``rank``: disjoint slices, equal counts. ``batch_tokens``
    (this rank's budget) batches by padded tokens instead of ``batch_size`` examples
    (``plans.plan_token_batches``).
    ``num_workers > 0`` collates in worker processes (each maps the shards itself).
    """

    def __init__(
        self,
        dataset: ExampleDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        bucket: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
        batch_tokens: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.bucket = bucket
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.batch_tokens = batch_tokens
        self.epoch = 0
        self._lengths: np.ndarray
        self._sizes: np.ndarray | None
        self._token_plan: tuple[int, list[list[int]]] | None = None  # (epoch, its plan)
        self._measure()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (every rank must pass the same value); a dataset with
        per-epoch draws draws for (``seed``, ``epoch``) too, and one whose examples change
        with the epoch (stream segments) is measured again."""
        self.epoch = epoch
        if isinstance(self.dataset, ExampleDataset):
            self.dataset.set_epoch(epoch, self.seed)
            if self.dataset.by_epoch:
                self._measure()

    def _measure(self) -> None:
        """The dataset's lengths and sizes, as the batch plans read them."""
        dataset = self.dataset
        self._lengths = dataset.lengths() if self.bucket else np.zeros(len(dataset), np.int64)
        self._sizes = dataset.token_counts() if self.batch_tokens is not None else None
        self._token_plan = None

    def _plan(self) -> list[list[int]]:
        """Every rank's batches of the current epoch."""
        order = {"shuffle": self.shuffle, "seed": self.seed, "epoch": self.epoch,
                 "world_size": self.world_size}  # fmt: skip
        if self._sizes is not None:
            assert self.batch_tokens is not None
            if self._token_plan is None or self._token_plan[0] != self.epoch:
                plan = plan_token_batches(self._sizes, self.batch_tokens, **order)
                self._token_plan = (self.epoch, plan)
            return self._token_plan[1]
        return plan_batches(
            self._lengths, self.batch_size, bucket=self.bucket, drop_last=self.drop_last, **order
        )

    def batches(self) -> list[list[int]]:
        """This rank's batches of the current epoch, as example indices."""
        return self._plan()[self.rank :: self.world_size]

    def collate(self, examples: Sequence[Example]) -> Batch:
        """``examples`` as one padded batch."""
        return self.dataset.collate(examples)

    def __len__(self) -> int:
        if self._sizes is not None:  # the count varies with the epoch's draw of lengths
            return len(self._plan()) // self.world_size
        n = len(self.dataset)
        full, partial = divmod(n, self.batch_size)
        if self.drop_last:
            return full // self.world_size
        return math.ceil((full + (partial > 0)) / self.world_size)

    def __iter__(self) -> Iterator[Batch]:
        plan = self.batches()
        if self.num_workers > 0:
            loader = DataLoader(
                self.dataset,
                batch_sampler=plan,
                collate_fn=self.collate,
                num_workers=self.num_workers,
            )
            yield from loader
            return
        for indices in plan:
            yield self.collate([self.dataset[i] for i in indices])
