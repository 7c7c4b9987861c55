"""What every model offers the training loop, the decoder and the evaluator.

Three task kinds (DESIGN.md): ``generate`` models are encoder-decoders driven by one
``generate()``; ``select`` models score candidates; ``lm`` models score documents.
Every model returns a ``LossOutput`` from ``loss(batch)`` so one training loop fits all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, Self, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from pipeline.data.batch import GenerateBatch, LMBatch, SelectBatch
from pipeline.models.latent import LatentNLL
from pipeline.names import Task


class ModelConfig(BaseModel):
    """Base of every model's hyper-parameters: frozen, unknown fields rejected.

    Subclasses set their paper's sizes as defaults and validate cross-field constraints
    in ``model_validator``s that raise ``ValueError`` naming the field. ``DATA_FIELDS``
    are the fields ``registry.make_config`` fills from :class:`DataSizes` (params may not
    set them).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    DATA_FIELDS: ClassVar[tuple[str, ...]] = ("vocab_size",)

    vocab_size: int


RESIDUAL_INIT_GAIN = 0.01
"""The default Xavier gain of a residual branch's output projection: every branch starts
near zero, each layer near the identity. The papers initialise with plain Xavier (gain 1)."""


@dataclass(frozen=True)
class BlockDims:
    """The sizes and dropouts of one Transformer layer, the one value every shared block
    takes (as nanoGPT's ``Block(config)``): width, heads, FFN width, dropout of embeddings,
    residual branches and FFN, per-head size (``None``: ``d_model // n_heads``), congruent
    attention (W_q = W_k) and the attention-probability dropout (``None``: ``dropout``).

    The language models' recipe (``TransformerLMConfig``) sets the dropout of each site on
    its own, ``None`` meaning ``dropout``: ``input_dropout`` (embeddings + positions, where
    a ``stack.Stack`` adds them), ``attention_output_dropout`` (the attention branch
    before its residual add), ``ffn_dropout`` (the FFN's inner activation and its branch),
    ``qkv_dropout`` (the query, key and value projections; 0: none, no call at all);
    ``locked``: their masks are one per sequence (``models.dropout.SiteDropout``).
    ``residual_gain``: the Xavier gain of each residual branch's output projection (the
    attention's W_O, the FFN's outer layer; ``AttentionModelConfig.residual_init_gain``)."""

    d_model: int
    n_heads: int
    d_ff: int
    dropout: float = 0.1
    d_head: int | None = None
    congruent: bool = False
    attention_dropout: float | None = None
    locked: bool = False
    input_dropout: float | None = None
    attention_output_dropout: float | None = None
    ffn_dropout: float | None = None
    qkv_dropout: float = 0.0
    residual_gain: float = RESIDUAL_INIT_GAIN

    @property
    def attention_dropout_p(self) -> float:
        """The attention-probability dropout in effect."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def input_p(self) -> float:
        """The dropout in effect at the input."""
        return self.dropout if self.input_dropout is None else self.input_dropout

    @property
    def attention_output_p(self) -> float:
        """The dropout in effect on the attention branch."""
        p = self.attention_output_dropout
        return self.dropout if p is None else p

    @property
    def ffn_p(self) -> float:
        """The dropout in effect in the FFN and on its branch."""
        return self.dropout if self.ffn_dropout is None else self.ffn_dropout


class AttentionModelConfig(ModelConfig):
    """The block dimensions and dropout of the Transformer-family models.

    ``d_model`` is the width, ``n_heads`` the heads, ``d_head`` (where the config has it)
    the per-head key/value size: ``None`` means ``d_model // n_heads``, and then the heads
    must divide the width; the check is here, once, for every Transformer-family config.
    ``dropout`` is applied to embeddings, residual branches and the FFN; attention
    probabilities get ``attention_dropout`` (``None``, the papers' setting: ``dropout``).
    ``attention_dropout: 0`` keeps CPU attention on PyTorch's fused kernel, whose
    dropout-free path trains ~1.18x faster (bench/RESULTS.md).
    """

    d_model: int = Field(ge=1)
    n_heads: int = Field(ge=1)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    attention_dropout: float | None = Field(None, ge=0.0, lt=1.0)
    residual_init_gain: float = Field(
        RESIDUAL_INIT_GAIN,
        gt=0.0,
        le=1.0,
        description="Xavier gain of each residual branch's output projection (attention "
        "W_O, FFN outer): 0.01 starts every branch near zero; 1 is the papers' plain Xavier, "
        "under which an encoder-decoder's cross-attention carries the history from the "
        "first step (at 0.01 a small one's encoder collapses to one vector: README)",
    )

    @model_validator(mode="after")
    def _heads_fit_width(self) -> Self:
        head_size(self.d_model, self.n_heads, getattr(self, "d_head", None))
        return self

    @property
    def head_size(self) -> int:
        """The per-head key/value size in effect."""
        return head_size(self.d_model, self.n_heads, getattr(self, "d_head", None))

    @property
    def attention_dropout_p(self) -> float:
        """The attention-probability dropout in effect."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    def block(self, **changes: Any) -> BlockDims:
        """The dims of this config's main Transformer layers (``d_ff``, ``d_head`` and
        ``congruent`` where the config has them), with ``changes``."""
        dims = BlockDims(
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_ff=getattr(self, "d_ff", 4 * self.d_model),
            dropout=self.dropout,
            d_head=getattr(self, "d_head", None),
            congruent=getattr(self, "congruent", False),
            attention_dropout=self.attention_dropout,
            residual_gain=self.residual_init_gain,
        )
        return dataclasses.replace(dims, **changes)


class TransformerLMConfig(AttentionModelConfig):
    """A Transformer language model's config with the regularisers of the Transformer-XL PTB
    recipe (github ischlag/Fast-Weight-Memory-public, ``language-modelling/
    transformer_xl_ptb/``; DESIGN.md, "The language models' regularisers"). All off by
    default: the plain model, bit for bit. Each ``*_dropout`` site left ``None`` takes
    ``dropout``; with ``locked_dropout`` its mask is one per sequence."""

    locked_dropout: bool = Field(
        False,
        description="one dropout mask per sequence ([B, 1, d]) at the input, attention-output, "
        "FFN and output sites (AWD's LockedDropout), instead of one per position",
    )
    input_dropout: float | None = Field(
        None, ge=0.0, lt=1.0, description="token embeddings + positions (null: dropout)"
    )
    attention_output_dropout: float | None = Field(
        None, ge=0.0, lt=1.0, description="the attention branch before its residual add"
    )
    ffn_dropout: float | None = Field(
        None, ge=0.0, lt=1.0, description="the FFN's inner activation and its branch"
    )
    qkv_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="the query, key and value projections of every attention layer (theirs: "
        "--dropouta, locked; transformer_xl.py l. 80-83); 0: none",
    )
    output_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="the final hidden states, before the output projection"
    )
    embedding_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="word types: whole embedding rows dropped per step"
    )
    ar_alpha: float = Field(
        0.0, ge=0.0, description="activation regularisation: alpha * mean(h^2), training only"
    )
    tar_beta: float = Field(
        0.0,
        ge=0.0,
        description="temporal activation regularisation: beta * mean((h_t - h_{t-1})^2)",
    )

    def block(self, **changes: Any) -> BlockDims:
        """The block dims, with this config's dropout sites (``changes`` override them)."""
        sites = {
            "locked": self.locked_dropout,
            "input_dropout": self.input_dropout,
            "attention_output_dropout": self.attention_output_dropout,
            "ffn_dropout": self.ffn_dropout,
            "qkv_dropout": self.qkv_dropout,
        }
        return super().block(**{**sites, **changes})


