"""Transformer encoder-decoder over the flat dialogue history (U-Net paper's baseline).

The history is the concatenation of its utterances. Each token's input is its (shared,
sqrt(d)-scaled) word embedding + a sinusoidal encoding of its position in the flat history
+ a learned segment embedding of its utterance. The decoder is ``layers.Decoder`` (causal
self-attention, cross-attention to the encoder output, output tied to the embedding).

Segment indices count utterances **from the most recent** (0 = the utterance the response
answers, 1 = the one before, ...). The batch's ``utt_index`` counts from the oldest kept
utterance, so the same utterance would get a different embedding depending on how much
history precedes it, and truncating the history (keeping the most recent tokens) would
shift every index. Counting backwards gives the last utterance a fixed embedding.

``EncoderDecoder`` holds what the U-Net Transformer shares with this model (input
embedding, decoder, incremental decoding); subclasses supply the encoder stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, ValidationInfo, field_validator
from torch import Tensor, nn

from pipeline.data.batch import GenerateBatch, History
from pipeline.data.special import PAD_ID
from pipeline.models.base import AttentionModelConfig, Seq2SeqModel, TaskKind
from pipeline.models.layers import (
    Decoder,
    DecoderCache,
    EncoderLayer,
    SegmentEmbedding,
    SinusoidalPositions,
    TokenEmbedding,
    padding_mask,
)
from pipeline.models.registry import register


class TransformerConfig(AttentionModelConfig):
    """Sizes of the U-Net paper's Transformer: d=256, 6+6 layers, 8 heads of 64, FFN 1024.

    ``d_head`` is the per-head key/value size; the paper keeps 64 (so 8 heads span 512, not
    the model width). ``None`` means ``d_model // n_heads``.
    """

    d_model: int = Field(256, ge=1)
    n_encoder_layers: int = Field(6, ge=1)
    n_decoder_layers: int = Field(6, ge=1)
    n_heads: int = Field(8, ge=1)
    d_head: int | None = Field(64, ge=1)
    d_ff: int = Field(1024, ge=1)
    n_segments: int = Field(32, ge=1)

    @field_validator("d_head")
    @classmethod
    def _heads_fit(cls, d_head: int | None, info: ValidationInfo) -> int | None:
        return check_head_size(d_head, info)

    @property
    def head_size(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads


class AdjTransformerConfig(TransformerConfig):
    """The paper's ADJ-Transformer: the hidden size raised to 301 so the parameter count
    matches the U-Net Transformer (~25M at a 20k vocabulary). Heads stay 8 x 64 (301 is not
    divisible by 8); the FFN keeps the authors' 4 x width rule."""

    d_model: int = Field(301, ge=1)
    d_ff: int = Field(1204, ge=1)


def check_head_size(d_head: int | None, info: ValidationInfo) -> int | None:
    """``d_head=None`` means ``d_model // n_heads``: then the heads must divide the width.
    (A field validator, so the error names ``d_head``.)"""
    d_model, n_heads = info.data.get("d_model"), info.data.get("n_heads")
    if d_head is None and d_model is not None and n_heads is not None and d_model % n_heads:
        raise ValueError(
            f"None (d_model // n_heads) needs n_heads={n_heads} to divide "
            f"d_model={d_model}; set d_head explicitly"
        )
    return d_head


def recent_first_segments(history: History) -> Tensor:
    """Utterance index of each token counted from the most recent utterance (0 at padding)."""
    index = history.utt_index * history.input_mask
    last = index.max(dim=1, keepdim=True).values
    return (last - index).clamp(min=0) * history.input_mask


