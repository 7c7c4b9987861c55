"""GPT / congruent GPT: paper sizes, congruent sharing, causality, padding, overfitting."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from pipeline.data.special import BOS_ID, EOS_ID, SPECIAL_TOKENS
from pipeline.errors import ConfigError
from pipeline.models import gpt as gpt_module
from pipeline.models import registry
from pipeline.models.base import TokenScores, activation_terms, count_parameters
from pipeline.models.gpt import GPT
from pipeline.models.stack import extent, flat_to_sentences, scatter_rows
from pipeline.names import Task
from tests.batches import lm_batch_from_sentences, ptb_lm_batch
from tests.models.compiled import assert_compiles_like_eager, assert_static_path_matches_trimmed

VOCAB = 40
SMALL = {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_layers": 2, "dropout": 0.0}
# The Transformer-XL PTB recipe's model knobs (profiles/paper.yaml cites their sources).
RECIPE = {
    "locked_dropout": True,
    "input_dropout": 0.6,
    "attention_dropout": 0.2,
    "attention_output_dropout": 0.2,
    "ffn_dropout": 0.2,
    "output_dropout": 0.5,
    "embedding_dropout": 0.2,
    "ar_alpha": 0.2,
    "tar_beta": 0.1,
}


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
    # the static-shape twin: a row's flat values [B, Lf] into its sentence layout
    sentences = torch.tensor(
        [[[True, True, False], [True, False, False]], [[True] * 3, [False] * 3]]
    )
    flat = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 9.0]])
    flat_mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    expected = scatter_rows(sentences, flat[flat_mask])
    assert torch.equal(flat_to_sentences(flat, sentences), expected)
    assert expected.tolist() == [[[1, 2, 0], [3, 0, 0]], [[4, 5, 6], [0, 0, 0]]]


# --------------------------------------------------------------------------- the LM recipe


def test_recipe_knobs_are_off_by_default_and_validated() -> None:
    config = registry.make_config("gpt", VOCAB)
    assert not config.locked_dropout
    assert config.input_dropout is config.attention_output_dropout is config.ffn_dropout is None
    assert config.output_dropout == config.embedding_dropout == 0.0
    assert config.ar_alpha == config.tar_beta == 0.0
    # the sites fall back to `dropout`, per position, as before the recipe existed
    dims = registry.make_config("gpt", VOCAB, dropout=0.3).block()
    assert (dims.input_p, dims.attention_output_p, dims.ffn_p, dims.locked) == (
        0.3,
        0.3,
        0.3,
        False,
    )
    with pytest.raises(ConfigError, match=r"gpt\.output_dropout"):
        registry.make_config("gpt", VOCAB, output_dropout=1.0)
    with pytest.raises(ConfigError, match=r"congruent_gpt\.tar_beta"):
        registry.make_config("congruent_gpt", VOCAB, tar_beta=-0.1)


def test_recipe_puts_each_dropout_at_its_site() -> None:
    model = small(**RECIPE)
    layer = model.stack.layers[0]
    sites = {
        "input": model.stack.dropout,
        "attention output": layer.attn_dropout,
        "ffn inner": layer.ffn.dropout,
        "ffn branch": layer.ffn_dropout,
        "output": model.output_dropout,
    }
    assert {name: (m.p, m.locked) for name, m in sites.items()} == {
        "input": (0.6, True),
        "attention output": (0.2, True),
        "ffn inner": (0.2, True),
        "ffn branch": (0.2, True),
        "output": (0.5, True),
    }
    assert layer.attn.dropout == 0.2  # attention probabilities: standard dropout
    assert model.embed.type_dropout == 0.2


def test_recipe_dropouts_mask_whole_sequences_in_training_only() -> None:
    model = small(**RECIPE)
    batch = lm_batch_from_sentences(random_documents())
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str):
        def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            seen.setdefault(name, (inputs[0], output))

        return hook

    model.stack.dropout.register_forward_hook(keep("input"))
    model.output_dropout.register_forward_hook(keep("output"))
    model.train().loss(batch)
    for name, p in (("input", 0.6), ("output", 0.5)):
        inputs, output = seen[name]
        # the mask, read where the input is not 0 (position 0's encoding has zeros)
        ratio = torch.where(inputs != 0, output / inputs, torch.nan).detach()
        lo = ratio.nan_to_num(nan=torch.inf).amin(1)
        hi = ratio.nan_to_num(nan=-torch.inf).amax(1)
        torch.testing.assert_close(lo, hi, msg=name)  # one value per (sequence, feature)
        kept = lo != 0
        assert kept.any() and not kept.all(), name
        torch.testing.assert_close(lo[kept], torch.full_like(lo[kept], 1 / (1 - p)), msg=name)
    # in eval mode every recipe dropout is the identity: the plain model's numbers
    plain = small()
    assert torch.equal(model.eval().token_nll(batch), plain.token_nll(batch))
    assert not torch.equal(model.train().token_nll(batch), model.token_nll(batch))


def test_activation_terms_by_hand() -> None:
    hidden = torch.tensor(
        [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[1.0, 1.0], [0.0, 0.0], [2.0, 0.0]]]
    )
    mask = torch.tensor([[True, True, False], [True, True, True]])
    terms = activation_terms(TokenScores(torch.zeros(1), hidden, mask), 0.2, 0.1)
    # AR: 5 real positions x 2 features; TAR: pairs (0,1) of row 0, (0,1) and (1,2) of row 1
    ar = 0.2 * (1 + 4 + 9 + 16 + 1 + 1 + 0 + 0 + 4 + 0) / 10
    tar = 0.1 * ((2**2 + 2**2) + (1 + 1) + (4 + 0)) / 6
    assert terms.keys() == {"ar", "tar"}
    assert terms["ar"].item() == pytest.approx(ar) and terms["tar"].item() == pytest.approx(tar)
    assert activation_terms(TokenScores(torch.zeros(1)), 0.0, 0.0) == {}
    with pytest.raises(ValueError, match="hidden states"):
        activation_terms(TokenScores(torch.zeros(1)), 0.2, 0.0)


def test_ar_tar_join_the_training_loss_never_the_nll() -> None:
    docs = random_documents(seed=3)
    batch = lm_batch_from_sentences(docs)
    model, plain = small(ar_alpha=0.2, tar_beta=0.1).train(), small().train()
    out, reference = model.loss(batch), plain.loss(batch)
    # by hand: the last layer's output at each real input position of each document
    squares = steps = n_square = n_step = 0.0
    for doc in docs:
        flat = [t for sentence in doc for t in sentence]
        h = model.stack(model.embed(torch.tensor([[BOS_ID, *flat[:-1]]])))[0]
        squares, n_square = squares + h.pow(2).sum(), n_square + h.numel()
        steps, n_step = steps + (h[1:] - h[:-1]).pow(2).sum(), n_step + h[1:].numel()
    ar, tar = 0.2 * squares / n_square, 0.1 * steps / n_step
    torch.testing.assert_close(out.terms["ar"], ar)
    torch.testing.assert_close(out.terms["tar"], tar)
    assert torch.equal(out.nll_sum, reference.nll_sum)
    torch.testing.assert_close(out.loss, reference.loss + ar + tar)
    assert model.eval().loss(batch).terms == {}  # validation scores the NLL alone


# --------------------------------------------------------------------------- compile


def test_attention_is_causal_through_is_causal(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    small().loss(lm_batch_from_sentences(random_documents()))
    assert calls == [(True, True)] * SMALL["n_layers"]  # the fused causal kernel, no mask


def test_padded_static_path_equals_the_trimmed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    model = small()
    batch = lm_batch_from_sentences(random_documents(seed=4))
    padded = dataclasses.replace(
        batch,
        sentences=F.pad(batch.sentences, (0, 2, 0, 1)),
        sentence_mask=F.pad(batch.sentence_mask, (0, 2, 0, 1)),
        flat_ids=F.pad(batch.flat_ids, (0, 3)),
        flat_mask=F.pad(batch.flat_mask, (0, 3)),
    )
    assert_static_path_matches_trimmed(model, gpt_module, padded, monkeypatch)


@pytest.mark.slow
def test_loss_compiles_in_one_graph_and_matches_eager() -> None:
    assert_compiles_like_eager(small(**RECIPE), lm_batch_from_sentences(random_documents(seed=5)))


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


# --------------------------------------------------------------------------- stream windows


def with_context(documents: list[list[list[int]]], context: list[int]):
    """The documents as stream windows whose first ``context[b]`` tokens are context."""
    batch = lm_batch_from_sentences(documents)
    return dataclasses.replace(batch, context_tokens=torch.tensor(context))


def test_a_stream_window_scores_its_targets_after_its_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = random_documents(seed=6)
    batch, windows = lm_batch_from_sentences(docs), with_context(docs, [3, 0, 5])
    model = small()
    nll = model.token_nll(batch)  # the same model input: the context is read
    assert torch.equal(model.token_nll(windows), nll)
    scored = windows.scored_mask()
    flat = [[t for s in d for t in s] for d in docs]
    assert scored.sum(-1).sum(-1).tolist() == [
        len(f) - c for f, c in zip(flat, [3, 0, 5], strict=True)
    ]
    out = model.loss(windows)
    assert out.n_tokens == scored.sum() and torch.equal(out.nll_sum, (nll * scored).sum())
    # the scored tokens of each row are its last ones, flat and in sentences alike
    flat_scored = windows.scored_flat_mask()
    assert torch.equal(windows.flat_ids[flat_scored], windows.sentences[scored])
    # the static path (compile, CUDA) masks the same tokens
    trimmed = model.loss(windows)
    monkeypatch.setattr(gpt_module, "static_shapes", lambda like: True)
    static = model.loss(windows)
    torch.testing.assert_close(static.nll_sum, trimmed.nll_sum)
    assert torch.equal(static.n_tokens, trimmed.n_tokens)


def test_ar_tar_regularise_the_scored_positions_of_a_window_only() -> None:
    docs = random_documents(seed=7, n_docs=1)
    context = 4
    model = small(ar_alpha=0.2, tar_beta=0.1).train()
    out = model.loss(with_context(docs, [context]))
    flat = [t for s in docs[0] for t in s]
    h = model.stack(model.embed(torch.tensor([[BOS_ID, *flat[:-1]]])))[0][context:]
    torch.testing.assert_close(out.terms["ar"], 0.2 * h.pow(2).mean())
    torch.testing.assert_close(out.terms["tar"], 0.1 * (h[1:] - h[:-1]).pow(2).mean())


def test_qkv_dropout_is_off_by_default_and_locked_per_sequence_when_on() -> None:
    assert registry.make_config("gpt", VOCAB).qkv_dropout == 0.0
    assert all(layer.attn.qkv_dropout is None for layer in small().stack.layers)
    model = small(locked_dropout=True, qkv_dropout=0.4)
    attn = model.stack.layers[0].attn
    assert (attn.qkv_dropout.p, attn.qkv_dropout.locked) == (0.4, True)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    attn.qkv_dropout.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    batch = lm_batch_from_sentences(random_documents(seed=8))
    model.train().loss(batch)
    assert len(seen) == 3  # queries, keys, values: each its own draw
    for inputs, output in seen:
        ratio = (output / inputs).detach()  # one value per (sequence, feature)
        torch.testing.assert_close(ratio.amin(1), ratio.amax(1))
        values = ratio.unique()
        assert values[0] == 0 and torch.allclose(values[1:], torch.tensor(1 / 0.6))
    plain = small()
    assert torch.equal(model.eval().token_nll(batch), plain.token_nll(batch))
    assert not torch.equal(model.train().token_nll(batch), plain.token_nll(batch))