def on_gpu(where: Tensor | torch.device) -> bool:
    """Whether ``where`` (a tensor, or a device) is on a CUDA GPU: the models' one test of
    the device, for the kernel a pass takes (static shapes where host reads stall the
    stream, ``stack.static_shapes``; FlexAttention, whose kernels and backward are CUDA's,
    ``flex``, ``hier.resolve_layout``). Every other device decision is the run's
    ``pipeline.execution.ExecutionPolicy``; on the CPU a pass is the plain eager one."""
    device = where.device if isinstance(where, Tensor) else where
    return device.type == "cuda"


def head_size(width: int, n_heads: int, d_head: int | None = None, field: str = "n_heads") -> int:
    """``d_head`` if given, else ``width // n_heads``, which needs the heads to divide the
    width: a ``ValueError`` naming ``field`` (and what to do) otherwise."""
    if d_head is not None:
        return d_head
    if width % n_heads:
        raise ValueError(
            f"{field}: {n_heads} heads do not divide the width {width}; pick a divisor "
            "(or, where the config has one, set d_head)"
        )
    return width // n_heads


@dataclass
class LossOutput:
    """What one forward pass on a batch yields.

    ``loss`` is what is back-propagated (mean over counted targets, plus any extra terms
    such as a KL divergence). ``nll_sum``/``n_tokens`` are the summed token negative
    log-likelihood and the number of tokens it counts (for perplexity; for ``select``
    models the summed per-example loss and the number of examples). ``terms`` holds named
    scalar components for logging (``{"kl": ...}``).
    """

    loss: Tensor
    nll_sum: Tensor
    n_tokens: Tensor
    terms: dict[str, Tensor] = field(default_factory=dict)


