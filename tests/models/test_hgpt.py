"""Hierarchical GPT: paper sizes, causality at both levels, padding, flat-vs-hierarchical
token accounting, congruent sharing, two-stage training, overfitting."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from pipeline.data.special import EOS_ID
from pipeline.errors import ConfigError
from pipeline.models import hgpt as hgpt_module
from pipeline.models import registry
from pipeline.models.base import count_parameters
from pipeline.models.hgpt import HierarchicalGPT, Stage
from pipeline.names import Task
from tests.batches import lm_batch_from_sentences, ptb_lm_batch, shared_data_dir
from tests.models.compiled import assert_compiles_like_eager, assert_static_path_matches_trimmed
from tests.models.test_gpt import RECIPE

VOCAB = 40
SMALL = {
    "d_model": 32,
    "n_heads": 4,
    "d_ff": 64,
    "d_sentence": 16,
    "sentence_heads": 2,
    "sentence_d_ff": 32,
    "encoder_layers": 1,
    "document_layers": 2,
    "decoder_layers": 2,
    "dropout": 0.0,
}
DOCS = [
    [[5, 6, 7, EOS_ID], [8, 9, 10, EOS_ID], [11, 12, EOS_ID], [13, EOS_ID]],
    [[14, EOS_ID], [15, 16, 17, 18, EOS_ID]],
    [[19, 20, EOS_ID], [21, EOS_ID], [22, 23, 24, EOS_ID]],
]


def small(name: str = "hgpt", **overrides) -> HierarchicalGPT:
    torch.manual_seed(0)
    return registry.build(name, VOCAB, **{**SMALL, **overrides}).eval()


def nll_of(model: HierarchicalGPT, docs: list[list[list[int]]]) -> torch.Tensor:
    with torch.no_grad():
        return model.token_nll(lm_batch_from_sentences(docs))


def with_token(docs: list[list[list[int]]], b: int, s: int, t: int, token: int):
    changed = [[list(sentence) for sentence in doc] for doc in docs]
    changed[b][s][t] = token
    return changed


def sgd_step(model: torch.nn.Module, lr: float = 0.1) -> None:
    """What any optimizer does to the parameters that got a gradient (torch.optim's first
    use costs seconds of imports; the slow tests pay it)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)


def test_registered_with_paper_defaults() -> None:
    assert {"hgpt", "congruent_hgpt"} <= set(registry.names(Task.LM))
    c = registry.make_config("hgpt", 10_000)
    assert (c.encoder_layers, c.document_layers, c.decoder_layers) == (1, 1, 4)
    assert (c.d_model, c.n_heads, c.d_ff) == (512, 8, 2048)
    assert (c.d_sentence, c.sentence_heads, c.sentence_d_ff) == (512, 8, 2048)
    assert c.training == "joint" and not c.congruent
    assert registry.make_config("congruent_hgpt", 10_000).congruent


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match="sentence_heads"):
        registry.make_config("hgpt", VOCAB, d_sentence=30, sentence_heads=4)
    with pytest.raises(ConfigError, match=r"hgpt\.training"):
        registry.make_config("hgpt", VOCAB, training="alternating")
    with pytest.raises(ConfigError, match=r"hgpt\.decoder_layers"):
        registry.make_config("hgpt", VOCAB, decoder_layers=0)


@pytest.mark.slow
def test_paper_size_parameter_counts() -> None:
    # Paper Table 4 lists the flat GPT's parameter counts for the hierarchical models: with
    # all widths 512 and a shared tied embedding they differ only by the BOD vector.
    flat = registry.build("gpt", 16)
    hier = registry.build("hgpt", 16)
    congruent = registry.build("congruent_hgpt", 16)
    assert count_parameters(hier) == count_parameters(flat) + 512
    assert count_parameters(hier) - count_parameters(congruent) == 6 * (512 * 512 + 512)


def test_congruent_shares_query_and_key_in_every_block() -> None:
    flat, congruent = small(), small("congruent_hgpt")
    d, ds = SMALL["d_model"], SMALL["d_sentence"]
    sentence_layers = SMALL["encoder_layers"] + SMALL["decoder_layers"]
    expected = SMALL["document_layers"] * (d * d + d) + sentence_layers * (ds * ds + ds)
    assert count_parameters(flat) - count_parameters(congruent) == expected
    for stack in (congruent.encoder, congruent.document, congruent.decoder):
        for layer in stack.layers:
            assert layer.attn.q_proj.weight is layer.attn.k_proj.weight


