"""Shared Transformer building blocks, written once and used by every model.

Mask convention (everywhere in hiertx): a boolean tensor, **True = may attend**,
broadcastable to ``[B, heads, L_query, L_key]`` (``[B, L_query, L_key]`` is accepted).
A query row with no allowed key (a padding query) yields a zero output instead of the NaN
that a fully masked softmax produces.

Initialisation follows the U-Net Transformer paper: Xavier everywhere, Kaiming for the
linear before the FFN's ReLU, and Xavier scaled by 1/100 on the attention and FFN output
projections (so each residual block starts close to the identity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pipeline.models.base import select_batch_dim

OUTPUT_GAIN = 0.01


def xavier_(linear: nn.Linear, gain: float = 1.0) -> nn.Linear:
    nn.init.xavier_uniform_(linear.weight, gain=gain)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
    return linear


# --------------------------------------------------------------------------- masks


def padding_mask(key_mask: Tensor) -> Tensor:
    """``[B, Lk]`` real-token mask -> ``[B, 1, 1, Lk]`` attention mask."""
    return key_mask[:, None, None, :]


def causal_mask(length_q: int, length_k: int, device: torch.device | None = None) -> Tensor:
    """``[Lq, Lk]``: query i (the last ``Lq`` of ``Lk`` positions) sees keys ``<= i``."""
    offset = length_k - length_q
    q = torch.arange(length_q, device=device)[:, None] + offset
    k = torch.arange(length_k, device=device)[None, :]
    return k <= q


# --------------------------------------------------------------------------- attention


@dataclass
class KVCache:
    """Projected keys/values ``[B, H, t, d]`` kept between decoding steps.

    A ``static`` cache (cross-attention over a fixed memory) is filled once; a growing one
    (self-attention) appends each step's keys/values.
    """

    static: bool = False
    k: Tensor | None = None
    v: Tensor | None = None

    def select(self, index: Tensor) -> KVCache:
        return select_batch_dim(self, index)  # type: ignore[return-value]

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])


@dataclass(frozen=True)
class TokenGrid:
    """Where the tokens of a flat list sit on a ``[groups, width]`` grid: token ``i`` in flat
    slot ``slots[i]``; ``mask`` marks the filled slots."""

    slots: Tensor
    mask: Tensor

    def scatter(self, tokens: Tensor) -> Tensor:
        """``[n, f]`` -> ``[groups, width, f]``, zero in empty slots."""
        groups, width = self.mask.shape
        grid = tokens.new_zeros(groups * width, tokens.shape[-1])
        # In place on a fresh tensor: the out-of-place op would copy the whole grid once more.
        return grid.index_copy_(0, self.slots, tokens).view(groups, width, tokens.shape[-1])

    def gather(self, grid: Tensor) -> Tensor:
        """``[groups, width, f]`` -> ``[n, f]``: the filled slots, in token order."""
        return grid.reshape(-1, grid.shape[-1])[self.slots]

    @cached_property
    def key_mask(self) -> Tensor:
        """``[groups, 1, 1, width]`` attention mask over this grid as keys. A group with no
        token lets its (query-free) slots see its empty first slot, whose zero key and value
        give a zero output: no row is fully masked, so attention needs no NaN fix-up."""
        empty = ~self.mask.any(-1)
        return padding_mask(self.mask | F.pad(empty[:, None], (0, self.mask.shape[1] - 1)))


@dataclass(frozen=True)
class TokenGroups:
    """Block-sparse attention over a flat, unpadded token list, as dense attention on grids.

    The tokens ``queries`` (indices into the list; ``None``: all, in order) sit on the
    ``query_grid``, the tokens ``keys`` on the ``key_grid``; group ``g`` of the queries
    attends to the filled slots of group ``g`` of the keys. Position-wise work (projections,
    FFN, norms) runs on the real tokens alone, and attention costs the grids' size instead
    of the ``B * L**2`` of a ``[B, L, L]`` mask over the padded batch. A layer may take
    several ``TokenGroups`` whose queries partition the list (``MultiHeadAttention``).
    Built per batch, e.g. by ``utterances.utterance_groups``.
    """

    query_grid: TokenGrid
    key_grid: TokenGrid
    queries: Tensor | None = None
    keys: Tensor | None = None

    @classmethod
    def within(cls, grid: TokenGrid) -> TokenGroups:
        """Every token of the list attends to the tokens of its own group."""
        return cls(grid, grid)


class MultiHeadAttention(nn.Module):
    """Multi-head attention on ``F.scaled_dot_product_attention``.

    ``d_query`` is the width of the queries' input (and of the output unless ``d_out``
    is given), ``d_kv`` the width of keys/values' input (U-Net queries come from the
    convolved sequence, keys/values from the layer input). ``d_head`` defaults to
    ``d_query // n_heads`` but need not divide it. ``congruent=True`` shares one projection
    for queries and keys (W_q = W_k, Hierarchical GPT paper).
    """

    def __init__(
        self,
        d_query: int,
        n_heads: int,
        d_head: int | None = None,
        d_kv: int | None = None,
        d_out: int | None = None,
        dropout: float = 0.0,
        congruent: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        d_kv = d_query if d_kv is None else d_kv
        d_out = d_query if d_out is None else d_out
        if d_head is None:
            if d_query % n_heads:
                raise ValueError(f"d_model={d_query} is not divisible by n_heads={n_heads}")
            d_head = d_query // n_heads
        if congruent and d_kv != d_query:
            raise ValueError("congruent attention needs queries and keys of the same width")
        self.n_heads, self.d_head, self.dropout, self.congruent = (
            n_heads,
            d_head,
            dropout,
            congruent,
        )
        inner = n_heads * d_head
        self.q_proj = xavier_(nn.Linear(d_query, inner, bias=bias))
        self.k_proj = self.q_proj if congruent else xavier_(nn.Linear(d_kv, inner, bias=bias))
        self.v_proj = xavier_(nn.Linear(d_kv, inner, bias=bias))
        self.out_proj = xavier_(nn.Linear(inner, d_out, bias=bias), gain=OUTPUT_GAIN)

    def _heads(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.n_heads, self.d_head).transpose(1, 2)

    def forward(
        self,
        query: Tensor,
        key_value: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        groups: TokenGroups | Sequence[TokenGroups] | None = None,
    ) -> Tensor:
        """``query`` ``[B, Lq, d_query]``; ``key_value`` ``[B, Lk, d_kv]`` (None: self-attention).

        With a growing ``cache`` the new keys/values are appended to it and ``causal``
        masks relative to the cached prefix. With ``groups``, ``query`` is a flat ``[n,
        d_query]`` token list attending to itself as the groups say (self-attention only).
        """
        if groups is not None:
            return self._grouped(query, groups)
        kv_input = query if key_value is None else key_value
        q = self._heads(self.q_proj(query))
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            k, v = self._heads(self.k_proj(kv_input)), self._heads(self.v_proj(kv_input))
            if cache is not None:
                if not cache.static and cache.k is not None:
                    k = torch.cat([cache.k, k], dim=2)
                    v = torch.cat([cache.v, v], dim=2)  # type: ignore[list-item]
                cache.k, cache.v = k, v
        out = attend(q, k, v, mask, causal, self.dropout if self.training else 0.0)
        b, _, lq, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, lq, self.n_heads * self.d_head))

    def _grouped(self, tokens: Tensor, groups: TokenGroups | Sequence[TokenGroups]) -> Tensor:
        """Self-attention of ``[n, d]`` tokens by ``groups``: only q/k/v visit the grids.

        The three projections run as one matmul and each grid is filled once for q, k and v
        together (scatters, not the matmuls, dominate at utterance sizes).
        """
        blocks = [groups] if isinstance(groups, TokenGroups) else list(groups)
        inner = self.n_heads * self.d_head
        projections = (self.q_proj, self.k_proj, self.v_proj)
        biases = [proj.bias for proj in projections]
        qkv = F.linear(
            tokens,
            torch.cat([proj.weight for proj in projections]),
            None if biases[0] is None else torch.cat(biases),  # type: ignore[arg-type]
        )
        p = self.dropout if self.training else 0.0
        whole = len(blocks) == 1 and blocks[0].queries is None
        out = None if whole else qkv.new_zeros(qkv.shape[0], inner)
        for block in blocks:
            if block.query_grid is block.key_grid and block.queries is block.keys:
                q, k, v = block.query_grid.scatter(_take(qkv, block.queries)).split(inner, -1)
            else:
                q = block.query_grid.scatter(_take(qkv[:, :inner], block.queries))
                k, v = block.key_grid.scatter(_take(qkv[:, inner:], block.keys)).split(inner, -1)
            q, k, v = self._heads(q), self._heads(k), self._heads(v)
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=block.key_grid.key_mask, dropout_p=p
            )
            attended = block.query_grid.gather(attended.transpose(1, 2).flatten(2))
            out = attended if out is None else out.index_copy_(0, block.queries, attended)
        return self.out_proj(out)


def _take(tokens: Tensor, index: Tensor | None) -> Tensor:
    return tokens if index is None else tokens[index]


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout: float
) -> Tensor:
    """SDPA with the hiertx mask convention; rows with no allowed key give zeros."""
    lq, lk = q.shape[2], k.shape[2]
    if mask is None:
        if causal and lq == lk:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        if causal and lq > 1:
            mask = causal_mask(lq, lk, q.device)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    if causal:
        mask = mask & causal_mask(lq, lk, q.device)
    has_key = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout)
    return out * has_key


# --------------------------------------------------------------------------- FFN, encodings


class FeedForward(nn.Module):
    """Position-wise ``Linear -> ReLU -> dropout -> Linear``."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, d_out: int | None = None):
        super().__init__()
        self.inner = nn.Linear(d_model, d_ff)
        nn.init.kaiming_uniform_(self.inner.weight, nonlinearity="relu")
        nn.init.zeros_(self.inner.bias)
        self.outer = xavier_(nn.Linear(d_ff, d_model if d_out is None else d_out), OUTPUT_GAIN)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(self.dropout(F.relu(self.inner(x))))