def select_batch_dim(value: object, index: Tensor) -> object:
    """``index_select`` along dim 0 for a tensor, or recursively for lists/tuples/dataclasses
    of tensors; anything else is returned unchanged. Used to expand and reorder beams."""
    if isinstance(value, Tensor):
        return value.index_select(0, index)
    if isinstance(value, list | tuple):
        return type(value)(select_batch_dim(v, index) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value,  # type: ignore[arg-type]
            **{
                f.name: select_batch_dim(getattr(value, f.name), index)
                for f in dataclasses.fields(value)
                if f.init
            },
        )
    return value


@runtime_checkable
class DecoderState(Protocol):
    """Anything a decoder carries between steps (KV caches, RNN hidden states)."""

    def select(self, index: Tensor) -> DecoderState:
        """Keep/reorder batch rows (beam search); returns the selected state."""
        ...


class TaskModel(nn.Module):
    """What every registered model is: a module for one ``task``, built from its
    ``config``.

    ``supports_compile``: False where torch.compile cannot pay (RNNs, data-dependent
    recurrences): ``compile: auto`` then trains the model eagerly
    (``execution.policy.compiles``), and the params check refuses ``compile: on`` for it
    with the class's ``eager_reason``.
    """

    task: ClassVar[Task]
    supports_compile: ClassVar[bool] = True
    config: ModelConfig

    def token_embedding(self) -> nn.Parameter | None:
        """The weight of the model's one token embedding (and of the output projection
        tied to it), which ``optimizer.embedding_lr_multiplier`` trains at a rate of its
        own; None where the model has no single token embedding."""
        return None


class Seq2SeqModel(TaskModel):
    """An encoder-decoder response generator.

    Subclasses implement ``encode``, ``decode`` and may override ``init_state`` (to enable
    incremental decoding) and ``loss`` (to add terms). ``memory`` is any tensor/dataclass
    tree whose tensors are batch-first (reordered with ``select_batch_dim``).
    """

    task = Task.GENERATE

    def encode(self, batch: GenerateBatch) -> object:
        raise NotImplementedError

    def decode(
        self, tokens: Tensor, memory: object, state: DecoderState | None = None
    ) -> tuple[Tensor, DecoderState | None]:
        """Logits ``[B, t, V]`` for ``tokens`` ``[B, t]``.

        With ``state=None`` ``tokens`` is the whole prefix (teacher forcing). With a state
        from ``init_state``, ``tokens`` holds only the new positions and the returned state
        includes them.
        """
        raise NotImplementedError

    def init_state(self, memory: object, batch_size: int) -> DecoderState | None:
        """A fresh incremental-decoding state, or ``None`` if the model re-decodes the
        whole prefix each step."""
        return None

    def loss(self, batch: GenerateBatch) -> LossOutput:
        memory = self.encode(batch)
        logits, _ = self.decode(batch.target_ids[:, :-1], memory)
        return token_loss(logits, batch.target_ids[:, 1:], batch.target_mask[:, 1:])


@runtime_checkable
class LatentVariableModel(Protocol):
    """A generate model whose likelihood integrates over latents (VHRED, VHCR): its test
    NLL is ``latent_nll`` (importance-sampled, ``pipeline.models.latent``), never teacher
    forcing on one latent draw."""

    def latent_nll(self, batch: GenerateBatch, n_samples: int, seed: int) -> LatentNLL: ...


class SelectModel(TaskModel):
    """Scores candidates for a context: ``score(batch) -> [B, N]`` logits."""

    task = Task.SELECT

    def score(self, batch: SelectBatch) -> Tensor:
        raise NotImplementedError

    def loss(self, batch: SelectBatch) -> LossOutput:
        real = batch.candidate_mask.any(-1)
        return example_loss(candidate_bce(self.score(batch), batch.labels, real))


def candidate_bce(logits: Tensor, labels: Tensor, real: Tensor | None = None) -> Tensor:
    """The selection task's loss, per example ``[B]``: binary cross-entropy of each REAL
    candidate's logit against its label, averaged over the example's real candidates
    (``real`` ``[B, N]``; None: all are). The one definition training, validation, test and
    tuning use: the padded slots of an example with fewer candidates are no candidates."""
    bce = nn.functional.binary_cross_entropy_with_logits(
        logits.float(), labels.float(), reduction="none"
    )
    if real is None:
        return bce.mean(-1)
    return (bce * real).sum(-1) / real.sum(-1).clamp(min=1)


def example_loss(per_example: Tensor) -> LossOutput:
    """A select batch's ``LossOutput`` from its per-example losses ``[B]``: the mean is
    back-propagated; ``nll_sum``/``n_tokens`` count examples (the evaluation unit)."""
    return LossOutput(
        loss=per_example.mean(),
        nll_sum=per_example.sum().detach(),
        n_tokens=torch.tensor(per_example.numel(), device=per_example.device),
    )


