"""Hierarchical GPT (Roh et al.): sentence encoder -> document GPT -> sentence decoder GPT.

- **Sentence encoder** (bidirectional ``Stack``): each real sentence ``w1 .. wn <eos>`` is
  encoded on its own; its embedding is the output at its LAST real token (its ``<eos>``),
  projected to the document width.
- **Document GPT** (causal ``Stack`` over sentences): input ``[BOD, e_0, .., e_{S-2}]`` with
  a learned Begin-Of-Document vector; its output at position ``s`` is the predicted
  embedding of sentence ``s``, computed from sentences ``< s`` only.
- **Sentence decoder GPT** (causal ``Stack`` over tokens): input ``[ê_s, w1, .., wn]``,
  target ``[w1, .., wn, <eos>]``. Paper, Figure 1: the decoder "autoregressively generates
  word sequences for each generated sentence embedding vector", with no cross-attention
  (Table 4 lists exactly the flat GPT's parameter counts); so the predicted embedding takes
  the place of ``<bos>`` as the decoder's first input (plus position 0's encoding).

One token embedding is shared by encoder, decoder input and the tied output projection
(again as the parameter counts imply). Defaults: d=512, 8 heads, FFN 2048, layers 1/1/4
(Table 3's best 6-layer split, the PTB headline). The sentence level may be narrower
(``d_sentence``): linear projections connect it to the document width.

Training strategies (``training``): ``joint`` trains everything at once (the paper's
reported setting). ``two_stage``: stage 1 trains the sentence encoder-decoder as an
autoencoder (document block bypassed: the decoder gets the sentence's OWN encoding, so
stage-1 NLL is not a language-model score); stage 2 trains the document block alone
through the frozen encoder/decoder. ``set_stage`` switches and (un)freezes;
``stage_for_step`` maps a training step to the stage (stage 1 for the first
``stage_one_steps`` steps).

The Transformer-XL PTB recipe's regularisers (``TransformerLMConfig``, all off by default;
``gpt`` cites where that code puts each) sit here as follows. Word-type dropout: one table
per step, for the encoder's and the decoder's lookups. ``input_dropout``: the inputs of the
two sentence stacks (token embeddings + positions; the decoder's position 0, the predicted
sentence embedding, with them); the document GPT's input (sentence embeddings, not words)
keeps ``dropout``. Attention-output and FFN dropout: every layer of the three stacks.
Locked masks are one per sequence: per sentence in the sentence stacks, per document in
the document GPT. Output dropout and AR/TAR: the sentence decoder's final hidden states,
which predict every token; TAR pairs consecutive positions of one sentence.
"""

from __future__ import annotations

import enum
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from pipeline.data.batch import LMBatch
from pipeline.data.special import PAD_ID
from pipeline.models.base import (
    LanguageModel,
    TokenScores,
    TransformerLMConfig,
    head_size,
    masked_token_nll,
)
from pipeline.models.dropout import SiteDropout
from pipeline.models.layers import TokenEmbedding
from pipeline.models.registry import register
from pipeline.models.stack import Stack, extent, scatter_rows, static_shapes
from pipeline.names import Task


class Stage(enum.IntEnum):
    """What a Hierarchical GPT currently trains."""

    JOINT = 0  # all three blocks
    SENTENCE = 1  # encoder + decoder as an autoencoder; document block bypassed and frozen
    DOCUMENT = 2  # document block only; encoder and decoder frozen


class HGPTConfig(TransformerLMConfig):
    """Hierarchical GPT; defaults are the paper's 1/1/4 model at d=512, 8 heads."""

    d_model: int = Field(512, ge=1, description="document GPT width")
    n_heads: int = Field(8, ge=1, description="document GPT heads")
    d_ff: int = Field(2048, ge=1, description="document GPT FFN width")
    d_sentence: int = Field(512, ge=1, description="sentence encoder/decoder width")
    sentence_heads: int = Field(8, ge=1)
    sentence_d_ff: int = Field(2048, ge=1)
    encoder_layers: int = Field(1, ge=1)
    document_layers: int = Field(1, ge=1)
    decoder_layers: int = Field(4, ge=1)
    congruent: bool = False
    training: Literal["joint", "two_stage"] = "joint"
    stage_one_steps: int = Field(
        10_000, ge=1, description="two_stage: steps of stage 1 before the document stage"
    )

    @model_validator(mode="after")
    def _sentence_heads_fit_width(self) -> HGPTConfig:
        head_size(self.d_sentence, self.sentence_heads, field="sentence_heads")
        return self


