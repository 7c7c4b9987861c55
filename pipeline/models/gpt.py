"""GPT and congruent GPT: decoder-only Transformer language models over whole documents.

Hierarchical GPT paper (Roh et al.), Tables 1-2: d=512, 8 heads, 6 layers, FFN 2048 (the
paper's parameter counts grow by 3.15M per layer, i.e. 4*512^2 + 2*512*2048). The congruent
variant shares the query and key projections of every attention layer (W_q = W_k), which
removes exactly ``d_model^2`` weights (+ ``d_model`` biases) per layer.

The flat model reads ``batch.flat_ids`` (the document's sentences ``w1 .. wn <eos>``
concatenated) with one ``<bos>`` prepended, and reports its token NLL in the sentence
layout ``[B, S, Ls]`` so it scores exactly the tokens the hierarchical model scores (PTB
convention: every word plus each sentence's ``<eos>``).

Its layers are ``stack.Stack`` (causal), the block every level of ``hgpt`` is built of.

The regularisers of the Transformer-XL PTB recipe (``TransformerLMConfig``, all off by
default) sit as in that code (``transformer_xl.py``): word-type dropout on the embedding
lookup (l. 315-318), input dropout on embeddings + positions (l. 334-335), dropout on each
attention branch (l. 195) and in and after each FFN (l. 51-56), output dropout before the
tied projection (l. 357); AR/TAR on the final hidden states before output dropout.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.data.batch import LMBatch
from pipeline.data.special import BOS_ID, PAD_ID
from pipeline.models.base import LanguageModel, TokenScores, TransformerLMConfig, masked_token_nll
from pipeline.models.dropout import SiteDropout
from pipeline.models.layers import TokenEmbedding
from pipeline.models.registry import register
from pipeline.models.stack import Stack, extent, flat_to_sentences, scatter_rows, static_shapes
from pipeline.names import Task


class GPTConfig(TransformerLMConfig):
    """Flat GPT; defaults are the paper's 6-layer model."""

    d_model: int = Field(512, ge=1)
    n_heads: int = Field(8, ge=1)
    n_layers: int = Field(6, ge=1)
    d_ff: int = Field(2048, ge=1)
    congruent: bool = False


@register("gpt", Task.LM, GPTConfig)
@register("congruent_gpt", Task.LM, GPTConfig, congruent=True)
class GPT(LanguageModel):
    """Decoder-only Transformer LM with tied input/output embeddings."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.embed = TokenEmbedding(c.vocab_size, c.d_model, PAD_ID, c.embedding_dropout)
        self.stack = Stack(c.block(), c.n_layers, causal=True)
        self.output_dropout = SiteDropout(c.output_dropout, c.locked_dropout)
        self.output = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.output.weight = self.embed.weight

    def token_embedding(self) -> nn.Parameter:
        return self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        """Next-token logits ``[B, L, V]`` for right-padded ``ids`` ``[B, L]``."""
        return self.output(self.output_dropout(self.stack(self.embed(ids))))

    def token_nll(self, batch: LMBatch) -> Tensor:
        """NLL ``[B, S, Ls]`` of every sentence token given ``<bos>`` and all tokens before it
        in the document (0 at padding)."""
        return self.score_tokens(batch).nll

    def score_tokens(self, batch: LMBatch) -> TokenScores:
        """``token_nll`` and the last layer's output at each input position (which predicts
        the flat token at the same index)."""
        static = static_shapes(batch.flat_ids)
        scored = batch.scored_flat_mask()
        if static:  # padded shapes and no check that reads the data: nothing leaves the device
            targets, mask = batch.flat_ids, batch.flat_mask
        else:
            self._check_layouts(batch)
            length = extent(batch.flat_mask)
            if length == 0:  # nothing to score, nothing to regularise
                nll = batch.sentence_mask.new_zeros(batch.sentence_mask.shape, dtype=torch.float)
                hidden = nll.new_zeros(len(nll), 0, self.config.d_model)
                return TokenScores(nll, hidden, batch.flat_mask[:, :0])
            targets, mask = batch.flat_ids[:, :length], batch.flat_mask[:, :length]
            scored = scored[:, :length]
        bos = targets.new_full((targets.shape[0], 1), BOS_ID)
        inputs = torch.cat([bos, targets[:, :-1]], dim=1)
        hidden = self.stack(self.embed(inputs, self.embed.step_table()))
        nll = masked_token_nll(self.output(self.output_dropout(hidden)), targets, mask)
        if static:
            return TokenScores(flat_to_sentences(nll, batch.sentence_mask), hidden, scored)
        # The flat real tokens are the sentence tokens in the same (row-major) order.
        return TokenScores(scatter_rows(batch.sentence_mask, nll[mask]), hidden, scored)

    @staticmethod
    def _check_layouts(batch: LMBatch) -> None:
        flat_count = batch.flat_mask.sum(1)
        sentence_count = batch.sentence_mask.sum((1, 2))
        if not torch.equal(flat_count, sentence_count):
            raise ValueError(
                "LMBatch: flat_ids and sentences hold different numbers of tokens per document "
                f"({flat_count.tolist()} vs {sentence_count.tolist()}); build both from the "
                "same sentences"
            )
