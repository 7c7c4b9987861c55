"""Shared Transformer building blocks, written once and used by every model.

Mask convention (everywhere in hiertx): a boolean tensor, **True = may attend**,
broadcastable to ``[B, heads, L_query, L_key]`` (``[B, L_query, L_key]`` is accepted), or
the same mask given by its predicate (``flex.FlexMask``, FlexAttention's block-sparse
kernel). A query row with no allowed key (a padding query) yields a zero output instead of
the NaN that a fully masked softmax produces.

Initialisation follows the U-Net Transformer paper: Xavier everywhere, Kaiming for the
linear before the FFN's ReLU, and Xavier scaled by 1/100 on the attention and FFN output
projections (so each residual block starts close to the identity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pipeline.models.base import RESIDUAL_INIT_GAIN, select_batch_dim
from pipeline.models.dropout import SiteDropout, drop_word_types
from pipeline.models.flex import FlexMask


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
    for queries and keys (W_q = W_k, Hierarchical GPT paper). ``qkv_dropout`` (a language
    model's recipe): dropout on the three projections' outputs, each its own draw (one mask
    over their concatenation, as the Transformer-XL PTB code's ``qkv_net`` has it, in law).
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
        qkv_dropout: nn.Module | None = None,
        output_gain: float = RESIDUAL_INIT_GAIN,
    ) -> None:
        super().__init__()
        self.qkv_dropout = qkv_dropout
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
        self.out_proj = xavier_(nn.Linear(inner, d_out, bias=bias), gain=output_gain)

    def _drop(self, projected: Tensor) -> Tensor:
        return projected if self.qkv_dropout is None else self.qkv_dropout(projected)

    def _heads(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.n_heads, self.d_head).transpose(1, 2)

    def forward(
        self,
        query: Tensor,
        key_value: Tensor | None = None,
        mask: Tensor | FlexMask | None = None,
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
        q = self._heads(self._drop(self.q_proj(query)))
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            k = self._heads(self._drop(self.k_proj(kv_input)))
            v = self._heads(self._drop(self.v_proj(kv_input)))
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
        qkv = self._drop(qkv)
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
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | FlexMask | None, causal: bool, dropout: float
) -> Tensor:
    """SDPA with the hiertx mask convention; rows with no allowed key give zeros.

    Causal attention without a mask over a whole sequence (``Lq == Lk``: training, teacher
    forcing) runs SDPA's ``is_causal``, no mask tensor (the flash kernel on CUDA); a cached
    decoding step of one token needs no mask at all. A ``FlexMask`` runs FlexAttention where
    it has a block mask and no dropout is asked for (FlexAttention has none), else SDPA on
    the dense mask it evaluates.
    """
    if isinstance(mask, FlexMask):
        if causal:
            raise ValueError("a FlexMask holds the whole mask: fold causality into its mod")
        if mask.block is not None and dropout == 0.0:
            return mask.attend(q, k, v)
        mask = mask.dense()
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
    """Position-wise ``Linear -> ReLU -> dropout -> Linear``; ``locked``: the dropout mask
    is one per sequence (``models.dropout.SiteDropout``, Transformer-XL's PTB FFN)."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        dropout: float = 0.0,
        d_out: int | None = None,
        locked: bool = False,
        output_gain: float = RESIDUAL_INIT_GAIN,
    ):
        super().__init__()
        self.inner = nn.Linear(d_model, d_ff)
        nn.init.kaiming_uniform_(self.inner.weight, nonlinearity="relu")
        nn.init.zeros_(self.inner.bias)
        self.outer = xavier_(nn.Linear(d_ff, d_model if d_out is None else d_out), output_gain)
        self.dropout = SiteDropout(dropout, locked)

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
    """Token embeddings scaled by sqrt(d) (Vaswani et al.), padding row zero.

    ``type_dropout`` (AWD-LSTM's word-type embedding dropout, ``models.dropout``): in
    training, :meth:`step_table` draws this step's table with whole rows dropped; ``forward``
    looks ids up in it. A tied output projection keeps the whole table, as AWD-LSTM's does.
    """

    def __init__(
        self, vocab_size: int, d_model: int, pad_id: int = 0, type_dropout: float = 0.0
    ) -> None:
        super().__init__(vocab_size, d_model, padding_idx=pad_id)
        nn.init.normal_(self.weight, std=d_model**-0.5)
        with torch.no_grad():
            self.weight[pad_id].zero_()
        self.scale = math.sqrt(d_model)
        self.type_dropout = type_dropout

    def step_table(self) -> Tensor | None:
        """This training step's table with word types dropped (one draw: pass it to every
        lookup of the step), or None (eval mode, no ``type_dropout``): the whole table."""
        if not self.training or self.type_dropout == 0.0:
            return None
        return drop_word_types(self.weight, self.type_dropout)

    def forward(self, ids: Tensor, table: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """``[..., d]`` embeddings of ``ids``, from ``table`` (:meth:`step_table`) if given."""
        if table is None:
            return super().forward(ids) * self.scale
        return F.embedding(ids, table, self.padding_idx) * self.scale
