"""Tiny models and in-memory data for the training tests (importable by Ray workers)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from pydantic import Field
from torch import nn

from pipeline.config import RunParams
from pipeline.data.batch import GenerateBatch
from pipeline.execution import Evaluation
from pipeline.models.base import LossOutput, ModelConfig, select_batch_dim, token_loss
from pipeline.names import Task
from pipeline.train.checkpoint import Progress, TrainingState
from pipeline.train.optim import make_optimizer, make_scheduler
from pipeline.train.seed import rng_state
from tests.batches import random_generate_batch

VOCAB = 40


class ToyConfig(ModelConfig):
    d_model: int = Field(8, ge=1)
    dropout: float = 0.0


class ToyModel(nn.Module):
    """Bag-of-words history + previous target token -> next target token. Padding-invariant
    (masked mean), with optional dropout so RNG state matters."""

    task = Task.GENERATE

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.mix = nn.Linear(2 * config.d_model, config.d_model)
        self.out = nn.Linear(config.d_model, config.vocab_size)
        self.drop = nn.Dropout(config.dropout)

    def loss(self, batch: GenerateBatch) -> LossOutput:
        h = batch.history
        mask = h.input_mask.unsqueeze(-1).float()
        context = (self.embed(h.input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        prev = self.embed(batch.target_ids[:, :-1])
        x = torch.cat([prev, context.unsqueeze(1).expand_as(prev)], dim=-1)
        logits = self.out(self.drop(torch.tanh(self.mix(x))))
        return token_loss(logits, batch.target_ids[:, 1:], batch.target_mask[:, 1:])


@dataclass(frozen=True)
class ToyFactory:
    d_model: int = 8
    dropout: float = 0.0

    def __call__(self) -> nn.Module:
        return ToyModel(ToyConfig(vocab_size=VOCAB, d_model=self.d_model, dropout=self.dropout))


class PoolData:
    """Batches of a fixed random example pool; global batch ``b`` of an epoch is split
    across ranks in order, so W ranks together see exactly what one rank sees alone."""

    def __init__(
        self,
        pool: GenerateBatch,
        global_batch: int,
        rank: int,
        world: int,
        seed: int,
        shuffle: bool,
    ) -> None:
        self.pool, self.global_batch, self.rank, self.world = pool, global_batch, rank, world
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0
        self.served: list[int] = []  # batches handed out (tests check skipping)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> np.ndarray:
        n = self.pool.batch_size
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(n)

    def __len__(self) -> int:
        return self.pool.batch_size // self.global_batch

    def iter_from(self, start: int) -> Iterator[GenerateBatch]:
        order = self._order()
        local = self.global_batch // self.world
        for b in range(start, len(self)):
            idx = order[b * self.global_batch :][self.rank * local : (self.rank + 1) * local]
            self.served.append(b)
            yield select_batch_dim(self.pool, torch.as_tensor(idx))  # type: ignore[return-value]


@dataclass(frozen=True)
class PoolFactory:
    n_train: int = 32
    n_valid: int = 8
    global_batch: int = 4
    seed: int = 0
    valid_from_train: bool = False  # memorisable: validation loss falls as training goes
    eval_batch: int | None = None  # global validation batch (default: global_batch)

    def __call__(self, rank: int, world: int) -> tuple[PoolData, PoolData]:
        train = random_generate_batch(self.n_train, VOCAB, seed=11)
        valid = self.valid(rank, world, self.eval_batch or self.global_batch)
        return PoolData(train, self.global_batch, rank, world, self.seed, shuffle=True), valid

    def valid(self, rank: int, world: int, batch_size: int) -> PoolData:
        valid = random_generate_batch(self.n_valid, VOCAB, seed=11 if self.valid_from_train else 12)
        return PoolData(valid, min(batch_size, self.n_valid), rank, world, self.seed, False)


@dataclass(frozen=True)
class ParameterCountScore:
    """A ``loop.ValidationScore`` that scores a model by its number of parameters: trials
    of different sizes score differently, so a search's direction shows."""

    def decode(self, model: nn.Module, rank: int, world_size: int, evaluation: Evaluation):
        return [sum(p.numel() for p in model.parameters())]

    def score(self, outputs: list[int]) -> dict[str, float]:
        return {"valid_score": float(sum(outputs))}


class Diverging(ToyModel):
    """The toy model whose training goes non-finite from its step ``at`` on: its loss
    (``what="loss"``) or a weight the loss does not use (``what="weight"``)."""

    def __init__(self, at: int, what: str) -> None:
        super().__init__(ToyConfig(vocab_size=VOCAB, d_model=8))
        self.at, self.what, self.step = at, what, 0
        self.spare = nn.Parameter(torch.zeros(2))

    def on_train_step(self, step: int, epoch: int) -> None:
        self.step = step + 1  # the step about to be taken
        if self.what == "weight" and self.step >= self.at:
            with torch.no_grad():
                self.spare.fill_(math.inf)

    def loss(self, batch: GenerateBatch) -> LossOutput:
        out = super().loss(batch)
        if self.training and self.what == "loss" and self.step >= self.at:
            out = replace(out, loss=out.loss * math.nan)
        return out


@dataclass(frozen=True)
class DivergingFactory:
    at: int
    what: str

    def __call__(self) -> nn.Module:
        return Diverging(self.at, self.what)


def toy_state(progress: Progress | None = None, seed: int = 7) -> TrainingState:
    """A checkpoint of the toy model as the loop writes one: real optimizer and scheduler
    state (one step taken), this process's RNG state, best weights apart from the last."""
    model = ToyFactory()()
    params = RunParams()
    optimizer = make_optimizer(model, params.optimizer)
    scheduler = make_scheduler(optimizer, params.schedule)
    best = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = random_generate_batch(4, VOCAB, seed=1)
    model.loss(batch).loss.backward()
    optimizer.step()
    scheduler.step()
    return TrainingState(
        model_name="toy",
        model_config=model.config.model_dump(mode="json"),
        task=Task.GENERATE.value,
        model=model.state_dict(),
        best_model=best,
        optimizer=optimizer.state_dict(),
        scheduler=scheduler.state_dict(),
        progress=(progress or Progress(step=1)).to_dict(),
        rng=[rng_state()],
        metrics={"valid_loss": 3.5},
        seed=seed,
        average=None,
        average_count=0,
    )
