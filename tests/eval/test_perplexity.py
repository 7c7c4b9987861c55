"""Perplexity and per-example NLL against hand-computed values and the models' own loss."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from pipeline.data.batch import GenerateBatch, LMBatch
from pipeline.data.special import PAD_ID
from pipeline.eval.perplexity import (
    PerplexityMeter,
    example_nll,
    history_tokens,
    history_utterances,
    perplexity,
    perplexity_of,
    token_nll,
)
from pipeline.models.base import LanguageModel, SelectModel, Seq2SeqModel, select_batch_dim
from pipeline.names import Task
from tests.batches import make_history, random_generate_batch

V = 50


class UniformSeq2Seq(Seq2SeqModel):
    """Every next token has probability 1/V: NLL ln V per counted target token."""

    def encode(self, batch: GenerateBatch) -> object:
        return batch.history.input_ids

    def decode(self, tokens, memory, state=None):
        return torch.zeros(*tokens.shape, V), None


class BagSeq2Seq(Seq2SeqModel):
    """A tiny real model: logits from the current token + the mean history embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8, padding_idx=PAD_ID)
        self.out = nn.Linear(8, V)

    def encode(self, batch: GenerateBatch) -> Tensor:
        mask = batch.history.input_mask.unsqueeze(-1).float()
        return (self.emb(batch.history.input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)

    def decode(self, tokens, memory, state=None):
        return self.out(self.emb(tokens) + memory.unsqueeze(1)), None


class ConstantLM(LanguageModel):
    """NLL 2.0 at every position, padding included: the mask must drop the padding."""

    def token_nll(self, batch: LMBatch) -> Tensor:
        return torch.full(batch.sentences.shape, 2.0)


def test_perplexity_is_exp_of_mean_nll():
    # two tokens of NLL ln 4 each: mean ln 4 -> perplexity 4
    assert perplexity(2 * math.log(4), 2) == pytest.approx(4.0)
    # tensors are summed first (per-batch sums stacked)
    assert perplexity(torch.tensor([math.log(4), math.log(4)]), torch.tensor([1, 1])) == (
        pytest.approx(4.0)
    )
    assert perplexity(1e6, 1) == math.inf


def test_perplexity_rejects_no_tokens_and_reports_divergence_as_such():
    with pytest.raises(ValueError, match="n_tokens"):
        perplexity(1.0, 0)
    # a diverged run: NaN and inf as such, never a capped exp(50) that looks like a number
    assert math.isnan(perplexity(float("nan"), 3))
    assert perplexity(float("inf"), 3) == math.inf
    assert perplexity_of(60.0) == pytest.approx(math.exp(60.0))  # no cap at exp(50)
    assert perplexity_of(1e6) == math.inf and math.isnan(perplexity_of(math.nan))


def test_validation_reports_the_same_perplexity_function():
    from pipeline.train.loop import EvalResult

    assert EvalResult(60.0, 10).metrics(Task.GENERATE)["valid_ppl"] == perplexity_of(60.0)


def test_meter_pools_tokens_not_batches():
    meter = PerplexityMeter()
    meter.update(torch.tensor(1.0), torch.tensor(2))  # batch mean NLL 0.5
    meter.update(3.0, 2)  # batch mean 1.5
    # pooled: 4 nats / 4 tokens = 1.0 -> e; a mean of batch perplexities would differ
    assert meter.mean_nll == pytest.approx(1.0)
    assert meter.perplexity == pytest.approx(math.e)
    assert meter.perplexity != pytest.approx((math.exp(0.5) + math.exp(1.5)) / 2)
    with pytest.raises(ValueError, match="no tokens"):
        _ = PerplexityMeter().mean_nll


def test_token_nll_zero_at_padding():
    logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens: NLL ln 4
    targets = torch.tensor([[1, 2, 0]])
    mask = torch.tensor([[True, True, False]])
    nll = token_nll(logits, targets, mask)
    assert torch.allclose(nll, torch.tensor([[math.log(4), math.log(4), 0.0]]))


def test_example_nll_uniform_model_hand_values():
    batch = random_generate_batch(batch_size=4, vocab_size=V, seed=1)
    out = example_nll(UniformSeq2Seq(), batch)
    # targets are "<bos> w.. <eos>": every real token after <bos> is predicted once
    counted = batch.target_mask.sum(-1) - 1
    assert torch.equal(out.n_tokens, counted)
    assert torch.allclose(out.nll_sum, counted.double() * math.log(V))
    assert torch.allclose(out.mean, torch.full((4,), math.log(V), dtype=torch.float64))


def test_example_nll_adds_up_to_the_model_loss():
    torch.manual_seed(0)
    model = BagSeq2Seq().eval()
    batch = random_generate_batch(batch_size=5, vocab_size=V, seed=2)
    out = example_nll(model, batch)
    loss = model.loss(batch)
    assert int(out.n_tokens.sum()) == int(loss.n_tokens)
    assert float(out.nll_sum.sum()) == pytest.approx(float(loss.nll_sum), rel=1e-5)
    # each example scored alone gives the same value (no leakage across the batch)
    for i in range(batch.batch_size):
        one = example_nll(model, _row(batch, i))
        assert float(one.nll_sum[0]) == pytest.approx(float(out.nll_sum[i]), rel=1e-5)


def _row(batch: GenerateBatch, i: int) -> GenerateBatch:
    return select_batch_dim(batch, torch.tensor([i]))  # type: ignore[return-value]


def test_example_nll_lm_masks_padding():
    sentences = torch.tensor([[[5, 6, 3], [7, 3, 0]], [[8, 3, 0], [0, 0, 0]]])
    mask = sentences != 0
    batch = LMBatch(sentences, mask, sentences.flatten(1), mask.flatten(1), ("a", "b"))
    out = example_nll(ConstantLM(), batch)
    assert out.n_tokens.tolist() == [5, 2]
    assert out.nll_sum.tolist() == [10.0, 4.0]


def test_example_nll_rejects_other_models():
    with pytest.raises(TypeError, match="generate and lm"):
        example_nll(SelectModel(), random_generate_batch())  # type: ignore[arg-type]
    sentences = torch.ones(1, 1, 2, dtype=torch.long)
    lm_batch = LMBatch(sentences, sentences > 0, sentences[0], sentences[0] > 0, ("x",))
    with pytest.raises(TypeError, match="GenerateBatch"):
        example_nll(UniformSeq2Seq(), lm_batch)  # type: ignore[arg-type]


def test_history_lengths():
    # example 0: utterances of 3 and 2 tokens; example 1: one of 4 tokens
    history = make_history([[[2, 5, 3], [2, 3]], [[2, 6, 7, 3]]], [[2, 1], [2]])
    assert history_tokens(history).tolist() == [5, 4]
    assert history_utterances(history).tolist() == [2, 1]
