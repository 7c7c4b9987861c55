"""Attention masks given by a predicate, for FlexAttention's block-sparse kernel.

A *mask mod* ``mod(b, h, q, k) -> bool`` says whether query ``q`` of batch row ``b`` may
attend key ``k`` (the hiertx convention: True = may attend; the head ``h`` is unused).
:class:`FlexMask` carries one per batch with what the kernel needs:

- its ``BlockMask`` (``torch.nn.attention.flex_attention.create_block_mask``): the kernel
  skips every 128 x 128 tile the predicate forbids entirely, so the hierarchical masks of
  the HT-Encoder cost about the pairs they allow instead of ``B * L**2``;
- where FlexAttention has no kernel for the pass, the same predicate evaluated densely
  (:func:`evaluate`), for ``scaled_dot_product_attention``. FlexAttention has no backward
  on a CPU, so a CPU pass that needs gradients takes this path, and the block mask is
  built only on CUDA or without gradients (:func:`flex_mask`).

A query row that may attend no key gives zeros on both paths (``layers.attend``'s
convention). FlexAttention has no dropout on the attention probabilities: ``layers.attend``
runs a :class:`FlexMask` through the kernel only at dropout 0 and through the dense mask
otherwise (``hier.AttentionLayout`` states the rule a config sees).

On eager CUDA (outside a compiled graph) the kernel runs compiled by the backend the
execution policy chooses (:func:`compiled_with`, ``ExecutionPolicy.flex_backend``: the
run's ``compile_backend``, or eager ``flex_attention``, which materialises the scores,
under ``compile: off``); where no policy chose, Inductor.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from pipeline.models.base import on_gpu

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
DEFAULT_BACKEND = "inductor"

# The torch.compile backend of the kernel on eager CUDA (None: eager flex_attention).
_BACKEND: ContextVar[str | None] = ContextVar("flex_backend", default=DEFAULT_BACKEND)


@contextlib.contextmanager
def compiled_with(backend: str | None) -> Iterator[None]:
    """Inside the block the kernel runs on eager CUDA compiled by ``backend`` (None:
    eager ``flex_attention``); the setting before it after."""
    token = _BACKEND.set(backend)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def kernel() -> Callable[..., Tensor]:
    """The FlexAttention an eager CUDA pass calls: compiled by the backend in effect
    (:func:`compiled_with`), or ``flex_attention`` itself."""
    backend = _BACKEND.get()
    return flex_attention if backend is None else _compiled_flex(backend)  # type: ignore[return-value]


def evaluate(
    mod: MaskMod, batch: int, length_q: int, length_k: int, device: torch.device
) -> Tensor:
    """``[batch, length_q, length_k]`` bool: ``mod`` at every (row, query, key), by
    broadcasting index tensors (a mask mod uses elementwise ops and indexing only)."""
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(length_q, device=device)[None, :, None]
    k = torch.arange(length_k, device=device)[None, None, :]
    head = torch.zeros((), dtype=torch.long, device=device)
    return mod(b, head, q, k).expand(batch, length_q, length_k)


@dataclass(frozen=True)
class FlexMask:
    """One batch's attention mask as its predicate ``mod`` over ``size`` (batch, queries,
    keys), with its FlexAttention ``block`` mask where the kernel will run (else None)."""

    mod: MaskMod
    size: tuple[int, int, int]
    device: torch.device
    block: BlockMask | None = None

    def dense(self) -> Tensor:
        """``[B, 1, Lq, Lk]`` bool, broadcastable over heads."""
        return evaluate(self.mod, *self.size, self.device).unsqueeze(1)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """FlexAttention of ``q`` ``[B, H, Lq, d]`` over ``k``/``v`` under this mask."""
        if self.block is None:
            raise ValueError("this FlexMask has no block mask: attend through dense()")
        if torch.compiler.is_compiling() or not on_gpu(q):
            return flex_attention(q, k, v, block_mask=self.block)  # type: ignore[return-value]
        # Eager CUDA: flex_attention alone materialises the scores; its compiled kernel does
        # not, and dynamic shapes spare a compilation per history length.
        return kernel()(q, k, v, block_mask=self.block)


@functools.cache
def _compiled_flex(backend: str) -> Callable[..., Tensor]:
    return torch.compile(flex_attention, dynamic=True, backend=backend)


def flex_mask(
    mod: MaskMod, batch: int, length_q: int, length_k: int, device: torch.device
) -> FlexMask:
    """``mod`` as a :class:`FlexMask`; the block mask is built where the kernel can run the
    pass (CUDA, or without gradients: FlexAttention has no CPU backward)."""
    runs = on_gpu(device) or not torch.is_grad_enabled()
    block = create_block_mask(mod, batch, None, length_q, length_k, device) if runs else None
    return FlexMask(mod, (batch, length_q, length_k), device, block)