class HistoryEmbedding(nn.Module):
    """Token embedding + sinusoidal flat position + learned segment, zero at padding.

    Padding rows are zeroed so that any convolution over the sequence sees padding exactly
    like its own zero padding (U-Net), and pad outputs stay zero as in the paper.
    """

    def __init__(self, tokens: TokenEmbedding, n_segments: int, dropout: float) -> None:
        super().__init__()
        d_model = tokens.embedding_dim
        self.tokens = tokens
        self.positions = SinusoidalPositions(d_model)
        self.segments = SegmentEmbedding(n_segments, d_model)
        nn.init.xavier_uniform_(self.segments.weight)  # the paper: Xavier for all parameters
        self.dropout = nn.Dropout(dropout)

    def forward(self, history: History) -> Tensor:
        ids = history.input_ids
        x = (
            self.tokens(ids)
            + self.positions.range(ids.shape[1], ids.device)
            + self.segments(recent_first_segments(history))
        )
        return self.dropout(x) * history.input_mask.unsqueeze(-1)


@dataclass
class EncoderMemory:
    """What the decoder attends to: one ``[B, L, d]`` state and ``[B, L]`` real-token mask,
    or one of each per decoder layer (U-Net per-layer attention). Batch-first throughout,
    so beams reorder it with ``select_batch_dim``."""

    states: Tensor | list[Tensor]
    masks: Tensor | list[Tensor]


class EncoderDecoder(Seq2SeqModel):
    """History embedding -> ``encode_embedded`` (the subclass's stack) -> ``layers.Decoder``.

    Encoder and decoder share the token embedding, which is also the output projection.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_decoder_layers: int,
        n_heads: int,
        d_head: int,
        d_ff: int,
        dropout: float,
        n_segments: int,
        d_memory: int | list[int] | None = None,
        attention_dropout: float | None = None,
    ) -> None:
        super().__init__()
        self.decoder = Decoder(
            vocab_size,
            d_model,
            n_decoder_layers,
            n_heads,
            d_ff,
            dropout,
            d_head,
            d_memory,
            PAD_ID,
            attention_dropout,
        )
        self.embedding = HistoryEmbedding(self.decoder.embed, n_segments, dropout)

    def encode_embedded(self, x: Tensor, mask: Tensor) -> EncoderMemory:
        """Run the encoder stack on embedded history ``x`` ``[B, L, d]`` (zero at padding)."""
        raise NotImplementedError

    def encode(self, batch: GenerateBatch) -> EncoderMemory:
        history = batch.history
        return self.encode_embedded(self.embedding(history), history.input_mask)

    def decode(
        self, tokens: Tensor, memory: EncoderMemory, state: DecoderCache | None = None
    ) -> tuple[Tensor, DecoderCache | None]:
        logits = self.decoder(tokens, memory.states, memory.masks, cache=state)
        return logits, state

    def init_state(self, memory: EncoderMemory, batch_size: int) -> DecoderCache:
        return self.decoder.init_cache()


class TransformerEncoder(nn.Module):
    """A stack of post-norm ``EncoderLayer``s over the flat history; pad outputs are zero."""

    def __init__(
        self,
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_head: int,
        d_ff: int,
        dropout: float,
        attention_dropout: float | None = None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            EncoderLayer(
                d_model, n_heads, d_ff, dropout, d_head, attention_dropout=attention_dropout
            )
            for _ in range(n_layers)
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        attn_mask = padding_mask(mask)
        keep = mask.unsqueeze(-1)
        for layer in self.layers:
            x = layer(x, attn_mask) * keep
        return x


@register("adj_transformer", TaskKind.GENERATE, AdjTransformerConfig)
@register("transformer", TaskKind.GENERATE, TransformerConfig)
class Transformer(EncoderDecoder):
    """The vanilla Transformer baseline (and, with ``AdjTransformerConfig``, ADJ-Transformer)."""

    def __init__(self, config: TransformerConfig) -> None:
        c = config
        super().__init__(
            c.vocab_size,
            c.d_model,
            c.n_decoder_layers,
            c.n_heads,
            c.head_size,
            c.d_ff,
            c.dropout,
            c.n_segments,
            attention_dropout=c.attention_dropout_p,
        )
        self.config = config
        self.encoder = TransformerEncoder(
            c.d_model,
            c.n_encoder_layers,
            c.n_heads,
            c.head_size,
            c.d_ff,
            c.dropout,
            c.attention_dropout_p,
        )

    def encode_embedded(self, x: Tensor, mask: Tensor) -> EncoderMemory:
        return EncoderMemory(self.encoder(x, mask), mask)
