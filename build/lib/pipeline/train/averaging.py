"""Parameter averaging over the last epochs of a run (``RunParams.averaging``).

From epoch ``train.epochs - averaging.epochs`` on, the loop keeps an average of the
weights after every optimizer step, as the Transformer-XL PTB recipe does
(ischlag/Fast-Weight-Memory-public, ``language-modelling/transformer_xl_ptb/train.py``):
averaging starts from a copy of the weights; the n-th step after it moves the average
towards the weights by ``1 / n`` (``uniform``: the mean of the weights after each step,
the recipe's ``--mu -1``) or by ``1 - ema_decay`` (``ema``: its ``--mu``). The averaged
weights are swapped into the model for validation (:meth:`WeightAverage.applied`), so they
are what the run evaluates, keeps and exports; the live weights go on training.

A checkpoint holds the average as a ``state_dict`` of the model with the averaged weights
in place (ready to export) and the step count, so a resumed run averages on exactly as the
uninterrupted run did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from pipeline.config.train import AveragingKind, AveragingParams
from pipeline.train.checkpoint import cpu_state


class WeightAverage:
    """The average of ``model``'s parameters over the steps since averaging began."""

    def __init__(self, params: AveragingParams, epochs: int, model: nn.Module) -> None:
        self.params = params
        self.start_epoch = epochs - params.epochs
        self.names = [name for name, _ in model.named_parameters()]
        self.weights = [p for _, p in model.named_parameters()]
        self.average: list[Tensor] | None = None  # None: averaging has not begun
        self.count = 0  # steps averaged

    @property
    def enabled(self) -> bool:
        return self.params.kind != AveragingKind.NONE

    @property
    def active(self) -> bool:
        return self.average is not None

    def due(self, epoch: int) -> bool:
        """Whether averaging begins at the start of ``epoch`` (it has not yet)."""
        return self.enabled and not self.active and epoch >= self.start_epoch

    @torch.no_grad()
    def begin(self) -> None:
        """Start from a copy of the current weights (weight 0 once a step is averaged)."""
        self.average = [p.detach().clone() for p in self.weights]
        self.count = 0

    @torch.no_grad()
    def update(self) -> None:
        """Fold in the weights after one more optimizer step (queued on the device: no
        host sync)."""
        assert self.average is not None, "update() after begin()"
        self.count += 1
        if self.params.kind == AveragingKind.UNIFORM:
            weight = 1.0 / self.count
        else:
            weight = 1.0 - self.params.ema_decay
        torch._foreach_lerp_(self.average, [p.detach() for p in self.weights], weight)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model for the block (nothing changes before
        averaging begins); the live weights back, bit for bit, after it."""
        if self.average is None:
            yield
            return
        with torch.no_grad():
            live = [p.detach().clone() for p in self.weights]
            for p, a in zip(self.weights, self.average, strict=True):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(self.weights, live, strict=True):
                    p.copy_(w)

    def state(self, model: nn.Module) -> dict[str, Tensor] | None:
        """The averaged model's ``state_dict`` on the CPU (a checkpoint's), or None."""
        if self.average is None:
            return None
        with self.applied():
            return cpu_state(model.state_dict())

    def load(self, state: dict[str, Tensor] | None, count: int) -> None:
        """Resume from a checkpoint's :meth:`state` and step count."""
        if state is None:
            self.average, self.count = None, 0
            return
        self.average = [
            state[name].to(p.device, p.dtype, copy=True)
            for name, p in zip(self.names, self.weights, strict=True)
        ]
        self.count = count
