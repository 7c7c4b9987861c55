"""What every select model shares: configs, ranking losses, the candidate/context batch
layout, the sequence encoder, and highway attention (Chiang et al., DSTC7 track 1).

Highway attention is multi-head attention whose softmax also covers the query attending
to ITSELF: for query position a and head h

    w = softmax([s_a,1 .. s_a,Lk ; s_self,a])       s_a,p  = q_a . k_p / sqrt(d_head)
    A_a = sum_p w_p V_p + w_self QV_a               s_self = q_a . k(Q_a) / sqrt(d_head)

with ``q = W_Q(Q + b_self)``, ``k_p = W_K(K_p + b_co)``, ``k(Q_a) = W_K(Q_a + b_self)``,
``V = W_V K``, ``QV = W_V Q``, then the usual output projection. This is what the
authors' code computes (MiuLab/DSTC7 ``Connection``): one softmax, the query's own value
as an extra value, biases added to the inputs before projection (also to the query
before W_Q; the paper's eq. 2 leaves it out, but ``W_Q b_self`` is absorbed by W_Q's own
bias, so the function class is the same). The paper's eq. 3 literally weights the self
value by the raw score ``s_self / (sum exp s + exp s_self)``, which is not a softmax
(weights need not be positive or sum to one); it is kept as
``HighwayFormula.PAPER_EQ3`` for comparison.

The Highway Recurrent Transformer is in ``highway.py``, the baselines in ``rankers.py``;
both build on this module.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.data.batch import SelectBatch
from pipeline.data.special import SPEAKER_SELF
from pipeline.models.base import (
    AttentionModelConfig,
    BlockDims,
    LossOutput,
    ModelConfig,
    SelectModel,
    candidate_bce,
    example_loss,
)
from pipeline.models.blocks import EncoderStack
from pipeline.models.layers import (
    MultiHeadAttention,
    SegmentEmbedding,
    SinusoidalPositions,
    TokenEmbedding,
    padding_mask,
    xavier_,
)

# --------------------------------------------------------------------------- configs, losses


class RankingLoss(enum.StrEnum):
    """``bce``: binary cross-entropy per candidate (the paper's final choice);
    ``lse``: the smooth max-margin ranking loss of the paper's submitted system."""

    BCE = "bce"
    LSE = "lse"


class SelectConfig(ModelConfig):
    """Fields every response-selection model has.

    ``knowledge_dim``: width K of the optional per-token knowledge features
    (``SelectBatch.context_knowledge``/``candidate_knowledge``); 0 ignores them.
    ``margin`` is the LSE loss's gamma (the MiuLab code's default is 0).
    """

    loss: RankingLoss = RankingLoss.BCE
    margin: float = Field(0.0, ge=0.0)
    knowledge_dim: int = Field(0, ge=0)
    d_embed: int = Field(300, ge=1)  # FastText vectors in the paper


def lse_ranking_loss(
    logits: Tensor, labels: Tensor, margin: float = 0.0, real: Tensor | None = None
) -> Tensor:
    """Per-example ``max(0, LSE{s_j : y_j=0} + LSE{-s_j : y_j=1} + margin)``, ``[B]``, over
    the real candidates (``real``; None: all).

    A smooth version of "the worst positive must beat the best negative by ``margin``".
    Rows without a positive or without a negative have nothing to rank and give 0.
    """
    positive = labels.bool()
    negative = ~positive if real is None else ~positive & real.bool()
    neg_inf = torch.finfo(logits.dtype).min
    valid = positive.any(-1) & negative.any(-1)
    # Invalid rows are computed on zeros so that no all--inf logsumexp (NaN gradient)
    # appears; `where` then discards them.
    pos = torch.where(valid[:, None], (-logits).masked_fill(~positive, neg_inf), 0.0)
    neg = torch.where(valid[:, None], logits.masked_fill(~negative, neg_inf), 0.0)
    loss = (neg.logsumexp(-1) + pos.logsumexp(-1) + margin).clamp(min=0)
    return torch.where(valid, loss, torch.zeros_like(loss))


def ranking_loss(
    logits: Tensor,
    labels: Tensor,
    kind: RankingLoss = RankingLoss.BCE,
    margin: float = 0.0,
    real: Tensor | None = None,
) -> LossOutput:
    """Mean per-example loss over the batch, over each example's ``real`` candidates
    (:func:`candidate_bce`, or :func:`lse_ranking_loss`)."""
    if kind == RankingLoss.LSE:
        return example_loss(lse_ranking_loss(logits.float(), labels, margin, real))
    return example_loss(candidate_bce(logits, labels, real))


class RankingModel(SelectModel):
    """A select model whose ``loss`` follows ``config.loss`` (BCE or LSE)."""

    config: SelectConfig

    def loss(self, batch: SelectBatch) -> LossOutput:
        real = batch.candidate_mask.any(-1)
        return ranking_loss(
            self.score(batch), batch.labels, self.config.loss, self.config.margin, real
        )


# --------------------------------------------------------------------------- batch layout


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max over positions of ``x`` ``[N, L, d]`` where ``mask`` ``[N, L]``; 0 if none."""
    filled = x.masked_fill(~mask[..., None], float("-inf")).max(-2).values
    return torch.where(mask.any(-1, keepdim=True), filled, torch.zeros_like(filled))


def check_knowledge(config: SelectConfig, knowledge: Tensor | None, name: str) -> Tensor | None:
    """The knowledge features to use (None when ``knowledge_dim`` is 0); a clear error when
    the config wants them and the batch lacks them or has another width."""
    if config.knowledge_dim == 0:
        return None
    if knowledge is None:
        raise ValueError(
            f"knowledge_dim={config.knowledge_dim} but the batch has no {name}; "
            "set knowledge_dim: 0 or build batches with knowledge features"
        )
    if knowledge.shape[-1] != config.knowledge_dim:
        raise ValueError(
            f"{name} has {knowledge.shape[-1]} features per token, "
            f"knowledge_dim is {config.knowledge_dim}"
        )
    return knowledge


# --------------------------------------------------------------------------- encoders


class FeatureEmbedding(nn.Module):
    """Token embedding (``d_embed``) concatenated with ``knowledge_dim`` features
    (``w~ = [w; F(w)]``), projected to ``d_out`` when the widths differ."""

    def __init__(self, vocab_size: int, d_embed: int, knowledge_dim: int, d_out: int) -> None:
        super().__init__()
        self.embed = TokenEmbedding(vocab_size, d_embed)
        d_in = d_embed + knowledge_dim
        self.project = xavier_(nn.Linear(d_in, d_out)) if d_in != d_out else nn.Identity()
        self.knowledge_dim = knowledge_dim

    def forward(self, ids: Tensor, knowledge: Tensor | None = None) -> Tensor:
        x = self.embed(ids)
        if self.knowledge_dim:
            x = torch.cat([x, knowledge.to(x.dtype)], -1)  # type: ignore[union-attr]
        return self.project(x)


class SequenceEncoder(nn.Module):
    """Embed (+ knowledge, + speaker, + sinusoidal PE of the given positions) and encode
    with ``n_layers`` post-norm Transformer blocks; padding keys are masked."""

    def __init__(
        self,
        vocab_size: int,
        d_embed: int,
        n_layers: int,
        dims: BlockDims,
        knowledge_dim: int = 0,
        speaker_embedding: bool = True,
    ) -> None:
        super().__init__()
        d_model = dims.d_model
        self.embed = FeatureEmbedding(vocab_size, d_embed, knowledge_dim, d_model)
        self.positions = SinusoidalPositions(d_model)
        # The paper prepends a speaker token to each utterance; an embedding of the
        # speaker id (0 pad, 1 self, 2 other) carries the same information.
        self.speaker = SegmentEmbedding(3, d_model, padding_idx=0) if speaker_embedding else None
        self.layers = EncoderStack(n_layers, dims)
        self.dropout = nn.Dropout(dims.dropout)

    @classmethod
    def from_config(cls, c: Any) -> SequenceEncoder:
        """The encoder a ranking model's config describes (HRT and the Transformer rankers
        share these fields; their heads split the width: no d_head)."""
        dims = c.block(d_head=None)
        return cls(c.vocab_size, c.d_embed, c.n_layers, dims, c.knowledge_dim, c.speaker_embedding)

    def forward(
        self,
        ids: Tensor,
        mask: Tensor,
        positions: Tensor,
        speaker: Tensor | None = None,
        knowledge: Tensor | None = None,
    ) -> Tensor:
        """``ids``/``mask``/``positions``/``speaker`` ``[N, L]`` -> ``[N, L, d_model]``."""
        x = self.embed(ids, knowledge) + self.positions(positions)
        if self.speaker is not None and speaker is not None:
            x = x + self.speaker(speaker)
        x = self.dropout(x)
        return self.layers(x, padding_mask(mask))


def encode_candidates(
    encoder: SequenceEncoder, batch: SelectBatch, knowledge: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Encode every candidate once: ``[B, N, Lc, d]`` and its mask ``[B, N, Lc]``.

    Candidates are spoken by the party whose response is predicted (``SPEAKER_SELF``).
    """
    b, n, length = batch.candidate_ids.shape
    ids = batch.candidate_ids.reshape(b * n, length)
    mask = batch.candidate_mask.reshape(b * n, length)
    positions = torch.arange(length, device=ids.device).expand(b * n, length)
    speaker = torch.where(mask, SPEAKER_SELF, 0)
    if knowledge is not None:
        knowledge = knowledge.reshape(b * n, length, -1)
    encoded = encoder(ids, mask, positions, speaker, knowledge)
    return encoded.view(b, n, length, -1), batch.candidate_mask