def test_no_information_from_future_sentences() -> None:
    model = small()
    base = nll_of(model, DOCS)
    b, s = 0, 1  # change a token of sentence s+1 of document b
    after = nll_of(model, with_token(DOCS, b, s + 1, 0, 30))
    assert torch.equal(after[b, : s + 1], base[b, : s + 1])
    # Sentence s+2 is conditioned on sentence s+1 through the document GPT (can fail).
    assert not torch.allclose(after[b, s + 2], base[b, s + 2])
    assert torch.allclose(after[1:], base[1:], atol=1e-6, rtol=1e-5)


def test_no_information_from_future_tokens() -> None:
    model = small()
    base = nll_of(model, DOCS)
    b, s, t = 0, 1, 0  # change token t+1 of sentence s
    after = nll_of(model, with_token(DOCS, b, s, t + 1, 30))
    assert torch.equal(after[b, :s], base[b, :s])
    assert torch.equal(after[b, s, : t + 1], base[b, s, : t + 1])
    assert not torch.allclose(after[b, s, t + 1 :], base[b, s, t + 1 :])
    assert not torch.allclose(after[b, s + 1], base[b, s + 1])


def test_extra_padding_and_batching_change_nothing() -> None:
    model = small()
    batch = lm_batch_from_sentences(DOCS)
    nll = model.token_nll(batch)
    _, n_sent, length = batch.sentences.shape
    padded = dataclasses.replace(
        batch,
        sentences=F.pad(batch.sentences, (0, 3, 0, 2)),
        sentence_mask=F.pad(batch.sentence_mask, (0, 3, 0, 2)),
    )
    padded_nll = model.token_nll(padded)
    assert torch.equal(padded_nll[:, :n_sent, :length], nll)
    assert torch.all(padded_nll[:, n_sent:] == 0) and torch.all(padded_nll[..., length:] == 0)
    for b, doc in enumerate(DOCS):
        alone = model.token_nll(lm_batch_from_sentences([doc]))[0]
        expected = nll[b, : alone.shape[0], : alone.shape[1]]
        assert torch.allclose(alone, expected, atol=1e-5, rtol=1e-5)


def test_flat_and_hierarchical_models_score_the_same_tokens() -> None:
    batch, vocab = ptb_lm_batch(batch_size=3, sentences_per_document=3, vocab_size=300)
    # PTB convention: every word (the test batches keep at most 25) plus each <eos>.
    lines = (shared_data_dir() / "ptb" / "ptb.train.txt").read_text().splitlines()[:9]
    expected = sum(min(len(line.split()), 25) + 1 for line in lines)
    torch.manual_seed(0)
    flat = registry.build("gpt", len(vocab), d_model=16, n_heads=2, d_ff=32, n_layers=1)
    hier = registry.build("hgpt", len(vocab), **{**SMALL, "decoder_layers": 1})
    outputs = [flat.loss(batch), hier.loss(batch)]
    for model, out in zip((flat, hier), outputs, strict=True):
        assert int(out.n_tokens) == expected
        scored = model.token_nll(batch) != 0
        assert torch.equal(scored, batch.sentence_mask)
        perplexity = torch.exp(out.nll_sum / out.n_tokens)
        assert 1 < perplexity < 10 * len(vocab)


