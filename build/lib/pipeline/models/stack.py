"""The Transformer stack of the language models: sinusoidal positions, dropout, then
post-norm ``EncoderLayer``s, causal (GPT) or bidirectional (a sentence encoder); the two
helpers they share to trim padding away (``extent``, ``scatter_rows``), and the switch to
padded, static shapes where trimming costs more than it saves (``static_shapes``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipeline.models.base import BlockDims, on_gpu
from pipeline.models.blocks import EncoderStack
from pipeline.models.dropout import SiteDropout
from pipeline.models.layers import SinusoidalPositions, padding_mask


class Stack(nn.Module):
    """Sinusoidal positions, dropout (``dims.input_p``, locked or not), then ``n_layers``
    post-norm Transformer layers.

    ``causal=True`` makes it a GPT block (position i sees positions <= i); otherwise it is
    a bidirectional (BERT-like) encoder over the real positions of ``mask``.
    """

    def __init__(self, dims: BlockDims, n_layers: int, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.positions = SinusoidalPositions(dims.d_model)
        self.dropout = SiteDropout(dims.input_p, dims.locked)
        self.layers = EncoderStack(n_layers, dims)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """``x`` ``[B, L, d]`` input embeddings; ``mask`` ``[B, L]`` True = real position.

        A causal stack needs no mask for right-padded input: real positions never see the
        padding after them.
        """
        x = self.dropout(x + self.positions.range(x.shape[1], x.device))
        attn_mask = None if mask is None else padding_mask(mask)
        return self.layers(x, attn_mask, causal=self.causal)


def static_shapes(like: Tensor) -> bool:
    """Whether a model keeps its batch's padded shapes, masking instead of trimming
    (``extent``) and instead of boolean indexing: under ``torch.compile``, where shapes read
    from data break the graph, and on accelerators, where reading a tensor on the host
    stalls the stream (``base.on_gpu``). The eager CPU path trims, bit for bit as it
    always has."""
    return torch.compiler.is_compiling() or on_gpu(like)


def extent(mask: Tensor) -> int:
    """Length of the last dimension up to and including its last True anywhere (0 if none).

    Models trim batches to it, so extra padding cannot change any computation.
    """
    columns = mask.reshape(-1, mask.shape[-1]).any(0).nonzero()
    return int(columns[-1]) + 1 if len(columns) else 0


def scatter_rows(mask: Tensor, values: Tensor) -> Tensor:
    """Place ``values`` ``[N, ...]`` at the ``N`` True entries of ``mask`` (row-major order),
    zeros elsewhere; differentiable."""
    out = values.new_zeros(*mask.shape, *values.shape[1:])
    out[mask] = values
    return out


def flat_to_sentences(values: Tensor, sentence_mask: Tensor) -> Tensor:
    """``values`` ``[B, Lf]`` of a row's real tokens in order (then anything) placed in the
    sentence layout of ``sentence_mask`` ``[B, S, Ls]``, zeros elsewhere: what
    ``scatter_rows(sentence_mask, values[flat_mask])`` gives, with static shapes (a
    gather of each slot's flat position)."""
    real = sentence_mask.reshape(values.shape[0], -1)
    position = (real.cumsum(1) - 1).clamp(min=0, max=values.shape[1] - 1)
    return values.gather(1, position).masked_fill(~real, 0).view(sentence_mask.shape)