# --------------------------------------------------------------------------- highway attention


class HighwayFormula(enum.StrEnum):
    """``softmax``: the authors' code (one softmax over keys and self);
    ``paper_eq3``: the paper's literal eq. 3 (raw ``s_self`` weights the self value)."""

    SOFTMAX = "softmax"
    PAPER_EQ3 = "paper_eq3"


class HighwayAttention(nn.Module):
    """Multi-head attention over ``keys`` plus each query position's own key/value.

    The projections are a ``layers.MultiHeadAttention``'s (``self.mha``: same W_Q, W_K,
    W_V, W_O conventions); its output projection is re-initialised at full gain because
    no residual connection surrounds highway attention (the shared layers' 1/100 gain
    assumes one). ``mask`` follows the hiertx convention (True = may attend), ``[B, Lk]``
    key mask or broadcastable to ``[B, H, Lq, Lk]``; the self term is always allowed, so
    no row is ever empty.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        formula: HighwayFormula = HighwayFormula.SOFTMAX,
    ) -> None:
        super().__init__()
        self.mha = MultiHeadAttention(d_model, n_heads, dropout=dropout)
        xavier_(self.mha.out_proj)
        self.b_co = nn.Parameter(torch.zeros(d_model))
        self.b_self = nn.Parameter(torch.zeros(d_model))
        self.formula = HighwayFormula(formula)
        self.dropout = nn.Dropout(dropout)

    def weights(
        self, query: Tensor, keys: Tensor, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Attention weights and the values they weight.

        Returns ``w_keys`` ``[B, H, Lq, Lk]``, ``w_self`` ``[B, H, Lq]``, ``values``
        ``[B, H, Lk, dh]`` and ``self_values`` ``[B, H, Lq, dh]`` (before dropout).
        """
        mha = self.mha
        q = mha._heads(mha.q_proj(query + self.b_self))
        k = mha._heads(mha.k_proj(keys + self.b_co))
        k_self = mha._heads(mha.k_proj(query + self.b_self))
        values, self_values = mha._heads(mha.v_proj(keys)), mha._heads(mha.v_proj(query))
        scale = 1.0 / math.sqrt(mha.d_head)
        scores = (q @ k.transpose(-1, -2)) * scale
        self_scores = (q * k_self).sum(-1) * scale
        if mask is not None:
            if mask.dim() == 2:
                mask = padding_mask(mask)
            elif mask.dim() == 3:
                mask = mask.unsqueeze(1)
            scores = scores.masked_fill(~mask, float("-inf"))
        logits = torch.cat([scores, self_scores.unsqueeze(-1)], -1)
        if self.formula == HighwayFormula.SOFTMAX:
            w = logits.softmax(-1)
            return w[..., :-1], w[..., -1], values, self_values
        log_norm = logits.logsumexp(-1, keepdim=True)
        w_keys = (scores - log_norm).exp()
        w_self = self_scores * (-log_norm.squeeze(-1)).exp()
        return w_keys, w_self, values, self_values

    @classmethod
    def from_config(cls, c: TransformerSelectConfig) -> HighwayAttention:
        """The highway attention a Transformer ranker's config describes."""
        return cls(c.d_model, c.n_heads, c.attention_dropout_p, c.highway_formula)

    def forward(self, query: Tensor, keys: Tensor, mask: Tensor | None = None) -> Tensor:
        """``query`` ``[B, Lq, d]`` attends to ``keys`` ``[B, Lk, d]`` and itself ->
        ``[B, Lq, d]``."""
        w_keys, w_self, values, self_values = self.weights(query, keys, mask)
        w_keys, w_self = self.dropout(w_keys), self.dropout(w_self)
        out = w_keys @ values + w_self.unsqueeze(-1) * self_values
        b, h, lq, dh = out.shape
        return self.mha.out_proj(out.transpose(1, 2).reshape(b, lq, h * dh))