def test_sentence_width_may_differ_and_every_parameter_learns() -> None:
    model = small().train()
    assert isinstance(model.to_document, torch.nn.Linear)
    assert isinstance(model.from_document, torch.nn.Linear)
    model.loss(lm_batch_from_sentences(DOCS)).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_two_stage_switching_freezes_what_it_should() -> None:
    model = small(training="two_stage", stage_one_steps=5)
    document = {id(p) for p in model.document_parameters()}
    rest = [p for p in model.parameters() if id(p) not in document]
    assert model.stage == Stage.SENTENCE
    assert [model.stage_for_step(i) for i in (0, 4, 5, 100)] == [1, 1, 2, 2]
    assert not any(p.requires_grad for p in model.document_parameters())
    assert all(p.requires_grad for p in rest)

    # Stage 1: an autoencoder; the document block is bypassed.
    base = nll_of(model, DOCS)
    with torch.no_grad():
        model.bod.add_(1.0)
        model.document.layers[0].ffn.outer.weight.mul_(50.0)
    assert torch.equal(nll_of(model, DOCS), base)
    # ... and each sentence is decoded from its OWN encoding (its last word informs its first).
    changed = nll_of(model, with_token(DOCS, 0, 0, 2, 30))
    assert changed[0, 0, 0] != base[0, 0, 0]

    # Stage 2: only the document block trains.
    model.set_stage(Stage.DOCUMENT)
    assert all(p.requires_grad for p in model.document_parameters())
    assert not any(p.requires_grad for p in rest)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.loss(lm_batch_from_sentences(DOCS)).loss.backward()
    assert all(p.grad is None for p in rest)
    sgd_step(model)
    for name, p in model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved == (id(p) in document), name
    # Stage 2 is a real language model again: the document block is used.
    assert not torch.allclose(nll_of(model, DOCS), base)

    model.set_stage(Stage.JOINT)
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError):
        model.set_stage(3)


