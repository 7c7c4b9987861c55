"""The HT-Encoder family (Santra et al., 2021, "Hierarchical Transformer for Task Oriented
Dialog Systems"): HIER, HIER-CLS, SET, MAT, HIER++, SET++ and HIER-Joint.

An HT-Encoder is a plain (M+N)-layer Transformer encoder made hierarchical by masks and
positions: the first M (utterance) layers use the UT-mask and local positions (within the
utterance), global positions (over the flat history) are added before the last N (context)
layers, which use a CT-mask (``masks.ContextMask``). A standard decoder (``blocks.Decoder``)
follows; it cross-attends to all encoder outputs by default (``masks.MemoryKeys``).

Most of what the masks forbid never needs computing: the UT-mask allows
``sum(utterance lengths**2)`` of the ``B * L**2`` pairs, the HIER CT-mask adds only the final
utterance's rows. So when eager (``AttentionLayout.PACKED``, what the default ``AUTO`` runs
then) the layers run on the real tokens alone, attention grouped by utterance
(``utterances.utterance_groups``) and, for the HIER CT-mask, by utterance plus one row per
final utterance (``utterances.context_groups``; ``layers.TokenGroups``). It is the same
computation on every real token as the masked flat history (``MASKED``, the paper's
formulation, which the other CT-masks always use), only without the padding and the
forbidden pairs (bench/RESULTS.md). The packed grids' sizes are read from the batch, so
under ``torch.compile`` ``AUTO`` runs the masked flat history instead, its masks as
FlexAttention block masks on CUDA (``FLEX``: tiles the masks forbid are skipped) where no
attention dropout is in effect, as dense masks otherwise (``resolve_layout``).

Sizes (Table 1, "L a/b/c, H, A, E"): the authors' code (bsantraigi/HIER, ``Transformer(
ntoken, ninp, nhead, nhid, ...)``) uses E (``ninp``, "embed_size") as the model width and H
(``nhid``) as the feed-forward width of PyTorch's ``TransformerEncoderLayer``. So ``d_model``
= E and ``d_ff`` = H here: HIER++'s 175/7 heads gives 25 per head, inside the authors'
Optuna range (25-40); no projection between embedding and hidden sizes is needed.

Encoder and decoder share one token embedding (as in the authors' code); the decoder's
output projection is tied to it (``blocks.Decoder``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import Field, ValidationInfo, field_validator
from torch import Tensor, nn

from pipeline.data.batch import GenerateBatch, History
from pipeline.data.special import BOS_ID, EOS_ID, PAD_ID
from pipeline.models import masks
from pipeline.models.base import (
    AttentionModelConfig,
    BlockDims,
    LossOutput,
    Seq2SeqModel,
    on_gpu,
    token_loss,
)
from pipeline.models.blocks import Decoder, DecoderCache, EncoderStack
from pipeline.models.flex import FlexMask
from pipeline.models.layers import SinusoidalPositions, TokenEmbedding, TokenGroups, xavier_
from pipeline.models.masks import ContextMask, MemoryKeys
from pipeline.models.registry import register
from pipeline.models.utterances import context_groups, utterance_groups
from pipeline.names import Task

# How a stack of encoder layers attends: a [B, L, L] mask (or None: no mask) or the same
# mask as a predicate (``flex.FlexMask``) over the padded batch, or token groups over its
# real tokens (``layers.TokenGroups``).
EncoderAttention = Tensor | FlexMask | TokenGroups | tuple[TokenGroups, ...] | None

# --------------------------------------------------------------------------- configs


class AttentionLayout(enum.StrEnum):
    """How the encoder's layers attend (same outputs on real tokens; module docstring).

    ``packed``: the real tokens on utterance grids (reads the grid sizes from the batch, so
    ``torch.compile`` breaks its graph there); ``masked``: ``[B, L, L]`` boolean masks over
    the padded batch; ``flex``: the same masks as FlexAttention block masks (no dropout on
    attention probabilities: needs ``attention_dropout: 0``); ``auto`` (default): packed
    when eager, and under ``torch.compile`` flex on CUDA where no attention dropout is in
    effect (``attention_dropout: 0``, or evaluation), masked otherwise.
    """

    AUTO = "auto"
    PACKED = "packed"
    MASKED = "masked"
    FLEX = "flex"


class HierConfig(AttentionModelConfig):
    """HIER (Table 1): layers shared/context/decoder 3/3/3, H (``d_ff``) 100, 4 heads,
    E (``d_model``) 100."""

    d_model: int = Field(100, ge=1)
    d_ff: int = Field(100, ge=1)
    d_head: int | None = Field(None, ge=1)
    n_heads: int = Field(4, ge=1)
    n_utterance_layers: int = Field(3, ge=0)
    n_context_layers: int = Field(3, ge=0)
    n_decoder_layers: int = Field(3, ge=1)
    context_mask: ContextMask = ContextMask.HIER
    memory_keys: MemoryKeys = MemoryKeys.ALL
    attention_layout: AttentionLayout = AttentionLayout.AUTO
    # Size of the multi-hot dialogue-act vector fed to the decoder (HIER++/SET++); None: none.
    n_acts: int | None = Field(None, ge=1)

    @field_validator("attention_layout")
    @classmethod
    def _flex_has_no_attention_dropout(
        cls, layout: AttentionLayout, info: ValidationInfo
    ) -> AttentionLayout:
        dropout, attention = info.data.get("dropout", 0.0), info.data.get("attention_dropout")
        p = dropout if attention is None else attention
        if layout is AttentionLayout.FLEX and p > 0:
            # by name: a check lists the levels setting the fields a message names
            which = "attention_dropout" if attention is not None else "dropout"
            raise ValueError(
                f"flex cannot drop attention probabilities, and {which} = {p} is in effect: "
                "set attention_dropout: 0, or attention_layout: auto (flex where it applies)"
            )
        return layout

    @field_validator("n_context_layers")
    @classmethod
    def _encoder_not_empty(cls, n_context: int, info: ValidationInfo) -> int:
        if n_context + (info.data.get("n_utterance_layers") or 0) == 0:
            raise ValueError("the encoder needs at least one utterance or context layer")
        return n_context


class SetConfig(HierConfig):
    """SET (Table 1): utterance encoder only, 6/-/3, H 100, 4 heads, E 100."""

    n_utterance_layers: int = Field(6, ge=1)
    n_context_layers: int = Field(0, ge=0)


class MatConfig(HierConfig):
    """MAT (Table 1): context encoder only, -/4/6, H 200, 5 heads, E 100."""

    d_ff: int = Field(200, ge=1)
    n_heads: int = Field(5, ge=1)
    n_utterance_layers: int = Field(0, ge=0)
    n_context_layers: int = Field(4, ge=1)
    n_decoder_layers: int = Field(6, ge=1)


class HierPPConfig(HierConfig):
    """HIER++ (Table 1): 4/6/3, H 91, 7 heads, E 175, with the dialogue acts of its corpus.
    HIER-CLS "differs from HIER++ only with respect to the CT-Mask", so it shares these
    sizes. The act vector's width is the corpus' act inventory (``DATA_FIELDS``): the
    paper's 44 is HDSA's inventory of MultiWOZ 2.0; our data builds its own (48 act types
    on the shared 2.1 files)."""

    DATA_FIELDS: ClassVar[tuple[str, ...]] = ("vocab_size", "n_acts")

    d_model: int = Field(175, ge=1)
    d_ff: int = Field(91, ge=1)
    n_heads: int = Field(7, ge=1)
    n_utterance_layers: int = Field(4, ge=0)
    n_context_layers: int = Field(6, ge=0)
    n_acts: int = Field(ge=1)


class SetPPConfig(HierPPConfig):
    """SET++ (Table 1): 4/-/3, H 91, 7 heads, E 175, 44-dim dialogue acts."""

    n_context_layers: int = Field(0, ge=0)


class HierJointConfig(HierConfig):
    """HIER-Joint: HIER's sizes (the paper gives none of its own) and three decoders.

    ``max_belief_len``/``max_act_len`` bound the greedy belief/act decoding that ``encode``
    runs at inference; ``oracle_annotations=True`` uses the batch's gold belief/act
    sequences instead (the paper's end-to-end setting predicts them).
    """

    max_belief_len: int = Field(50, ge=2)
    max_act_len: int = Field(50, ge=2)
    oracle_annotations: bool = False

    @field_validator("n_acts")
    @classmethod
    def _no_act_input(cls, n_acts: int | None) -> None:
        if n_acts is not None:
            raise ValueError("hier_joint predicts the dialogue acts; it takes no act vector")
        return None


def resolve_layout(
    layout: AttentionLayout, *, compiling: bool, cuda: bool, attention_dropout: bool
) -> AttentionLayout:
    """``layout``, or for ``auto`` the one to run: packed when eager (its grid sizes are
    read from the batch, a graph break under ``torch.compile``), else flex on CUDA where no
    attention dropout is in effect (FlexAttention has none), else masked."""
    if layout is not AttentionLayout.AUTO:
        return layout
    if not compiling:
        return AttentionLayout.PACKED
    return AttentionLayout.FLEX if cuda and not attention_dropout else AttentionLayout.MASKED


# --------------------------------------------------------------------------- encoder


class HTEncoder(nn.Module):
    """Hierarchical Transformer encoder: ``blocks.EncoderLayer``s under UT/CT masks.

    ``forward`` takes the masks explicitly (built once per batch by the caller with
    ``masks``), so the same stack runs any variant; a mask may also be given as the
    equivalent ``TokenGroups`` (module docstring). Local PE (``utt_pos``) is added to the
    embeddings, global PE (absolute position) before the first context layer. With no
    utterance layers (MAT) it is a plain encoder with a special mask, as the paper describes,
    over embeddings that still carry their local positions: the authors' code (``model.py``,
    ``ablation == 'MAT'``) skips the utterance encoder but not its ``pos_encoder``.
    """

    def __init__(
        self,
        embed: TokenEmbedding,
        dims: BlockDims,
        n_utterance_layers: int,
        n_context_layers: int,
    ) -> None:
        super().__init__()
        self.embed = embed
        self.positions = SinusoidalPositions(dims.d_model)
        self.utterance_layers = EncoderStack(n_utterance_layers, dims)
        self.context_layers = EncoderStack(n_context_layers, dims)
        self.dropout = nn.Dropout(dims.dropout)

    def forward(self, history: History, ut: EncoderAttention, ct: EncoderAttention) -> Tensor:
        """``[B, L, d_model]`` encodings of ``history``. ``ut``/``ct``: the UT/CT-masks
        ``[B, L, L]`` (True = may attend; ``None`` = no mask), as ``FlexMask``s, or their
        ``TokenGroups`` (then pad positions leave the stack as zeros)."""
        real = history.input_mask
        x = self.dropout(self.embed(history.input_ids) + self.positions(history.utt_pos))
        if len(self.utterance_layers):
            x = run_stack(self.utterance_layers, x, ut, real)
        return self.contextualise(x, ct, real)

    def contextualise(self, x: Tensor, ct: EncoderAttention, real: Tensor | None = None) -> Tensor:
        """The context stage alone: global PE then the context layers (identity if none);
        ``real`` ``[B, L]`` is needed when ``ct`` is token groups."""
        if not len(self.context_layers):
            return x
        x = self.dropout(x + self.positions.range(x.shape[1], x.device))
        return run_stack(self.context_layers, x, ct, real)


def run_stack(
    layers: nn.ModuleList, x: Tensor, attention: EncoderAttention, real: Tensor | None
) -> Tensor:
    """``layers`` over ``x`` ``[B, L, d]``: masked, or on the real tokens ``real`` ``[B, L]``
    when ``attention`` is given as token groups (zeros at padding on the way out)."""
    if attention is None or isinstance(attention, Tensor | FlexMask):
        return layers(x, attention)
    if real is None:
        raise ValueError("token-group attention needs the real-token mask `real`")
    tokens = x[real]
    for layer in layers:
        tokens = layer(tokens, groups=attention)
    return x.new_zeros(x.shape).masked_scatter_(real.unsqueeze(-1), tokens)


# --------------------------------------------------------------------------- models


@dataclass
class HierMemory:
    """What the decoder reads: encoder outputs ``states`` ``[B, Lm, d]``, their key mask
    ``mask`` ``[B, Lm]`` and an optional input offset ``act_offset`` ``[B, 1, d]`` (the
    embedded dialogue acts of HIER++/SET++) added to every decoder input embedding."""

    states: Tensor
    mask: Tensor
    act_offset: Tensor | None = None


class HierTransformer(Seq2SeqModel):
    """HT-Encoder + Transformer decoder (HIER, HIER-CLS, SET, MAT, HIER++, SET++)."""

    config: HierConfig

    def __init__(self, config: HierConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.decoder = self._decoder()
        self.encoder = HTEncoder(
            self.decoder.embed, c.block(), c.n_utterance_layers, c.n_context_layers
        )
        self.act_embed = xavier_(nn.Linear(c.n_acts, c.d_model)) if c.n_acts else None

    def _decoder(self) -> Decoder:
        c = self.config
        return Decoder(c.vocab_size, c.n_decoder_layers, c.block())

    def layout(self, history: History) -> AttentionLayout:
        """The layout this pass runs (``AttentionLayout``; ``auto`` resolved)."""
        return resolve_layout(
            self.config.attention_layout,
            compiling=torch.compiler.is_compiling(),
            cuda=on_gpu(history.input_ids),
            attention_dropout=self.training and self.config.attention_dropout_p > 0.0,
        )

    def attention(self, history: History) -> tuple[EncoderAttention, EncoderAttention]:
        """How the utterance and the context layers attend over ``history`` in this pass
        (:meth:`layout`); the packed layout has token groups for the HIER CT-mask only."""
        c = self.config
        layout = self.layout(history)
        ut: EncoderAttention = None
        ct: EncoderAttention = None
        if layout is AttentionLayout.FLEX:
            if c.n_utterance_layers:
                ut = masks.history_flex_mask(history, masks.utterance_mod(history))
            if c.n_context_layers:
                ct = masks.history_flex_mask(history, masks.context_mod(history, c.context_mask))
            return ut, ct
        packed = layout is AttentionLayout.PACKED
        if c.n_utterance_layers:
            ut = utterance_groups(history) if packed else masks.utterance_mask(history)
        if c.n_context_layers and packed and c.context_mask is ContextMask.HIER:
            ct = context_groups(history)
        elif c.n_context_layers:
            ct = masks.context_mask(history, c.context_mask)
        return ut, ct

    def encode_history(self, history: History) -> HierMemory:
        """Encoder outputs and the decoder's key mask (no act offset)."""
        states = self.encoder(history, *self.attention(history))
        return HierMemory(states, masks.memory_mask(history, self.config.memory_keys))

    def act_offset(self, batch: GenerateBatch) -> Tensor | None:
        """``[B, 1, d]`` embedded multi-hot acts (HIER++/SET++), or None without ``n_acts``."""
        if self.act_embed is None:
            return None
        n_acts = self.act_embed.in_features
        if batch.acts is None:
            raise ValueError(
                f"this model needs batch.acts (multi-hot dialogue acts [B, {n_acts}]) and the "
                "batch has none; use a corpus with acts (MultiWOZ) or build it with n_acts=None"
            )
        if batch.acts.shape[-1] != n_acts:
            raise ValueError(
                f"batch.acts has {batch.acts.shape[-1]} act dimensions, the model n_acts={n_acts}"
            )
        weight = self.act_embed.weight
        return self.act_embed(batch.acts.to(weight.dtype)).unsqueeze(1)

    def encode(self, batch: GenerateBatch) -> HierMemory:
        memory = self.encode_history(batch.history)
        memory.act_offset = self.act_offset(batch)
        return memory

    def decode(
        self, tokens: Tensor, memory: HierMemory, state: DecoderCache | None = None
    ) -> tuple[Tensor, DecoderCache | None]:  # type: ignore[override]
        logits = self.decoder(
            tokens, memory.states, memory.mask, cache=state, input_offset=memory.act_offset
        )
        return logits, state

    def init_state(self, memory: object, batch_size: int) -> DecoderCache:
        return self.decoder.init_cache()


