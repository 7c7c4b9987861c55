"""Perplexity and per-example losses.

Perplexity = exp(mean token NLL over non-pad targets) = ``exp(nll_sum / n_tokens)``, with
the sums taken over the whole evaluation set (not a mean of per-batch perplexities, which
would weight short batches like long ones). ``LossOutput.nll_sum``/``n_tokens`` feed it.

Per-example losses (mean NLL of one example's target tokens) are what the U-Net paper
correlates with the history length (its Table 7): ``example_nll`` computes them with the
same teacher forcing as ``Seq2SeqModel.loss`` (or ``LanguageModel.token_nll``), and
``history_tokens``/``history_utterances`` give the lengths to correlate them with
(``pipeline.eval.stats.pearson``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipeline.config.evaluate import LATENT_SAMPLES
from pipeline.data.batch import GenerateBatch, History, LMBatch
from pipeline.models.base import LanguageModel, LatentVariableModel, Seq2SeqModel


def _scalar(value: float | Tensor) -> float:
    return float(value.detach().double().sum()) if isinstance(value, Tensor) else float(value)


def perplexity_of(mean_nll: float) -> float:
    """``exp(mean_nll)``, the one perplexity of validation, test, tuning and the report.

    A loss too large for a float gives ``inf`` and a NaN loss (a diverged run) gives NaN:
    the report shows them as such, never as a capped number that looks like a result.
    """
    if math.isnan(mean_nll):
        return math.nan
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def perplexity(nll_sum: float | Tensor, n_tokens: int | Tensor) -> float:
    """``exp(nll_sum / n_tokens)``: the exponentiated mean token negative log-likelihood.

    ``nll_sum`` is the summed NLL in nats over ``n_tokens`` counted target tokens (tensors
    are summed first, so per-batch sums can be passed stacked); see :func:`perplexity_of`.
    """
    total, count = _scalar(nll_sum), _scalar(n_tokens)
    if count <= 0:
        raise ValueError(f"n_tokens: perplexity needs at least one token, got {count:g}")
    return perplexity_of(total / count)


@dataclass
class PerplexityMeter:
    """Accumulates ``(nll_sum, n_tokens)`` over batches in float64; ``perplexity`` at the end."""

    nll_sum: float = 0.0
    n_tokens: float = 0.0

    def update(self, nll_sum: float | Tensor, n_tokens: int | Tensor) -> None:
        """Add one batch's summed NLL and token count (``LossOutput.nll_sum``/``n_tokens``)."""
        self.nll_sum += _scalar(nll_sum)
        self.n_tokens += _scalar(n_tokens)

    @property
    def mean_nll(self) -> float:
        """Mean token NLL so far (the cross-entropy loss the papers report)."""
        if self.n_tokens <= 0:
            raise ValueError("PerplexityMeter: no tokens counted yet")
        return self.nll_sum / self.n_tokens

    @property
    def perplexity(self) -> float:
        return perplexity(self.nll_sum, self.n_tokens)


@dataclass(frozen=True)
class ExampleNLL:
    """Per-example summed NLL ``[B]`` (float64) and counted target tokens ``[B]`` (long);
    for a latent-variable model ``nll_sum`` is importance-sampled and ``bound`` ``[B]`` is
    the negative ELBO of the same samples (``pipeline.models.latent``)."""

    nll_sum: Tensor
    n_tokens: Tensor
    bound: Tensor | None = None

    @property
    def mean(self) -> Tensor:
        """Per-example mean token NLL ``[B]``; NaN for an example without target tokens."""
        return self.nll_sum / self.n_tokens.double()


def token_nll(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Cross-entropy of each target token, ``[B, T]`` float32, 0 where ``mask`` is False."""
    nll = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none"
    ).view_as(targets)
    return nll.masked_fill(~mask.bool(), 0.0)


@torch.no_grad()
def example_nll(
    model: Seq2SeqModel | LanguageModel,
    batch: GenerateBatch | LMBatch,
    latent_samples: int = LATENT_SAMPLES,
    seed: int = 0,
) -> ExampleNLL:
    """Per-example NLL of a batch, counting exactly the tokens the model's ``loss`` counts.

    Generate models: teacher forcing on ``target_ids`` (predict positions 1.. from the
    prefix, as ``Seq2SeqModel.loss``); extra loss terms are not part of it. A
    latent-variable model (VHRED, VHCR): its ``latent_nll`` with ``latent_samples``
    importance samples seeded by ``seed``, the ELBO bound beside it.
    LM models: ``token_nll`` over ``sentence_mask``. Runs without gradients; put the model
    in eval mode first if it has dropout.
    """
    if isinstance(model, Seq2SeqModel):
        if not isinstance(batch, GenerateBatch):
            raise TypeError(f"a generate model needs a GenerateBatch, got {type(batch).__name__}")
        mask = batch.target_mask[:, 1:]
        if isinstance(model, LatentVariableModel):
            latent = model.latent_nll(batch, latent_samples, seed)
            return ExampleNLL(latent.importance, mask.long().sum(-1), latent.elbo)
        memory = model.encode(batch)
        logits, _ = model.decode(batch.target_ids[:, :-1], memory)
        nll = token_nll(logits, batch.target_ids[:, 1:], mask)
        return ExampleNLL(nll.double().sum(-1), mask.long().sum(-1))
    if isinstance(model, LanguageModel):
        if not isinstance(batch, LMBatch):
            raise TypeError(f"an lm model needs an LMBatch, got {type(batch).__name__}")
        mask = batch.sentence_mask
        nll = model.token_nll(batch).double().masked_fill(~mask, 0.0)
        return ExampleNLL(nll.flatten(1).sum(-1), mask.flatten(1).long().sum(-1))
    raise TypeError(
        f"per-example NLL is defined for generate and lm models, not {type(model).__name__}"
    )


def history_tokens(history: History) -> Tensor:
    """Number of real history tokens of each example, ``[B]``."""
    return history.input_mask.long().sum(-1)


def history_utterances(history: History) -> Tensor:
    """Number of history utterances of each example, ``[B]`` (0 for an empty history)."""
    last = history.utt_index.masked_fill(~history.input_mask, -1).max(-1).values
    return last + 1
