"""Recurrent blocks the RNN baselines share (``rnn.py``): their base config, a GRU run over
padded sequences, the utterance encoder, the conditioned decoder and the decoding state
and memories one ``generate()`` drives.

Compiling: a model built on ``nn.GRU``/``nn.LSTM`` says ``supports_compile = False`` (the
training loop's ``compile: auto`` then leaves it eager). Dynamo does not trace the RNN
modules (``torch._dynamo.config.allow_rnn`` is off) and breaks the graph at each; with it
on, the packed sequences still need their lengths on the host (``pack_padded_sequence``
takes them on the CPU: a host synchronisation per call), and the recurrence is already one
cuDNN kernel per layer, so compiling could fuse only the small ops around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from pipeline.models.base import ModelConfig, select_batch_dim


class RNNConfig(ModelConfig):
    """Sizes shared by the RNN baselines.

    The U-Net paper sets the word embedding and hidden size of every baseline's encoder,
    decoder and context encoder to 256. What it leaves open follows the VHCR authors'
    code (ctr4si/A-Hierarchical-Latent-Structure-for-Variational-Conversation-Modeling):
    one GRU layer, a bidirectional encoder (``d_hidden`` per direction, so encodings are
    ``2 * d_hidden`` wide) and dropout 0.2.
    """

    d_embed: int = Field(default=256, ge=1)
    d_hidden: int = Field(default=256, ge=1)
    n_layers: int = Field(default=1, ge=1)
    bidirectional: bool = True
    dropout: float = Field(default=0.2, ge=0.0, lt=1.0)


def run_gru(gru: nn.GRU, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Run ``gru`` over left-aligned ``x`` ``[N, L, d]`` of ``lengths`` ``[N]`` (0 allowed).

    Returns outputs ``[N, L, dirs * h]`` (0 past each length) and the last layer's final
    state ``[N, dirs * h]`` (both directions concatenated; 0 for empty rows).
    """
    dirs = 2 if gru.bidirectional else 1
    if x.shape[0] == 0:  # e.g. a batch whose histories are all empty
        return x.new_zeros(0, x.shape[1], dirs * gru.hidden_size), x.new_zeros(
            0, dirs * gru.hidden_size
        )
    packed = pack_padded_sequence(
        x, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False
    )
    out, h_n = gru(packed)
    out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
    final = h_n[-dirs:].transpose(0, 1).reshape(x.shape[0], -1)
    empty = (lengths == 0)[:, None]
    return out * ~empty[:, :, None], final.masked_fill(empty, 0.0)


@dataclass
class RNNState:
    """Decoder hidden state, batch-first ``[B, n_layers, d_hidden]`` so ``select`` works."""

    hidden: Tensor

    def select(self, index: Tensor) -> RNNState:
        return select_batch_dim(self, index)  # type: ignore[return-value]


@dataclass
class FlatMemory:
    """S2SA's memory: encoder states ``[B, L, 2h]``, their mask and the initial decoder
    state ``[B, n_layers, h]``."""

    states: Tensor
    mask: Tensor
    hidden: Tensor


@dataclass
class ContextMemory:
    """The hierarchical models' memory: the decoder's conditioning vector ``[B, d_cond]``
    (context state, plus the sampled latents for VHRED/VHCR)."""

    cond: Tensor


class UtteranceEncoder(nn.Module):
    """Embedding + (bi)GRU over token sequences; the final state encodes the sequence."""

    def __init__(self, embed: nn.Embedding, config: RNNConfig) -> None:
        super().__init__()
        self.embed = embed
        self.gru = nn.GRU(
            config.d_embed,
            config.d_hidden,
            config.n_layers,
            batch_first=True,
            bidirectional=config.bidirectional,
            dropout=config.dropout if config.n_layers > 1 else 0.0,
        )
        self.dropout = nn.Dropout(config.dropout)
        self.d_out = config.d_hidden * (2 if config.bidirectional else 1)

    def forward(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``ids``/``mask`` ``[N, L]`` (left-aligned) -> (states ``[N, L, d_out]``,
        final ``[N, d_out]``)."""
        return run_gru(self.gru, self.dropout(self.embed(ids)), mask.sum(1))


class ConditionedDecoder(nn.Module):
    """GRU decoder whose initial state is ``tanh(W cond)`` and whose every input is
    ``[embedding; cond]`` (HRED's decoder conditioned on the context), or the embedding
    alone with ``condition_inputs=False``."""

    def __init__(
        self, embed: nn.Embedding, config: RNNConfig, d_cond: int, condition_inputs: bool = True
    ) -> None:
        super().__init__()
        self.embed = embed
        self.n_layers, self.d_hidden = config.n_layers, config.d_hidden
        self.condition_inputs = condition_inputs
        self.init = nn.Linear(d_cond, config.n_layers * config.d_hidden)
        self.gru = nn.GRU(
            config.d_embed + (d_cond if condition_inputs else 0),
            config.d_hidden,
            config.n_layers,
            batch_first=True,
            dropout=config.dropout if config.n_layers > 1 else 0.0,
        )
        self.dropout = nn.Dropout(config.dropout)
        self.output = nn.Linear(config.d_hidden, config.vocab_size)

    def init_state(self, cond: Tensor) -> RNNState:
        h = torch.tanh(self.init(cond)).view(-1, self.n_layers, self.d_hidden)
        return RNNState(h)

    def forward(
        self, tokens: Tensor, cond: Tensor, state: RNNState | None
    ) -> tuple[Tensor, RNNState]:
        state = self.init_state(cond) if state is None else state
        x = self.embed(tokens)
        if self.condition_inputs:
            x = torch.cat([x, cond[:, None].expand(-1, tokens.shape[1], -1)], -1)
        out, h = self.gru(self.dropout(x), state.hidden.transpose(0, 1).contiguous())
        return self.output(self.dropout(out)), RNNState(h.transpose(0, 1))