def greedy_tokens(
    decoder: Decoder,
    memory: HierMemory,
    max_len: int,
    offset: Tensor | None = None,
) -> Tensor:
    """Greedy ``<bos> .. <eos>`` sequences ``[B, <= max_len]`` from ``decoder``; positions
    after a row's ``<eos>`` are padding."""
    batch_size = memory.states.shape[0]
    tokens = torch.full((batch_size, 1), BOS_ID, dtype=torch.long, device=memory.states.device)
    done = torch.zeros(batch_size, dtype=torch.bool, device=tokens.device)
    cache = decoder.init_cache()
    step = tokens
    while tokens.shape[1] < max_len and not bool(done.all()):
        logits = decoder(step, memory.states, memory.mask, cache=cache, input_offset=offset)
        step = logits[:, -1].argmax(-1, keepdim=True).masked_fill(done[:, None], PAD_ID)
        tokens = torch.cat([tokens, step], dim=1)
        done = done | (step[:, 0] == EOS_ID)
    return tokens


class HierJoint(HierTransformer):
    """HIER-Joint: one HT-Encoder, three decoders (belief state, dialogue act, response).

    Following the paper ("we pass the token embedding from the belief decoder and act
    decoder to the response decoder. Act decoder receives mean token embedding from the
    belief decoder too") and the authors' joint models: the act decoder's input embeddings
    get a linear map of the mean belief-token embedding (of the belief decoder's table);
    the response decoder cross-attends to the belief and act token embeddings (each with
    its decoder's positions) followed by the encoder outputs. The loss is the sum of the
    three mean token losses; ``nll_sum``/``n_tokens`` count the response only, so
    perplexity compares with the other generators.
    """

    config: HierJointConfig

    def __init__(self, config: HierJointConfig) -> None:
        super().__init__(config)
        c = config
        self.belief_decoder = self._decoder()
        self.act_decoder = self._decoder()
        self.belief_summary = xavier_(nn.Linear(c.d_model, c.d_model))

    def belief_offset(self, belief_ids: Tensor) -> Tensor:
        """``[B, 1, d]``: linear map of the mean embedding of the real belief tokens."""
        real = (belief_ids != PAD_ID).unsqueeze(-1)
        emb = self.belief_decoder.embed(belief_ids) * real
        mean = emb.sum(1) / real.sum(1).clamp(min=1)
        return self.belief_summary(mean).unsqueeze(1)

    def response_memory(
        self, encoded: HierMemory, belief_ids: Tensor, act_ids: Tensor
    ) -> HierMemory:
        """Belief and act token embeddings, then the encoder outputs, as one memory."""
        parts = []
        for decoder, ids in ((self.belief_decoder, belief_ids), (self.act_decoder, act_ids)):
            parts.append(decoder.embed(ids) + decoder.positions.range(ids.shape[1], ids.device))
        states = torch.cat([*parts, encoded.states], dim=1)
        mask = torch.cat([belief_ids != PAD_ID, act_ids != PAD_ID, encoded.mask], dim=1)
        return HierMemory(states, mask)

    @staticmethod
    def _gold(batch: GenerateBatch) -> tuple[Tensor, Tensor]:
        if batch.belief_ids is None or batch.act_ids is None:
            raise ValueError(
                "hier_joint trains on batch.belief_ids and batch.act_ids (belief state and "
                "dialogue acts as <bos> .. <eos> sequences); this batch lacks them (MultiWOZ "
                "provides them)"
            )
        return batch.belief_ids, batch.act_ids

    def encode(self, batch: GenerateBatch) -> HierMemory:
        """Encode the history, then obtain belief and acts (gold with
        ``oracle_annotations``, else greedily decoded) and build the response memory."""
        c = self.config
        encoded = self.encode_history(batch.history)
        if c.oracle_annotations:
            belief_ids, act_ids = self._gold(batch)
        else:
            belief_ids = greedy_tokens(self.belief_decoder, encoded, c.max_belief_len)
            offset = self.belief_offset(belief_ids)
            act_ids = greedy_tokens(self.act_decoder, encoded, c.max_act_len, offset)
        return self.response_memory(encoded, belief_ids, act_ids)

    def loss(self, batch: GenerateBatch) -> LossOutput:
        belief_ids, act_ids = self._gold(batch)
        encoded = self.encode_history(batch.history)
        logits = self.belief_decoder(belief_ids[:, :-1], encoded.states, encoded.mask)
        belief = token_loss(logits, belief_ids[:, 1:], belief_ids[:, 1:] != PAD_ID)
        logits = self.act_decoder(
            act_ids[:, :-1],
            encoded.states,
            encoded.mask,
            input_offset=self.belief_offset(belief_ids),
        )
        act = token_loss(logits, act_ids[:, 1:], act_ids[:, 1:] != PAD_ID)
        memory = self.response_memory(encoded, belief_ids, act_ids)
        logits, _ = self.decode(batch.target_ids[:, :-1], memory)
        response = token_loss(logits, batch.target_ids[:, 1:], batch.target_mask[:, 1:])
        return LossOutput(
            loss=belief.loss + act.loss + response.loss,
            nll_sum=response.nll_sum,
            n_tokens=response.n_tokens,
            terms={
                "belief": belief.loss.detach(),
                "act": act.loss.detach(),
                "response": response.loss.detach(),
            },
        )


# --------------------------------------------------------------------------- registry


def _register(name: str, config_cls: type[HierConfig], cls: type, **preset: Any) -> None:
    register(name, Task.GENERATE, config_cls, **preset)(cls)


_register("hier", HierConfig, HierTransformer)
_register(
    "hier_cls",
    HierPPConfig,
    HierTransformer,
    context_mask=ContextMask.CLS,
    memory_keys=MemoryKeys.FIRST_TOKENS,
)
_register("set", SetConfig, HierTransformer, n_context_layers=0)
_register("mat", MatConfig, HierTransformer, n_utterance_layers=0)
_register("hier_pp", HierPPConfig, HierTransformer)
_register("set_pp", SetPPConfig, HierTransformer, n_context_layers=0)
_register("hier_joint", HierJointConfig, HierJoint)
