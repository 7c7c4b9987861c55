"""What one training step needs besides the loop and its execution policy: the module DDP
wraps (compiled or not) and the window of train metrics between two logged steps."""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor, nn

from pipeline.data.batch import Batch
from pipeline.eval.perplexity import perplexity_of
from pipeline.models.base import LossOutput
from pipeline.names import Task


class LossModule(nn.Module):
    """``forward(batch) = model.loss(batch)``: DDP synchronises gradients of what runs
    through ``forward``, and models expose ``loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, batch: Batch) -> LossOutput:
        return self.inner.loss(batch)


class TrainWindow:
    """Train metrics accumulated between two logged steps.

    The sums stay on the device (one float64 vector, detached, the same size whatever the
    window's length) so that a step never waits for the device; :meth:`flush` reads them
    back once per logged step. float64 sums of the per-step values give exactly the numbers
    that summing them as Python floats gave.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: Tensor | None = None  # loss, nll_sum, n_tokens, then out.terms' values
        self.names: tuple[str, ...] = ()  # the keys of out.terms, in the order of self.sums
        self.steps = self.examples = 0
        self.grad_norm: Tensor | None = None  # the last step's; None = no clipping
        self.lr = math.nan
        self.start = time.perf_counter()

    def add(self, out: LossOutput, grad_norm: Tensor | None, lr: float, examples: int) -> None:
        values = torch.stack(
            [
                v.detach().double()
                for v in (out.loss, out.nll_sum, out.n_tokens, *out.terms.values())
            ]
        )
        names = tuple(out.terms)
        if self.sums is None:
            self.sums, self.names = values, names
        elif names != self.names:
            raise ValueError(f"loss terms changed within a log window: {self.names} -> {names}")
        else:
            self.sums += values
        self.steps += 1
        self.examples += examples
        self.grad_norm = None if grad_norm is None else grad_norm.detach()
        self.lr = lr

    def flush(self, task: Task) -> dict[str, float]:
        assert self.sums is not None, "flush() follows at least one add()"
        # Read the device before the clock, so the time covers the steps still queued on it.
        loss, nll_sum, tokens, *terms = self.sums.tolist()
        grad_norm = None if self.grad_norm is None else float(self.grad_norm)
        seconds = max(time.perf_counter() - self.start, 1e-9)
        nll = nll_sum / max(tokens, 1.0)
        out = {
            "train_loss": loss / self.steps,
            "train_nll": nll,
            "lr": self.lr,
            "examples_per_s": self.examples / seconds,
            "tokens_per_s": tokens / seconds,
        }
        if task != Task.SELECT:
            out["train_ppl"] = perplexity_of(nll)
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        out.update({f"train_{k}": v / self.steps for k, v in zip(self.names, terms, strict=True)})
        self.reset()
        return out
