"""What one training step needs besides the loop: batches moved to the device ahead of
use, the module DDP wraps (compiled or not), the window of train metrics between two
logged steps, and the check that a step never waits for the device."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from pipeline.config.train import CompileMode
from pipeline.data.batch import Batch
from pipeline.eval.perplexity import perplexity_of
from pipeline.models.base import LossOutput
from pipeline.names import Task


def to_device(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """``batches`` moved to ``device``, in order.

    On CUDA the copy runs one batch ahead: batch k+1 is collated, pinned and its
    ``non_blocking`` copy queued before batch k is handed out, so the host prepares the next
    batch while the device is still busy with the step before. The copy goes on the current
    stream, so the kernels that later read the batch wait for it. At most one batch past the
    last one handed out is pulled from ``batches``. On other devices each batch is moved
    when it is handed out.
    """
    if device.type != "cuda":
        for batch in batches:
            yield batch.to(device)
        return
    ahead: Batch | None = None
    for batch in batches:
        moved = batch.pin_memory().to(device, non_blocking=True)
        if ahead is not None:
            yield ahead
        ahead = moved
    if ahead is not None:
        yield ahead


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


# --------------------------------------------------------------------------- compile

PAD_MULTIPLE = 8  # token lengths of a compiled step's batches: fewer shapes to compile for


def compiles(mode: CompileMode, device: torch.device, model: nn.Module) -> bool:
    """Whether the loop compiles ``model``'s training step: ``on``, or ``auto`` on CUDA
    for a model whose class does not say it breaks the graph (``supports_compile``, True
    unless a model class sets it; recurrent models do). On CPU compiling measured 0.74x."""
    if mode == CompileMode.ON:
        return True
    return (
        mode == CompileMode.AUTO
        and device.type == "cuda"
        and bool(getattr(model, "supports_compile", True))
    )


def compile_loss(module: LossModule, backend: str = "inductor") -> None:
    """``module`` compiled in place (``nn.Module.compile``: its ``state_dict`` and the
    wrapped model stay as they are, so checkpoints and validation see the plain model),
    with dynamic shapes, so that batches of other lengths do not compile again. Compile
    before DDP wraps it (the PyTorch docs: compile does not trace DDP's wrapper well)."""
    module.compile(dynamic=True, backend=backend)


@contextlib.contextmanager
def host_sync_check(mode: str | None, device: torch.device) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` (``"warn"`` or ``"error"``) for the block
    on CUDA, the previous mode back after it: every host synchronisation inside warns or
    raises. Nothing on other devices or with ``mode`` None."""
    if mode is None or device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