def _project(d_in: int, d_out: int) -> nn.Module:
    return nn.Identity() if d_in == d_out else nn.Linear(d_in, d_out)


@register("hgpt", Task.LM, HGPTConfig)
@register("congruent_hgpt", Task.LM, HGPTConfig, congruent=True)
class HierarchicalGPT(LanguageModel):
    """Sentence encoder -> document GPT -> sentence decoder GPT (module docstring)."""

    stream_unit = "sentences"

    def __init__(self, config: HGPTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        # the sentence blocks (encoder, decoder) and the document block have their own sizes
        sentence = c.block(d_model=c.d_sentence, n_heads=c.sentence_heads, d_ff=c.sentence_d_ff)
        self.embed = TokenEmbedding(c.vocab_size, c.d_sentence, PAD_ID, c.embedding_dropout)
        self.encoder = Stack(sentence, c.encoder_layers, causal=False)
        self.to_document = _project(c.d_sentence, c.d_model)
        self.bod = nn.Parameter(torch.randn(c.d_model))
        # its input is sentence embeddings, not words: `dropout`, not `input_dropout`
        self.document = Stack(c.block(input_dropout=None), c.document_layers, causal=True)
        self.from_document = _project(c.d_model, c.d_sentence)
        self.decoder = Stack(sentence, c.decoder_layers, causal=True)
        self.output_dropout = SiteDropout(c.output_dropout, c.locked_dropout)
        self.output = nn.Linear(c.d_sentence, c.vocab_size, bias=False)
        self.output.weight = self.embed.weight
        self.set_stage(Stage.JOINT if c.training == "joint" else Stage.SENTENCE)

    def token_embedding(self) -> nn.Parameter:
        return self.embed.weight

    # ------------------------------------------------------------------ training stages

    def document_parameters(self) -> list[nn.Parameter]:
        """The document block's parameters (what stage 2 trains)."""
        return [self.bod, *self.document.parameters()]

    def set_stage(self, stage: int) -> None:
        """Switch to ``Stage(stage)`` and set ``requires_grad`` accordingly: stage 1 freezes
        the (bypassed) document block, stage 2 freezes everything else, stage 0 nothing.

        Call it before building the optimizer / DDP wrapper, and rebuild both after a
        switch (DDP registers the parameters that require grad when it wraps the model).
        """
        self.stage = Stage(stage)
        document = {id(p) for p in self.document_parameters()}
        for p in self.parameters():
            if self.stage == Stage.JOINT:
                p.requires_grad_(True)
            elif self.stage == Stage.SENTENCE:
                p.requires_grad_(id(p) not in document)
            else:
                p.requires_grad_(id(p) in document)

    def stage_for_step(self, step: int) -> Stage:
        """The stage training step ``step`` (from 0) belongs to under ``config.training``."""
        if self.config.training == "joint":
            return Stage.JOINT
        return Stage.SENTENCE if step < self.config.stage_one_steps else Stage.DOCUMENT

    def on_train_step(self, step: int, epoch: int) -> None:
        """Training-loop hook (``pipeline.train.loop``): follow the two-stage schedule.

        Frozen parameters get no gradient, so the one optimizer the loop builds skips them;
        under DDP a switch needs a re-wrap, so two-stage training runs with one worker.
        """
        stage = self.stage_for_step(step)
        if stage != self.stage:
            self.set_stage(stage)

    # ------------------------------------------------------------------ blocks

    def encode_sentences(self, ids: Tensor, mask: Tensor, table: Tensor | None = None) -> Tensor:
        """Embeddings ``[N, d_model]`` of ``N`` right-padded sentences ``[N, L]``: the
        encoder output at each sentence's last real token. ``table``: this step's embedding
        table (``TokenEmbedding.step_table``)."""
        hidden = self.encoder(self.embed(ids, table), mask)
        last = mask.sum(1) - 1
        return self.to_document(hidden[torch.arange(len(ids), device=ids.device), last])

    def predict_sentences(self, encoded: Tensor) -> Tensor:
        """Document GPT: ``[B, S, d_model]`` sentence embeddings -> predicted embeddings of
        the same sentences, position ``s`` from sentences ``< s`` (and BOD) only."""
        bod = self.bod.expand(encoded.shape[0], 1, -1)
        return self.document(torch.cat([bod, encoded[:, :-1]], dim=1))

    def decode_sentences(
        self, predicted: Tensor, ids: Tensor, mask: Tensor, table: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Token NLL ``[N, L]`` of sentences ``ids`` ``[N, L]`` given their predicted
        embeddings ``[N, d_model]`` (which stand in for ``<bos>``), and the decoder's final
        hidden states ``[N, L, d_sentence]``."""
        first = self.from_document(predicted).unsqueeze(1)
        inputs = torch.cat([first, self.embed(ids[:, :-1], table)], dim=1)
        hidden = self.decoder(inputs)
        logits = self.output(self.output_dropout(hidden))
        return masked_token_nll(logits, ids, mask), hidden

    def token_nll(self, batch: LMBatch) -> Tensor:
        """NLL ``[B, S, Ls]`` of every sentence token given the previous sentences (through
        their embeddings) and the previous tokens of its sentence; 0 at padding."""
        return self.score_tokens(batch).nll

    def score_tokens(self, batch: LMBatch) -> TokenScores:
        """``token_nll`` and the sentence decoder's final hidden states, per sentence."""
        if static_shapes(batch.sentences):
            return self._score_padded(batch)
        # Trim to the real extent so extra padding changes no computation at all.
        length = extent(batch.sentence_mask)
        if length == 0:  # nothing to score, nothing to regularise
            nll = batch.sentence_mask.new_zeros(batch.sentence_mask.shape, dtype=torch.float)
            hidden = nll.new_zeros(0, 0, self.config.d_sentence)
            return TokenScores(nll, hidden, batch.sentence_mask.new_zeros(0, 0))
        present = batch.sentence_mask.any(-1)
        n_sent = extent(present)
        ids = batch.sentences[:, :n_sent, :length]
        mask = batch.sentence_mask[:, :n_sent, :length]
        scored = batch.scored_mask()[:, :n_sent, :length]
        present = present[:, :n_sent]
        # Only real sentences go through the sentence-level blocks.
        sent_ids, sent_mask = ids[present], mask[present]
        table = self.embed.step_table()
        encoded = self.encode_sentences(sent_ids, sent_mask, table)
        if self.stage == Stage.SENTENCE:
            predicted = encoded
        else:
            predicted = self.predict_sentences(scatter_rows(present, encoded))[present]
        nll, hidden = self.decode_sentences(predicted, sent_ids, sent_mask, table)
        out = scatter_rows(present, nll)
        full = batch.sentence_mask.shape
        out = nn.functional.pad(out, (0, full[2] - length, 0, full[1] - n_sent))
        return TokenScores(out, hidden, scored[present])

    def _score_padded(self, batch: LMBatch) -> TokenScores:
        """``score_tokens`` on the padded batch as it is (``stack.static_shapes``): every
        sentence slot goes through the sentence blocks, an empty one masked out (its
        encoder row attends to nothing and gives zeros; causality keeps it from the real
        sentences before it)."""
        b, n_sent, length = batch.sentences.shape
        ids = batch.sentences.reshape(b * n_sent, length)
        mask = batch.sentence_mask.reshape(b * n_sent, length)
        table = self.embed.step_table()
        encoded = self.encode_sentences(ids, mask, table)
        if self.stage == Stage.SENTENCE:
            predicted = encoded
        else:
            present = mask.any(-1, keepdim=True)
            document = (encoded * present).view(b, n_sent, -1)
            predicted = self.predict_sentences(document).reshape(b * n_sent, -1)
        nll, hidden = self.decode_sentences(predicted, ids, mask, table)
        scored = batch.scored_mask().reshape(b * n_sent, length)
        return TokenScores(nll.view(b, n_sent, length), hidden, scored)
