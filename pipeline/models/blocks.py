"""The Transformer's layers and stacks, built from the shared blocks of ``layers``: the
post-norm encoder layer (a GPT block with ``causal=True``), the encoder stack, and the
decoder (self-attention with a KV cache, cross-attention, FFN) every generate model of the
Transformer family decodes with. Conventions (masks, initialisation): ``layers``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from pipeline.models.base import BlockDims, select_batch_dim
from pipeline.models.dropout import SiteDropout
from pipeline.models.flex import FlexMask
from pipeline.models.layers import (
    FeedForward,
    KVCache,
    MultiHeadAttention,
    SinusoidalPositions,
    TokenEmbedding,
    TokenGroups,
    padding_mask,
)


class EncoderLayer(nn.Module):
    """Post-norm Transformer layer: self-attention then FFN, each residual + LayerNorm.

    With ``causal=True`` in ``forward`` it is a decoder-only (GPT) block. ``dropout`` applies
    to the residual branches and the FFN; ``attention_dropout`` to the attention
    probabilities (``None``: the same as ``dropout``); a language model's recipe sets the
    attention branch's and the FFN's on their own, locked or not (``BlockDims``).
    """

    def __init__(self, dims: BlockDims) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(
            dims.d_model,
            dims.n_heads,
            dims.d_head,
            dropout=dims.attention_dropout_p,
            congruent=dims.congruent,
            qkv_dropout=SiteDropout(dims.qkv_dropout, dims.locked) if dims.qkv_dropout else None,
            output_gain=dims.residual_gain,
        )
        self.ffn = FeedForward(
            dims.d_model, dims.d_ff, dims.ffn_p, locked=dims.locked, output_gain=dims.residual_gain
        )
        self.norm_attn = nn.LayerNorm(dims.d_model)
        self.norm_ffn = nn.LayerNorm(dims.d_model)
        self.attn_dropout = SiteDropout(dims.attention_output_p, dims.locked)
        self.ffn_dropout = SiteDropout(dims.ffn_p, dims.locked)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | FlexMask | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        groups: TokenGroups | Sequence[TokenGroups] | None = None,
    ) -> Tensor:
        """``x`` ``[B, L, d]``, or ``[n, d]`` tokens attending as ``groups`` say."""
        h = self.attn(x, mask=mask, causal=causal, cache=cache, groups=groups)
        x = self.norm_attn(x + self.attn_dropout(h))
        return self.norm_ffn(x + self.ffn_dropout(self.ffn(x)))


class EncoderStack(nn.ModuleList):
    """``n_layers`` post-norm :class:`EncoderLayer` s of one block size: THE encoder stack of
    every Transformer-family model (the flat encoder, the HT-Encoder's utterance and context
    stages, the rankers' sequence encoder, the LM stacks). Callers add positions and
    dropout; ``forward`` runs the layers under one mask, or causally, zeroing padding
    between layers where ``keep`` ``[B, L, 1]`` says. A ``ModuleList``, so state-dict keys
    are ``<name>.<i>.*`` as for a plain list of layers."""

    def __init__(self, n_layers: int, dims: BlockDims) -> None:
        super().__init__(EncoderLayer(dims) for _ in range(n_layers))

    def forward(
        self,
        x: Tensor,
        mask: Tensor | FlexMask | None = None,
        causal: bool = False,
        keep: Tensor | None = None,
    ) -> Tensor:
        for layer in self:
            x = layer(x, mask=mask, causal=causal)
            if keep is not None:
                x = x * keep
        return x


class DecoderLayer(nn.Module):
    """Post-norm decoder layer: causal self-attention, cross-attention, FFN (dropouts as
    in ``EncoderLayer``)."""

    def __init__(self, dims: BlockDims, d_memory: int | None = None) -> None:
        super().__init__()
        d, p_attn, gain = dims.d_model, dims.attention_dropout_p, dims.residual_gain
        self.self_attn = MultiHeadAttention(
            d, dims.n_heads, dims.d_head, dropout=p_attn, output_gain=gain
        )
        self.cross_attn = MultiHeadAttention(
            d, dims.n_heads, dims.d_head, d_kv=d_memory, dropout=p_attn, output_gain=gain
        )
        self.ffn = FeedForward(d, dims.d_ff, dims.dropout, output_gain=gain)
        self.norm_self = nn.LayerNorm(d)
        self.norm_cross = nn.LayerNorm(d)
        self.norm_ffn = nn.LayerNorm(d)
        self.dropout = nn.Dropout(dims.dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_mask: Tensor | None,
        cache: DecoderLayerCache | None = None,
    ) -> Tensor:
        self_cache = cache.self_attn if cache is not None else None
        cross_cache = cache.cross_attn if cache is not None else None
        h = self.self_attn(x, causal=True, cache=self_cache)
        x = self.norm_self(x + self.dropout(h))
        h = self.cross_attn(x, memory, mask=memory_mask, cache=cross_cache)
        x = self.norm_cross(x + self.dropout(h))
        return self.norm_ffn(x + self.dropout(self.ffn(x)))


@dataclass
class DecoderLayerCache:
    self_attn: KVCache = field(default_factory=KVCache)
    cross_attn: KVCache = field(default_factory=lambda: KVCache(static=True))


@dataclass
class DecoderCache:
    """Incremental-decoding state of a ``Decoder``: per-layer KV caches and the position
    of the next token."""

    layers: list[DecoderLayerCache]
    position: int = 0

    def select(self, index: Tensor) -> DecoderCache:
        return select_batch_dim(self, index)  # type: ignore[return-value]


class Decoder(nn.Module):
    """Token embedding + sinusoidal positions + ``n_layers`` decoder layers + output
    projection, tied to the embedding unless ``tie_output`` is False (the U-Net authors'
    code projects with its own matrix).

    ``memory`` is one tensor ``[B, Lm, d_memory]`` shared by all layers, or a list with
    one memory per layer (U-Net's per-layer attention); ``memory_mask`` likewise
    (``[B, Lm]`` real-key masks or full attention masks).
    """

    def __init__(
        self,
        vocab_size: int,
        n_layers: int,
        dims: BlockDims,
        d_memory: int | list[int] | None = None,
        pad_id: int = 0,
        tie_output: bool = True,
    ) -> None:
        super().__init__()
        d_memories = d_memory if isinstance(d_memory, list) else [d_memory] * n_layers
        self.embed = TokenEmbedding(vocab_size, dims.d_model, pad_id)
        self.positions = SinusoidalPositions(dims.d_model)
        self.layers = nn.ModuleList(DecoderLayer(dims, d_memories[i]) for i in range(n_layers))
        self.dropout = nn.Dropout(dims.dropout)
        self.output = nn.Linear(dims.d_model, vocab_size, bias=False)
        if tie_output:
            self.output.weight = self.embed.weight

    def init_cache(self) -> DecoderCache:
        return DecoderCache([DecoderLayerCache() for _ in self.layers])

    def forward(
        self,
        tokens: Tensor,
        memory: Tensor | list[Tensor],
        memory_mask: Tensor | list[Tensor] | None,
        cache: DecoderCache | None = None,
        input_offset: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[B, t, V]``. ``input_offset`` ``[B, t, d]`` is added to the input
        embeddings (HIER++'s dialogue-act embedding)."""
        start = cache.position if cache is not None else 0
        x = (
            self.embed(tokens)
            + self.positions.range(start + tokens.shape[1], tokens.device)[start:]
        )
        if input_offset is not None:
            x = x + input_offset
        x = self.dropout(x)
        n = len(self.layers)
        memories = memory if isinstance(memory, list) else [memory] * n
        masks = memory_mask if isinstance(memory_mask, list) else [memory_mask] * n
        for i, layer in enumerate(self.layers):
            mask = masks[i]
            if mask is not None and mask.dim() == 2:
                mask = padding_mask(mask)
            x = layer(x, memories[i], mask, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.position = start + tokens.shape[1]
        return self.output(x)