def test_joint_training_never_changes_stage() -> None:
    model = small()
    assert model.stage == Stage.JOINT
    assert all(p.requires_grad for p in model.parameters())
    assert model.stage_for_step(10**6) == Stage.JOINT


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hgpt", "congruent_hgpt"])
def test_overfits_a_small_real_ptb_batch(name: str) -> None:
    batch, vocab = ptb_lm_batch(batch_size=2, sentences_per_document=3, vocab_size=500)
    torch.manual_seed(0)
    model = registry.build(
        name,
        len(vocab),
        d_model=48,
        n_heads=4,
        d_ff=96,
        d_sentence=48,
        sentence_heads=4,
        sentence_d_ff=96,
        decoder_layers=2,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = model.loss(batch).loss.item()
    for _ in range(60):
        optimizer.zero_grad()
        out = model.loss(batch)
        out.loss.backward()
        optimizer.step()
    assert out.loss.item() < first / 2


def test_training_loop_hook_follows_the_two_stage_schedule() -> None:
    model = registry.build("hgpt", 50, **{**SMALL, "training": "two_stage", "stage_one_steps": 3})
    stages = []
    for step in range(5):
        model.on_train_step(step, epoch=0)
        stages.append(model.stage)
    assert stages == [Stage.SENTENCE] * 3 + [Stage.DOCUMENT] * 2
    assert all(p.requires_grad for p in model.document_parameters())
    assert not model.embed.weight.requires_grad
    joint = registry.build("hgpt", 50, **SMALL)
    joint.on_train_step(10**6, epoch=3)
    assert joint.stage == Stage.JOINT


# --------------------------------------------------------------------------- the LM recipe


def test_recipe_dropout_sites() -> None:
    model = small(**RECIPE)
    assert (model.encoder.dropout.p, model.decoder.dropout.p) == (0.6, 0.6)  # words enter
    assert model.document.dropout.p == SMALL["dropout"]  # sentence embeddings enter here
    for stack in (model.encoder, model.document, model.decoder):
        assert stack.dropout.locked
        for layer in stack.layers:
            assert (layer.attn_dropout.p, layer.ffn_dropout.p, layer.ffn.dropout.p) == (0.2,) * 3
            assert layer.attn.dropout == 0.2
    assert (model.output_dropout.p, model.output_dropout.locked) == (0.5, True)
    assert model.embed.type_dropout == 0.2
    batch = lm_batch_from_sentences(DOCS)
    plain = small()
    assert torch.equal(model.eval().token_nll(batch), plain.token_nll(batch))


def test_one_dropped_embedding_table_per_step() -> None:
    model = small(embedding_dropout=0.5).train()
    tables: list[torch.Tensor | None] = []
    model.embed.register_forward_hook(lambda m, inputs, out: tables.append(inputs[1]))
    model.loss(lm_batch_from_sentences(DOCS))
    assert len(tables) == 2 and tables[0] is not None  # the encoder's and the decoder's
    assert tables[0] is tables[1]
    model.loss(lm_batch_from_sentences(DOCS))
    assert not torch.equal(tables[2], tables[0])  # the next step draws again


def test_ar_tar_regularise_the_sentence_decoder_per_sentence() -> None:
    model = small(ar_alpha=0.2, tar_beta=0.1).train()
    outputs: list[torch.Tensor] = []
    model.decoder.register_forward_hook(lambda m, inputs, out: outputs.append(out))
    out = model.loss(lm_batch_from_sentences(DOCS))
    hidden = outputs[0]  # [real sentences, length, d_sentence]
    sentences = [s for doc in DOCS for s in doc]
    assert hidden.shape[0] == len(sentences)
    squares = sum(hidden[i, : len(s)].pow(2).sum() for i, s in enumerate(sentences))
    steps = sum(
        (hidden[i, 1 : len(s)] - hidden[i, : len(s) - 1]).pow(2).sum()
        for i, s in enumerate(sentences)
    )
    width, tokens = hidden.shape[-1], sum(len(s) for s in sentences)
    torch.testing.assert_close(out.terms["ar"], 0.2 * squares / (tokens * width))
    pairs = sum(len(s) - 1 for s in sentences)  # never across two sentences
    torch.testing.assert_close(out.terms["tar"], 0.1 * steps / (pairs * width))
    reference = small().train().loss(lm_batch_from_sentences(DOCS))
    assert torch.equal(out.nll_sum, reference.nll_sum)


# --------------------------------------------------------------------------- compile


def test_attention_kernels_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is not None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    small().loss(lm_batch_from_sentences(DOCS))
    encoder = [(False, True)] * SMALL["encoder_layers"]  # bidirectional, key padding mask
    causal = [(True, False)] * (SMALL["document_layers"] + SMALL["decoder_layers"])
    assert calls == encoder + causal


@pytest.mark.parametrize("stage", [Stage.JOINT, Stage.SENTENCE])
def test_padded_static_path_equals_the_trimmed_one(
    stage: Stage, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = small()
    model.set_stage(stage)
    batch = lm_batch_from_sentences(DOCS)
    padded = dataclasses.replace(
        batch,
        sentences=F.pad(batch.sentences, (0, 2, 0, 1)),
        sentence_mask=F.pad(batch.sentence_mask, (0, 2, 0, 1)),
    )
    assert_static_path_matches_trimmed(model, hgpt_module, padded, monkeypatch)


@pytest.mark.slow
def test_loss_compiles_in_one_graph_and_matches_eager() -> None:
    assert_compiles_like_eager(small(**RECIPE), lm_batch_from_sentences(DOCS))


def test_a_window_of_sentences_scores_the_sentences_after_its_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream window (``data.streams``): its first sentences are read (the document GPT
    sees them) but not scored, and AR/TAR leave their decoder states alone."""
    model = small(ar_alpha=0.2, tar_beta=0.1).train()
    batch = lm_batch_from_sentences(DOCS)
    context = [8, 0, 3]  # whole sentences: the first two, none, the first one
    windows = dataclasses.replace(batch, context_tokens=torch.tensor(context))
    outputs: list[torch.Tensor] = []
    model.decoder.register_forward_hook(lambda m, inputs, out: outputs.append(out))
    torch.manual_seed(1)
    out = model.loss(windows)
    nll = model.eval().token_nll(batch)
    scored = windows.scored_mask()
    sentences = [s for doc in DOCS for s in doc]
    kept = [(b, s) for b, doc in enumerate(DOCS) for s in range(len(doc))]
    first = {0: 2, 1: 0, 2: 1}  # each row's first scored sentence
    is_scored = [s >= first[b] for b, s in kept]
    assert [bool(scored[b, s].any()) for b, s in kept] == is_scored
    assert out.n_tokens == sum(len(x) for x, on in zip(sentences, is_scored, strict=True) if on)
    torch.testing.assert_close(model.eval().loss(windows).nll_sum, (nll * scored).sum())
    hidden = outputs[0]  # [real sentences, length, d]: the scored ones regularised
    squares = sum(hidden[i, : len(x)].pow(2).sum() for i, x in enumerate(sentences) if is_scored[i])
    tokens = sum(len(x) for x, on in zip(sentences, is_scored, strict=True) if on)
    torch.testing.assert_close(out.terms["ar"], 0.2 * squares / (tokens * hidden.shape[-1]))
    monkeypatch.setattr(hgpt_module, "static_shapes", lambda like: True)
    static = model.eval().loss(windows)
    torch.testing.assert_close(static.nll_sum, (nll * scored).sum(), atol=1e-4, rtol=1e-5)
