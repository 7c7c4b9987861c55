"""GPT and congruent GPT: decoder-only Transformer language models over whole documents.

Hierarchical GPT paper (Roh et al.), Tables 1-2: d=512, 8 heads, 6 layers, FFN 2048 (the
paper's parameter counts grow by 3.15M per layer, i.e. 4*512^2 + 2*512*2048). The congruent
variant shares the query and key projections of every attention layer (W_q = W_k), which
removes exactly ``d_model^2`` weights (+ ``d_model`` biases) per layer.

The flat model reads ``batch.flat_ids`` (the document's sentences ``w1 .. wn <eos>``
concatenated) with one ``<bos>`` prepended, and reports its token NLL in the sentence
layout ``[B, S, Ls]`` so it scores exactly the tokens the hierarchical model scores (PTB
convention: every word plus each sentence's ``<eos>``).

``Stack`` (sinusoidal positions + post-norm ``EncoderLayer``s, causal or bidirectional) is
also the building block of every level of ``pipeline.models.hgpt``.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn
from torch.nn import functional as F

from pipeline.data.batch import LMBatch
from pipeline.data.special import BOS_ID, PAD_ID
from pipeline.models.base import AttentionModelConfig, LanguageModel, TaskKind
from pipeline.models.layers import EncoderLayer, SinusoidalPositions, TokenEmbedding, padding_mask
from pipeline.models.registry import register


class GPTConfig(AttentionModelConfig):
    """Flat GPT; defaults are the paper's 6-layer model."""

    d_model: int = Field(512, ge=1)
    n_heads: int = Field(8, ge=1)
    n_layers: int = Field(6, ge=1)
    d_ff: int = Field(2048, ge=1)
    congruent: bool = False

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads: {self.n_heads} does not divide d_model={self.d_model}")
        return self


class Stack(nn.Module):
    """Sinusoidal positions, dropout, then ``n_layers`` post-norm Transformer layers.

    ``causal=True`` makes it a GPT block (position i sees positions <= i); otherwise it is
    a bidirectional (BERT-like) encoder over the real positions of ``mask``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        n_layers: int,
        dropout: float,
        congruent: bool,
        causal: bool,
        attention_dropout: float | None = None,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.positions = SinusoidalPositions(d_model)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(
                d_model,
                n_heads,
                d_ff,
                dropout,
                congruent=congruent,
                attention_dropout=attention_dropout,
            )
            for _ in range(n_layers)
        )

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """``x`` ``[B, L, d]`` input embeddings; ``mask`` ``[B, L]`` True = real position.

        A causal stack needs no mask for right-padded input: real positions never see the
        padding after them.
        """
        x = self.dropout(x + self.positions.range(x.shape[1], x.device))
        attn_mask = None if mask is None else padding_mask(mask)
        for layer in self.layers:
            x = layer(x, mask=attn_mask, causal=self.causal)
        return x


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


def sequence_nll(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Per-token cross-entropy ``[..., L]`` (float32), zero where ``mask`` is False."""
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none"
    )
    return nll.view_as(targets) * mask


@register("gpt", TaskKind.LM, GPTConfig)
@register("congruent_gpt", TaskKind.LM, GPTConfig, congruent=True)
class GPT(LanguageModel):
    """Decoder-only Transformer LM with tied input/output embeddings."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config.vocab_size, config.d_model, PAD_ID)
        self.stack = Stack(
            config.d_model,
            config.n_heads,
            config.d_ff,
            config.n_layers,
            config.dropout,
            config.congruent,
            causal=True,
            attention_dropout=config.attention_dropout_p,
        )
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.output.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        """Next-token logits ``[B, L, V]`` for right-padded ``ids`` ``[B, L]``."""
        return self.output(self.stack(self.embed(ids)))

    def token_nll(self, batch: LMBatch) -> Tensor:
        """NLL ``[B, S, Ls]`` of every sentence token given ``<bos>`` and all tokens before it
        in the document (0 at padding)."""
        flat_count = batch.flat_mask.sum(1)
        sentence_count = batch.sentence_mask.sum((1, 2))
        if not torch.equal(flat_count, sentence_count):
            raise ValueError(
                "LMBatch: flat_ids and sentences hold different numbers of tokens per document "
                f"({flat_count.tolist()} vs {sentence_count.tolist()}); build both from the "
                "same sentences"
            )
        length = extent(batch.flat_mask)
        if length == 0:
            return batch.sentence_mask.new_zeros(batch.sentence_mask.shape, dtype=torch.float)
        targets, mask = batch.flat_ids[:, :length], batch.flat_mask[:, :length]
        bos = targets.new_full((targets.shape[0], 1), BOS_ID)
        inputs = torch.cat([bos, targets[:, :-1]], dim=1)
        nll = sequence_nll(self(inputs), targets, mask)
        # The flat real tokens are the sentence tokens in the same (row-major) order.
        return scatter_rows(batch.sentence_mask, nll[mask])