@dataclass(frozen=True)
class TokenScores:
    """A language model's pass over a batch: ``nll`` ``[B, S, Ls]`` (0 at padding) and, for
    the activation regularisers, the final hidden states ``hidden`` ``[..., L, d]`` (before
    any output dropout) with ``hidden_mask`` ``[..., L]``, True where a position predicts a
    scored token (``LMBatch.scored_mask``: a stream window's context is not regularised, as
    the Transformer-XL PTB code regularises its target positions only); consecutive
    positions of a row are consecutive in time."""

    nll: Tensor
    hidden: Tensor | None = None
    hidden_mask: Tensor | None = None


class LanguageModel(TaskModel):
    """Scores documents; ``token_nll(batch)`` gives ``[B, S, Ls]`` NLL of each sentence token
    (0 at padding) so flat and hierarchical models are compared on the same tokens.

    A model implements ``token_nll``, or ``score_tokens`` (and ``token_nll`` from it) to give
    ``loss`` the hidden states that AR/TAR (``TransformerLMConfig``) regularise.
    ``stream_unit``: what an evaluation streamed over the test text (``eval.language``)
    slides its window by, tokens or whole sentences.
    """

    task = Task.LM
    stream_unit: ClassVar[Literal["tokens", "sentences"]] = "tokens"

    def token_nll(self, batch: LMBatch) -> Tensor:
        raise NotImplementedError

    def score_tokens(self, batch: LMBatch) -> TokenScores:
        """``token_nll`` and, where the model gives them, its final hidden states."""
        return TokenScores(self.token_nll(batch))

    def loss(self, batch: LMBatch) -> LossOutput:
        """Mean NLL of the scored tokens (every real token; in a stream window those after
        its context: ``LMBatch.scored_mask``); in training plus AR and TAR where the config
        sets them (logged as ``terms`` ``ar``/``tar``, never part of ``nll_sum``), over
        the hidden states of scored positions."""
        scores = self.score_tokens(batch)
        scored = batch.scored_mask()
        n = scored.sum()
        total = (scores.nll * scored).sum()
        loss = total / n.clamp(min=1)
        terms: dict[str, Tensor] = {}
        if self.training and isinstance(self.config, TransformerLMConfig):
            terms = activation_terms(scores, self.config.ar_alpha, self.config.tar_beta)
        for term in terms.values():
            loss = loss + term
        terms = {name: term.detach() for name, term in terms.items()}
        return LossOutput(loss=loss, nll_sum=total.detach(), n_tokens=n, terms=terms)


def activation_terms(scores: TokenScores, ar_alpha: float, tar_beta: float) -> dict[str, Tensor]:
    """AR and TAR (Merity et al. 2017) over the real positions of ``scores.hidden``, in float32:
    ``ar`` = ``ar_alpha`` x the mean of h^2 over real positions and features; ``tar`` =
    ``tar_beta`` x the mean of (h_t - h_{t-1})^2 over pairs of consecutive real positions.
    Both on the hidden states before output dropout, as the Transformer-XL PTB code has
    them (``train.py`` l. 370-376 on ``transformer_xl.py`` l. 356's undropped ``hidden``;
    AWD-LSTM puts AR on the dropped ones). Only the terms with a non-zero weight."""
    if not (ar_alpha or tar_beta):
        return {}
    if scores.hidden is None or scores.hidden_mask is None:
        raise ValueError("AR/TAR need the model's hidden states: implement score_tokens")
    hidden, mask = scores.hidden.float(), scores.hidden_mask
    width = hidden.shape[-1]
    terms = {}
    if ar_alpha:
        real = mask.unsqueeze(-1).float()
        terms["ar"] = ar_alpha * (hidden.pow(2) * real).sum() / (real.sum() * width).clamp(min=1)
    if tar_beta:
        pairs = (mask[..., 1:] & mask[..., :-1]).unsqueeze(-1).float()
        step = hidden[..., 1:, :] - hidden[..., :-1, :]
        terms["tar"] = tar_beta * (step.pow(2) * pairs).sum() / (pairs.sum() * width).clamp(min=1)
    return terms


def masked_token_nll(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Per-token cross-entropy ``[..., L]`` (float32), zero where ``mask`` is False."""
    nll = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none"
    )
    return nll.view_as(targets) * mask


def token_loss(logits: Tensor, targets: Tensor, mask: Tensor) -> LossOutput:
    """Mean cross-entropy over ``mask``ed target tokens."""
    nll = masked_token_nll(logits, targets, mask)
    n = mask.sum()
    total = nll.sum()
    return LossOutput(loss=total / n.clamp(min=1), nll_sum=total.detach(), n_tokens=n)


def count_parameters(module: nn.Module) -> int:
    """Number of distinct trainable parameters (shared tensors counted once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