def bidirectional_score(
    highway: HighwayAttention,
    context: Tensor,
    context_mask: Tensor,
    candidates: Tensor,
    candidate_mask: Tensor,
) -> Tensor:
    """Logits ``[B, N]``: candidate attends to context (eq. 4), context attends to the
    candidate (eq. 5) with the SAME module, masked max-pool of each, dot product.

    ``context`` ``[B, Lx, d]`` / ``context_mask`` ``[B, Lx]``; ``candidates``
    ``[B, N, Lc, d]`` / ``candidate_mask`` ``[B, N, Lc]``.
    """
    b, n, lc, d = candidates.shape
    lx = context.shape[1]
    ctx = context[:, None].expand(b, n, lx, d).reshape(b * n, lx, d)
    ctx_mask = context_mask[:, None].expand(b, n, lx).reshape(b * n, lx)
    cand = candidates.reshape(b * n, lc, d)
    cand_mask = candidate_mask.reshape(b * n, lc)
    cand_vec = masked_max(highway(cand, ctx, ctx_mask), cand_mask)
    ctx_vec = masked_max(highway(ctx, cand, cand_mask), ctx_mask)
    return (cand_vec * ctx_vec).sum(-1).view(b, n)


# --------------------------------------------------------------------------- HRT


class TransformerSelectConfig(SelectConfig, AttentionModelConfig):
    """Sizes shared by the Transformer-based rankers.

    Paper: FFN 512, 2 encoder blocks, FastText 300-d embeddings. The width (102 = 6 heads
    x 17) and head count are the authors' code's (``dim_encoder``, ``n_heads``); the
    embedding (+ knowledge features) is projected to it.
    """

    d_model: int = Field(102, ge=1)
    n_heads: int = Field(6, ge=1)
    d_ff: int = Field(512, ge=1)
    n_layers: int = Field(2, ge=1)
    highway_formula: HighwayFormula = HighwayFormula.SOFTMAX
    speaker_embedding: bool = True
