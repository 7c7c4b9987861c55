"""The RNN baselines of the U-Net Transformer paper: S2SA, HRED, VHRED and VHCR.

- ``s2sa``: a GRU encoder-decoder over the flat history whose attention is the shared
  ``layers.MultiHeadAttention`` (8 heads x 64, as the paper's Transformer), Luong-style:
  the decoder GRU's output attends the encoder states and ``tanh(W[h; ctx])`` predicts.
- ``hred`` (Serban et al., 2016): utterance GRU -> context GRU over utterance encodings ->
  GRU decoder conditioned on the context state (initial hidden state and, unless
  ``condition_inputs=False``, every input).
- ``vhred`` (Serban et al., 2017): HRED + a Gaussian latent per response (prior from the
  context, posterior from context + response), KL annealed linearly.
- ``vhcr`` (Park et al., 2018): VHRED + a conversation latent inferred by a bidirectional
  GRU over the utterance encodings, which also conditions the context GRU, and
  utterance drop (a learned unknown-utterance vector replaces encodings in training).

Every model decodes incrementally through an ``RNNState`` so one ``generate()`` drives
them; latents are sampled once in ``encode`` (part of the memory), so beams share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.data.batch import GenerateBatch, History
from pipeline.data.special import PAD_ID
from pipeline.models.base import (
    LossOutput,
    Seq2SeqModel,
    masked_token_nll,
    token_loss,
)
from pipeline.models.latent import (
    Gaussian,
    GaussianNet,
    LatentNLL,
    RowNoise,
    importance_estimates,
    standard_normal_log_prob,
)
from pipeline.models.layers import MultiHeadAttention, padding_mask
from pipeline.models.recurrent import (
    ConditionedDecoder,
    ContextMemory,
    FlatMemory,
    RNNConfig,
    RNNState,
    UtteranceEncoder,
    run_gru,
)
from pipeline.models.registry import register
from pipeline.models.utterances import split_utterances
from pipeline.names import Task

# The seed of validation's posterior draws: validation numbers repeat exactly.
VALIDATION_SEED = 0

# --------------------------------------------------------------------------- configs


class S2SAConfig(RNNConfig):
    """S2SA: the attention has the structure of the paper's Transformer attention
    (8 heads, key/value size 64 per head)."""

    n_heads: int = Field(default=8, ge=1)
    d_head: int = Field(default=64, ge=1)


class HREDConfig(RNNConfig):
    """HRED: ``d_context`` is the context GRU's width (256 in the paper).
    ``condition_inputs=False`` conditions the decoder through its initial state only, as
    the U-Net authors' baselines do (text-machine-lab/HierarchicalTransformer,
    ``model/models.py``: ``decoder(target, init_h=context2decoder(context))``)."""

    d_context: int = Field(default=256, ge=1)
    condition_inputs: bool = True


class VHREDConfig(HREDConfig):
    """VHRED: ``d_latent`` (100) and ``kl_anneal_steps`` (25,000: the KL weight rises
    linearly from 0 to 1 over that many training steps; 0 = always 1) follow the VHCR
    code. ``sample_latent=False`` decodes with the prior's mean instead of a sample
    (deterministic generation, e.g. for tests)."""

    d_latent: int = Field(default=100, ge=1)
    kl_anneal_steps: int = Field(default=25000, ge=0)
    sample_latent: bool = True


class VHCRConfig(VHREDConfig):
    """VHCR: ``d_conv_latent`` (100) is the conversation latent; ``utterance_drop``
    (0.25, the VHCR authors' setting) the probability of replacing an utterance encoding
    by the learned unknown-utterance vector during training."""

    d_conv_latent: int = Field(default=100, ge=1)
    utterance_drop: float = Field(default=0.25, ge=0.0, le=1.0)


# --------------------------------------------------------------------------- S2SA


@register("s2sa", Task.GENERATE, S2SAConfig)
class S2SA(Seq2SeqModel):
    """GRU sequence-to-sequence model with multi-head attention over the flat history."""

    supports_compile: ClassVar[bool] = False  # GRUs (``recurrent``, "Compiling")
    eager_reason: ClassVar[str] = (
        "it runs nn.GRU, which torch.compile does not trace, on packed sequences whose "
        "lengths are read on the host (pipeline/models/recurrent.py)"
    )

    def __init__(self, config: S2SAConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_embed, padding_idx=PAD_ID)
        self.encoder = UtteranceEncoder(self.embed, config)
        h, layers = config.d_hidden, config.n_layers
        self.bridge = nn.Linear(self.encoder.d_out, layers * h)
        self.gru = nn.GRU(
            config.d_embed,
            h,
            layers,
            batch_first=True,
            dropout=config.dropout if layers > 1 else 0.0,
        )
        self.attention = MultiHeadAttention(
            h, config.n_heads, config.d_head, d_kv=self.encoder.d_out, dropout=config.dropout
        )
        self.combine = nn.Linear(2 * h, h)
        self.dropout = nn.Dropout(config.dropout)
        self.output = nn.Linear(h, config.vocab_size)

    def encode(self, batch: GenerateBatch) -> FlatMemory:
        history = batch.history
        states, final = self.encoder(history.input_ids, history.input_mask)
        hidden = torch.tanh(self.bridge(final)).view(-1, self.config.n_layers, self.config.d_hidden)
        return FlatMemory(states, history.input_mask, hidden)

    def init_state(self, memory: object, batch_size: int) -> RNNState:
        assert isinstance(memory, FlatMemory)
        return RNNState(memory.hidden)

    def decode(
        self, tokens: Tensor, memory: object, state: RNNState | None = None
    ) -> tuple[Tensor, RNNState]:
        assert isinstance(memory, FlatMemory)
        hidden = memory.hidden if state is None else state.hidden
        out, h = self.gru(self.dropout(self.embed(tokens)), hidden.transpose(0, 1).contiguous())
        # No input feeding: the attention reads the GRU output, so teacher forcing runs
        # the GRU over the whole target at once.
        context = self.attention(out, memory.states, mask=padding_mask(memory.mask))
        attentional = torch.tanh(self.combine(torch.cat([out, context], -1)))
        return self.output(self.dropout(attentional)), RNNState(h.transpose(0, 1))


# --------------------------------------------------------------------------- HRED family


@register("hred", Task.GENERATE, HREDConfig)
class HRED(Seq2SeqModel):
    """Hierarchical recurrent encoder-decoder."""

    config: HREDConfig
    supports_compile: ClassVar[bool] = False  # GRUs (``recurrent``, "Compiling")
    eager_reason: ClassVar[str] = (
        "it runs nn.GRU, which torch.compile does not trace, on packed sequences whose "
        "lengths are read on the host (pipeline/models/recurrent.py)"
    )

    def __init__(self, config: HREDConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_embed, padding_idx=PAD_ID)
        self.encoder = UtteranceEncoder(self.embed, config)
        self.context_rnn = nn.GRU(
            self.encoder.d_out + self._context_extra(),
            config.d_context,
            config.n_layers,
            batch_first=True,
            dropout=config.dropout if config.n_layers > 1 else 0.0,
        )
        self.decoder = ConditionedDecoder(
            self.embed, config, self._cond_size(), config.condition_inputs
        )

    def _context_extra(self) -> int:
        """Extra input width of the context GRU (VHCR feeds it the conversation latent)."""
        return 0

    def _cond_size(self) -> int:
        return self.config.d_context

    def encode_utterances(self, history: History) -> tuple[Tensor, Tensor]:
        """Utterance encodings ``[B, U, d]`` (0 at padding) and ``utt_mask`` ``[B, U]``."""
        utt = split_utterances(history)
        ids, mask, utt_mask = utt.ids, utt.mask, utt.utt_mask
        b, u = utt_mask.shape
        _, final = self.encoder(ids[utt_mask], mask[utt_mask])
        encodings = final.new_zeros(b, u, final.shape[-1])
        encodings[utt_mask] = final
        return encodings, utt_mask

    def encode_response(self, batch: GenerateBatch) -> Tensor:
        """The response encoded by the utterance encoder ``[B, d]`` (for posteriors)."""
        return self.encoder(batch.target_ids, batch.target_mask)[1]

    def context(self, encodings: Tensor, utt_mask: Tensor) -> Tensor:
        """Final context-GRU state ``[B, d_context]`` over the utterance encodings."""
        return run_gru(self.context_rnn, encodings, utt_mask.sum(1))[1]

    def encode(self, batch: GenerateBatch) -> ContextMemory:
        encodings, utt_mask = self.encode_utterances(batch.history)
        return ContextMemory(self.context(encodings, utt_mask))

    def init_state(self, memory: object, batch_size: int) -> RNNState:
        assert isinstance(memory, ContextMemory)
        return self.decoder.init_state(memory.cond)

    def decode(
        self, tokens: Tensor, memory: object, state: RNNState | None = None
    ) -> tuple[Tensor, RNNState]:
        assert isinstance(memory, ContextMemory)
        return self.decoder(tokens, memory.cond, state)


@dataclass
class LatentDraw:
    """One posterior draw of a model's latents: the decoder's condition, ``log p(z | x) -
    log q(z | x, y)`` ``[B]`` at the draw, the analytic ``KL(q || p)`` ``[B]`` and the
    KL terms to log."""

    cond: Tensor
    log_ratio: Tensor
    kl: Tensor
    terms: dict[str, Tensor]


@register("vhred", Task.GENERATE, VHREDConfig)
class VHRED(HRED):
    """HRED with a latent variable per response; trained on the annealed ELBO.

    Training: ``loss = (rec + w * KL) / n_tokens`` with z drawn from the posterior, the
    annealing weight ``w = min(1, step / kl_anneal_steps)`` and ``nll_sum`` the
    reconstruction NLL. The training loop owns the schedule: it sets the step before every
    training forward (``on_train_step``, from its checkpointed progress, so a resumed run
    continues the schedule exactly); ``loss`` only reads it and changes no state.
    Evaluation mode (validation): the negative ELBO at weight 1 from one seeded posterior
    draw, ``nll_sum = rec + KL``. Test: :meth:`latent_nll`, importance-sampled
    (``pipeline.models.latent``). ``encode`` (generation) samples the prior.
    """

    config: VHREDConfig
    kl_step: Tensor

    def __init__(self, config: VHREDConfig) -> None:
        super().__init__(config)
        c = config
        self.prior = GaussianNet(c.d_context + self._latent_extra(), c.d_context, c.d_latent)
        self.posterior = GaussianNet(
            c.d_context + self.encoder.d_out + self._latent_extra(), c.d_context, c.d_latent
        )
        self.register_buffer("kl_step", torch.zeros((), dtype=torch.long))

    def _latent_extra(self) -> int:
        """Extra conditioning width of the utterance latent's prior/posterior (VHCR: z_conv)."""
        return 0

    def _cond_size(self) -> int:
        return self.config.d_context + self.config.d_latent

    def on_train_step(self, step: int, epoch: int) -> None:
        """The loop's step: where the KL annealing schedule stands."""
        self.kl_step.fill_(step)

    def kl_weight(self) -> Tensor:
        """Current KL annealing weight ``min(1, kl_step / kl_anneal_steps)``."""
        steps = self.config.kl_anneal_steps
        if steps == 0:
            return torch.ones((), device=self.kl_step.device)
        return (self.kl_step.float() / steps).clamp(max=1.0)

    def _draw(self, dist: Gaussian, sample: bool) -> Tensor:
        return dist.sample() if sample else dist.mean

    def encode(self, batch: GenerateBatch) -> ContextMemory:
        encodings, utt_mask = self.encode_utterances(batch.history)
        context = self.context(encodings, utt_mask)
        z = self._draw(self.prior(context), self.config.sample_latent)
        return ContextMemory(torch.cat([context, z], -1))

    def _inference_inputs(self, batch: GenerateBatch) -> tuple[Tensor, ...]:
        """What every posterior draw of ``batch`` shares (computed once per batch)."""
        encodings, utt_mask = self.encode_utterances(batch.history)
        return self.context(encodings, utt_mask), self.encode_response(batch)

    def _posterior_draw(self, inputs: tuple[Tensor, ...], noise: RowNoise | None) -> LatentDraw:
        context, response = inputs
        prior = self.prior(context)
        posterior = self.posterior(torch.cat([context, response], -1))
        z = posterior.sample(noise)
        log_ratio = prior.log_prob(z) - posterior.log_prob(z)
        return LatentDraw(torch.cat([context, z], -1), log_ratio, posterior.kl(prior), {})

    def _response_nll(self, batch: GenerateBatch, cond: Tensor) -> Tensor:
        """``-log p(y | x, z)`` of each response ``[B]`` (float32) under teacher forcing."""
        logits, _ = self.decoder(batch.target_ids[:, :-1], cond, None)
        return masked_token_nll(logits, batch.target_ids[:, 1:], batch.target_mask[:, 1:]).sum(-1)

    def loss(self, batch: GenerateBatch) -> LossOutput:
        inputs = self._inference_inputs(batch)
        noise = None if self.training else RowNoise.for_batch(VALIDATION_SEED, batch)
        draw = self._posterior_draw(inputs, noise)
        logits, _ = self.decoder(batch.target_ids[:, :-1], draw.cond, None)
        rec = token_loss(logits, batch.target_ids[:, 1:], batch.target_mask[:, 1:])
        weight = self.kl_weight() if self.training else torch.ones_like(rec.loss)
        kl_sum = draw.kl.sum()
        n = rec.n_tokens.clamp(min=1)
        return LossOutput(
            loss=rec.loss + weight * kl_sum / n,
            nll_sum=rec.nll_sum if self.training else rec.nll_sum + kl_sum,
            n_tokens=rec.n_tokens,
            terms={
                "nll": rec.loss.detach(),
                "kl": draw.kl.mean().detach(),
                "kl_weight": weight.detach(),
                **draw.terms,
            },
        )

    @torch.no_grad()
    def latent_nll(self, batch: GenerateBatch, n_samples: int, seed: int) -> LatentNLL:
        """Each response's NLL importance-sampled from ``n_samples`` posterior draws, and
        the negative ELBO of those draws; seeded per example by ``seed``. Eval mode."""
        if n_samples < 1:
            raise ValueError(f"n_samples: need at least one importance sample, got {n_samples}")
        inputs = self._inference_inputs(batch)
        noise = RowNoise.for_batch(seed, batch)
        log_weights = []
        for _ in range(n_samples):
            draw = self._posterior_draw(inputs, noise)
            log_weights.append(draw.log_ratio.float() - self._response_nll(batch, draw.cond))
        return importance_estimates(torch.stack(log_weights))


@register("vhcr", Task.GENERATE, VHCRConfig)
class VHCR(VHRED):
    """VHRED with a conversation latent and utterance drop.

    The conversation posterior reads the utterance encodings (history and, in ``loss``,
    the response) with a bidirectional GRU; its prior is N(0, I). At generation time
    ``z_conv`` comes from the posterior over the history (as the VHCR authors generate).
    The context GRU reads ``[utterance encoding; z_conv]``; the utterance latent's prior
    and posterior and the decoder are conditioned on ``z_conv`` too.
    """

    config: VHCRConfig

    def __init__(self, config: VHCRConfig) -> None:
        super().__init__(config)
        c = config
        self.conv_rnn = nn.GRU(
            self.encoder.d_out, c.d_context, batch_first=True, bidirectional=True
        )
        self.conv_posterior = GaussianNet(2 * c.d_context, c.d_context, c.d_conv_latent)
        self.unk_utterance = nn.Parameter(torch.randn(self.encoder.d_out) * 0.1)

    def _context_extra(self) -> int:
        return self.config.d_conv_latent

    def _latent_extra(self) -> int:
        return self.config.d_conv_latent

    def _cond_size(self) -> int:
        c = self.config
        return c.d_context + c.d_latent + c.d_conv_latent

    def drop_utterances(self, encodings: Tensor, utt_mask: Tensor) -> Tensor:
        """Training only: each real utterance encoding becomes ``unk_utterance`` with
        probability ``utterance_drop``."""
        if not self.training or self.config.utterance_drop == 0.0:
            return encodings
        drop = utt_mask & (
            torch.rand(utt_mask.shape, device=utt_mask.device) < (self.config.utterance_drop)
        )
        return torch.where(drop[..., None], self.unk_utterance.to(encodings.dtype), encodings)

    def conversation(
        self, encodings: Tensor, utt_mask: Tensor, response: Tensor | None
    ) -> Gaussian:
        """Posterior of ``z_conv`` from the utterance encodings (+ the response's, appended
        after each row's last utterance)."""
        lengths = utt_mask.sum(1)
        if response is not None:
            encodings = torch.cat(
                [encodings, encodings.new_zeros(encodings.shape[0], 1, encodings.shape[2])], 1
            )
            encodings[torch.arange(len(lengths), device=lengths.device), lengths] = response
            lengths = lengths + 1
        return self.conv_posterior(run_gru(self.conv_rnn, encodings, lengths)[1])

    def _context_with(self, encodings: Tensor, utt_mask: Tensor, z_conv: Tensor) -> Tensor:
        dropped = self.drop_utterances(encodings, utt_mask)
        inputs = torch.cat([dropped, z_conv[:, None].expand(-1, dropped.shape[1], -1)], -1)
        return self.context(inputs, utt_mask)

    def encode(self, batch: GenerateBatch) -> ContextMemory:
        encodings, utt_mask = self.encode_utterances(batch.history)
        sample = self.config.sample_latent
        z_conv = self._draw(self.conversation(encodings, utt_mask, None), sample)
        context = self._context_with(encodings, utt_mask, z_conv)
        z = self._draw(self.prior(torch.cat([context, z_conv], -1)), sample)
        return ContextMemory(torch.cat([context, z, z_conv], -1))

    def _inference_inputs(self, batch: GenerateBatch) -> tuple[Tensor, ...]:
        encodings, utt_mask = self.encode_utterances(batch.history)
        return encodings, utt_mask, self.encode_response(batch)

    def _posterior_draw(self, inputs: tuple[Tensor, ...], noise: RowNoise | None) -> LatentDraw:
        encodings, utt_mask, response = inputs
        conv = self.conversation(encodings, utt_mask, response)
        z_conv = conv.sample(noise)
        context = self._context_with(encodings, utt_mask, z_conv)
        prior = self.prior(torch.cat([context, z_conv], -1))
        posterior = self.posterior(torch.cat([context, response, z_conv], -1))
        z = posterior.sample(noise)
        log_ratio = (
            standard_normal_log_prob(z_conv)
            - conv.log_prob(z_conv)
            + prior.log_prob(z)
            - posterior.log_prob(z)
        )
        kl_utt, kl_conv = posterior.kl(prior), conv.kl()
        terms = {"kl_utt": kl_utt.mean().detach(), "kl_conv": kl_conv.mean().detach()}
        return LatentDraw(torch.cat([context, z, z_conv], -1), log_ratio, kl_utt + kl_conv, terms)
