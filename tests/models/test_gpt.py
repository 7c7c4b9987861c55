"""GPT / congruent GPT: paper sizes, congruent sharing, causality, padding, overfitting."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from pipeline.data.special import BOS_ID, EOS_ID, SPECIAL_TOKENS
from pipeline.errors import ConfigError
from pipeline.models import registry
from pipeline.models.base import count_parameters
from pipeline.models.gpt import GPT
from pipeline.models.stack import extent, scatter_rows
from pipeline.names import Task
from tests.batches import lm_batch_from_sentences, ptb_lm_batch

VOCAB = 40
SMALL = {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_layers": 2, "dropout": 0.0}


def random_documents(seed: int = 0, n_docs: int = 3) -> list[list[list[int]]]:
    """Documents of 2-4 sentences of 1-5 words + <eos>, different per document."""
    g = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    def sentence() -> list[int]:
        words = torch.randint(len(SPECIAL_TOKENS), VOCAB, (rand(1, 5),), generator=g)
        return [*words.tolist(), EOS_ID]

    return [[sentence() for _ in range(rand(2, 4))] for _ in range(n_docs)]


def small(name: str = "gpt", **overrides) -> GPT:
    torch.manual_seed(0)
    model = registry.build(name, VOCAB, **{**SMALL, **overrides})
    return model.eval()


def test_registered_with_paper_defaults() -> None:
    assert {"gpt", "congruent_gpt"} <= set(registry.names(Task.LM))
    config = registry.make_config("gpt", 10_000)
    assert (config.d_model, config.n_heads, config.n_layers, config.d_ff) == (512, 8, 6, 2048)
    assert not config.congruent
    assert registry.make_config("congruent_gpt", 10_000).congruent
    with pytest.raises(ConfigError, match="congruent"):
        registry.make_config("congruent_gpt", 10_000, congruent=False)


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match="n_heads"):
        registry.build("gpt", VOCAB, d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match=r"gpt\.n_layers"):
        registry.build("gpt", VOCAB, n_layers=0)


@pytest.mark.parametrize("overrides", [{"n_layers": 1}, SMALL])
def test_congruent_removes_d_squared_per_attention_layer(overrides: dict) -> None:
    # At the paper's width (one layer keeps the test fast) and at a small size.
    flat = registry.build("gpt", 16, **overrides)
    congruent = registry.build("congruent_gpt", 16, **overrides)
    d, layers = flat.config.d_model, flat.config.n_layers
    assert count_parameters(flat) - count_parameters(congruent) == layers * (d * d + d)
    for layer in congruent.stack.layers:
        assert layer.attn.q_proj.weight is layer.attn.k_proj.weight
    for layer in flat.stack.layers:
        assert layer.attn.q_proj.weight is not layer.attn.k_proj.weight


def test_congruent_query_and_key_stay_one_tensor_under_training() -> None:
    model = small("congruent_gpt").train()
    batch = lm_batch_from_sentences(random_documents())
    attn = model.stack.layers[0].attn
    before = attn.q_proj.weight.detach().clone()
    model.loss(batch).loss.backward()
    with torch.no_grad():  # one SGD step (torch.optim's first use costs seconds of imports)
        for p in model.parameters():
            p.sub_(0.1 * p.grad)
    assert attn.q_proj.weight is attn.k_proj.weight
    assert not torch.equal(attn.k_proj.weight, before)


def test_token_nll_is_next_token_cross_entropy_in_sentence_layout() -> None:
    model = small()
    docs = random_documents()
    batch = lm_batch_from_sentences(docs)
    nll = model.token_nll(batch)
    assert nll.shape == batch.sentences.shape
    for b, doc in enumerate(docs):
        flat = [t for sentence in doc for t in sentence]
        logits = model(torch.tensor([[BOS_ID, *flat[:-1]]]))[0]
        expected = F.cross_entropy(logits, torch.tensor(flat), reduction="none")
        got = nll[b][batch.sentence_mask[b]]  # sentence tokens in document order
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(nll[~batch.sentence_mask] == 0)
    assert torch.all(nll[batch.sentence_mask] > 0)


def test_no_information_from_future_tokens_or_sentences() -> None:
    model = small()
    docs = random_documents(seed=1)
    base = model.token_nll(lm_batch_from_sentences(docs))
    b, s, t = 0, 1, 0  # change token t+1 of sentence s of document b
    assert len(docs[b][s]) > t + 1
    changed = [[list(x) for x in doc] for doc in docs]
    changed[b][s][t + 1] = (changed[b][s][t + 1] + 1 - len(SPECIAL_TOKENS)) % (
        VOCAB - len(SPECIAL_TOKENS)
    ) + len(SPECIAL_TOKENS)
    after = model.token_nll(lm_batch_from_sentences(changed))
    assert torch.equal(after[b, :s], base[b, :s])
    assert torch.equal(after[b, s, : t + 1], base[b, s, : t + 1])
    # The changed token and what follows it do see the change (the test can fail).
    assert not torch.allclose(after[b, s, t + 1 :], base[b, s, t + 1 :])
    # Other documents of the batch are untouched.
    assert torch.allclose(after[1:], base[1:], atol=1e-6, rtol=1e-5)


def test_extra_padding_and_batching_change_nothing() -> None:
    model = small()
    docs = random_documents(seed=2)
    batch = lm_batch_from_sentences(docs)
    nll = model.token_nll(batch)
    _, n_sent, length = batch.sentences.shape
    padded = dataclasses.replace(
        batch,
        sentences=F.pad(batch.sentences, (0, 3, 0, 2)),
        sentence_mask=F.pad(batch.sentence_mask, (0, 3, 0, 2)),
        flat_ids=F.pad(batch.flat_ids, (0, 5)),
        flat_mask=F.pad(batch.flat_mask, (0, 5)),
    )
    padded_nll = model.token_nll(padded)
    assert torch.equal(padded_nll[:, :n_sent, :length], nll)
    assert torch.all(padded_nll[:, n_sent:] == 0) and torch.all(padded_nll[..., length:] == 0)
    for b, doc in enumerate(docs):
        alone = model.token_nll(lm_batch_from_sentences([doc]))[0]
        expected = nll[b, : alone.shape[0], : alone.shape[1]]
        assert torch.allclose(alone, expected, atol=1e-5, rtol=1e-5)


def test_inconsistent_flat_and_sentence_layouts_are_refused() -> None:
    batch = lm_batch_from_sentences(random_documents())
    broken = dataclasses.replace(
        batch, flat_ids=batch.flat_ids[:, :-1], flat_mask=batch.flat_mask[:, :-1]
    )
    with pytest.raises(ValueError, match="different numbers of tokens"):
        small().token_nll(broken)


def test_helpers() -> None:
    mask = torch.tensor([[True, False, False, False], [True, True, True, False]])
    assert extent(mask) == 3
    assert extent(torch.zeros(2, 3, dtype=torch.bool)) == 0
    out = scatter_rows(mask, torch.arange(4.0))
    assert out.tolist() == [[0, 0, 0, 0], [1, 2, 3, 0]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "congruent_gpt"])
def test_overfits_a_small_real_ptb_batch(name: str) -> None:
    batch, vocab = ptb_lm_batch(batch_size=2, sentences_per_document=3, vocab_size=500)
    torch.manual_seed(0)
    model = registry.build(name, len(vocab), d_model=48, n_heads=4, d_ff=96, n_layers=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = model.loss(batch).loss.item()
    for _ in range(60):
        optimizer.zero_grad()
        out = model.loss(batch)
        out.loss.backward()
        optimizer.step()
    assert out.loss.item() < first / 2
    # Every parameter took part in the loss.
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