class SinusoidalPositions(nn.Module):
    """Sinusoidal encodings of arbitrary integer positions ``[...]`` -> ``[..., d]``.

    Computed on the fly (no maximum length); index with absolute positions for global PE
    or with ``utt_pos`` for the HT-Encoder's local (within-utterance) PE.
    """

    inv_freq: Tensor

    def __init__(self, d_model: int) -> None:
        super().__init__()
        half = (d_model + 1) // 2
        inv_freq = torch.exp(-math.log(10000.0) * torch.arange(half).float() * 2 / d_model)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.d_model = d_model

    def forward(self, positions: Tensor) -> Tensor:
        angles = positions.unsqueeze(-1).float() * self.inv_freq
        enc = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)
        return enc[..., : self.d_model]

    def range(self, length: int, device: torch.device | None = None) -> Tensor:
        """Encodings of positions ``0..length-1``: ``[length, d]``."""
        return self(torch.arange(length, device=device))


class SegmentEmbedding(nn.Embedding):
    """Learned utterance-index embeddings; indices past the table share its last row."""

    def forward(self, utt_index: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(utt_index.clamp(max=self.num_embeddings - 1))


class TokenEmbedding(nn.Embedding):
    """Token embeddings scaled by sqrt(d) (Vaswani et al.), padding row zero."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int = 0) -> None:
        super().__init__(vocab_size, d_model, padding_idx=pad_id)
        nn.init.normal_(self.weight, std=d_model**-0.5)
        with torch.no_grad():
            self.weight[pad_id].zero_()
        self.scale = math.sqrt(d_model)

    def forward(self, ids: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(ids) * self.scale


# --------------------------------------------------------------------------- layers and stacks


class EncoderLayer(nn.Module):
    """Post-norm Transformer layer: self-attention then FFN, each residual + LayerNorm.

    With ``causal=True`` in ``forward`` it is a decoder-only (GPT) block. ``dropout`` applies
    to the residual branches and the FFN; ``attention_dropout`` to the attention
    probabilities (``None``: the same as ``dropout``).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        d_head: int | None = None,
        congruent: bool = False,
        attention_dropout: float | None = None,
    ) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(
            d_model,
            n_heads,
            d_head,
            dropout=dropout if attention_dropout is None else attention_dropout,
            congruent=congruent,
        )
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm_attn = nn.LayerNorm(d_model)
        self.norm_ffn = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        groups: TokenGroups | Sequence[TokenGroups] | None = None,
    ) -> Tensor:
        """``x`` ``[B, L, d]``, or ``[n, d]`` tokens attending as ``groups`` say."""
        h = self.attn(x, mask=mask, causal=causal, cache=cache, groups=groups)
        x = self.norm_attn(x + self.dropout(h))
        return self.norm_ffn(x + self.dropout(self.ffn(x)))


