"""The encoder-decoder frame of the Transformer family over flat histories (Transformer,
U-Net Transformer): the history embedding, the shared decoder with incremental decoding,
and a model supplies only its encoder stack
(``EncoderDecoder.encode_embedded``).

Segment indices count utterances **from the most recent** (0 = the utterance the response
answers, 1 = the one before, ...): the batch's ``utt_index`` counts from the oldest kept
utterance, so the same utterance would get a different embedding depending on how much
history precedes it, and truncating the history would shift every index.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field
from torch import Tensor, nn

from pipeline.data.batch import GenerateBatch, History
from pipeline.data.special import PAD_ID
from pipeline.models.base import AttentionModelConfig, BlockDims, Seq2SeqModel
from pipeline.models.blocks import Decoder, DecoderCache
from pipeline.models.layers import SegmentEmbedding, SinusoidalPositions, TokenEmbedding


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


class EncoderDecoderConfig(AttentionModelConfig):
    """What every flat-history encoder-decoder has, at the U-Net paper's sizes by default
    (d=256, 6 decoder layers, 8 heads of ``d_head`` 64, so 8 heads span 512, not the
    width; ``None`` means ``d_model // n_heads``; FFN 1024): ``n_segments`` utterance
    embeddings and whether the output projection is the token embedding (``tie_output``;
    the U-Net authors' code has its own output matrix, which the paper profile follows)."""

    d_model: int = Field(256, ge=1)
    n_decoder_layers: int = Field(6, ge=1)
    n_heads: int = Field(8, ge=1)
    d_head: int | None = Field(64, ge=1)
    d_ff: int = Field(1024, ge=1)
    n_segments: int = Field(32, ge=1)
    tie_output: bool = True


class EncoderDecoder(Seq2SeqModel):
    """History embedding -> ``encode_embedded`` (the subclass's stack) -> ``blocks.Decoder``.

    Encoder and decoder share the token embedding; it is also the output projection
    unless ``tie_output`` is False.
    """

    def __init__(
        self,
        vocab_size: int,
        n_decoder_layers: int,
        dims: BlockDims,
        n_segments: int,
        d_memory: int | list[int] | None = None,
        tie_output: bool = True,
    ) -> None:
        super().__init__()
        self.decoder = Decoder(vocab_size, n_decoder_layers, dims, d_memory, PAD_ID, tie_output)
        self.embedding = HistoryEmbedding(self.decoder.embed, n_segments, dims.dropout)

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
