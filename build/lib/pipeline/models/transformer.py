"""Transformer encoder-decoder over the flat dialogue history (U-Net paper's baseline).

The history is the concatenation of its utterances. Each token's input is its (shared,
sqrt(d)-scaled) word embedding + a sinusoidal encoding of its position in the flat history
+ a learned segment embedding of its utterance. The decoder is ``blocks.Decoder`` (causal
self-attention, cross-attention to the encoder output, output tied to the embedding).

Segment indices count utterances **from the most recent** (0 = the utterance the response
answers, 1 = the one before, ...). The batch's ``utt_index`` counts from the oldest kept
utterance, so the same utterance would get a different embedding depending on how much
history precedes it, and truncating the history (keeping the most recent tokens) would
shift every index. Counting backwards gives the last utterance a fixed embedding.

The frame it shares with the U-Net Transformer (input embedding, decoder, incremental
decoding) is ``seq2seq.EncoderDecoder``; this module supplies the encoder stack.
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor, nn

from pipeline.models.base import BlockDims
from pipeline.models.blocks import EncoderStack
from pipeline.models.layers import padding_mask
from pipeline.models.registry import register
from pipeline.models.seq2seq import EncoderDecoder, EncoderDecoderConfig, EncoderMemory
from pipeline.names import Task


class TransformerConfig(EncoderDecoderConfig):
    """Sizes of the U-Net paper's Transformer: d=256, 6+6 layers, 8 heads of 64, FFN 1024
    (the encoder-decoders' defaults, ``seq2seq.EncoderDecoderConfig``)."""

    n_encoder_layers: int = Field(6, ge=1)


class AdjTransformerConfig(TransformerConfig):
    """The paper's ADJ-Transformer: the hidden size raised to 301 so the parameter count
    matches the U-Net Transformer (~25M at a 20k vocabulary). Heads stay 8 x 64 (301 is not
    divisible by 8); the FFN keeps the authors' 4 x width rule."""

    d_model: int = Field(301, ge=1)
    d_ff: int = Field(1204, ge=1)


class TransformerEncoder(nn.Module):
    """A stack of post-norm ``EncoderLayer``s over the flat history; pad outputs are zero."""

    def __init__(self, n_layers: int, dims: BlockDims) -> None:
        super().__init__()
        self.layers = EncoderStack(n_layers, dims)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.layers(x, padding_mask(mask), keep=mask.unsqueeze(-1))


@register("adj_transformer", Task.GENERATE, AdjTransformerConfig)
@register("transformer", Task.GENERATE, TransformerConfig)
class Transformer(EncoderDecoder):
    """The vanilla Transformer baseline (and, with ``AdjTransformerConfig``, ADJ-Transformer)."""

    def __init__(self, config: TransformerConfig) -> None:
        c = config
        dims = c.block(d_head=c.head_size)
        super().__init__(c.vocab_size, c.n_decoder_layers, dims, c.n_segments, None, c.tie_output)
        self.config = config
        self.encoder = TransformerEncoder(c.n_encoder_layers, dims)

    def encode_embedded(self, x: Tensor, mask: Tensor) -> EncoderMemory:
        return EncoderMemory(self.encoder(x, mask), mask)