class EncoderStack(nn.ModuleList):
    """``n_layers`` post-norm :class:`EncoderLayer` s of one block size: THE encoder stack of
    every Transformer-family model (the flat encoder, the HT-Encoder's utterance and context
    stages, the rankers' sequence encoder, the LM stacks). Callers add positions and
    dropout; ``forward`` runs the layers under one mask, or causally, zeroing padding
    between layers where ``keep`` ``[B, L, 1]`` says. A ``ModuleList``, so state-dict keys
    are ``<name>.<i>.*`` as for a plain list of layers."""

    def __init__(
        self,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        d_head: int | None = None,
        congruent: bool = False,
        attention_dropout: float | None = None,
    ) -> None:
        super().__init__(
            EncoderLayer(d_model, n_heads, d_ff, dropout, d_head, congruent, attention_dropout)
            for _ in range(n_layers)
        )

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
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

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        d_head: int | None = None,
        d_memory: int | None = None,
        attention_dropout: float | None = None,
    ) -> None:
        super().__init__()
        p_attn = dropout if attention_dropout is None else attention_dropout
        self.self_attn = MultiHeadAttention(d_model, n_heads, d_head, dropout=p_attn)
        self.cross_attn = MultiHeadAttention(
            d_model, n_heads, d_head, d_kv=d_memory, dropout=p_attn
        )
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm_self = nn.LayerNorm(d_model)
        self.norm_cross = nn.LayerNorm(d_model)
        self.norm_ffn = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

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
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        d_head: int | None = None,
        d_memory: int | list[int] | None = None,
        pad_id: int = 0,
        attention_dropout: float | None = None,
        tie_output: bool = True,
    ) -> None:
        super().__init__()
        d_memories = d_memory if isinstance(d_memory, list) else [d_memory] * n_layers
        self.embed = TokenEmbedding(vocab_size, d_model, pad_id)
        self.positions = SinusoidalPositions(d_model)
        self.layers = nn.ModuleList(
            DecoderLayer(d_model, n_heads, d_ff, dropout, d_head, d_memories[i], attention_dropout)
            for i in range(n_layers)
        )
        self.dropout = nn.Dropout(dropout)
        self.output = nn.Linear(d_model, vocab_size, bias=False)
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
