"""Transformer baseline: segments, causality, padding invariance, incremental decoding,
config errors, paper-size parameter counts, overfitting real chitchat.

The ``assert_*`` / ``overfit`` helpers are model-agnostic; ``test_unet.py`` reuses them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from pipeline.data.batch import GenerateBatch, History
from pipeline.errors import ConfigError
from pipeline.models import registry
from pipeline.models.base import Seq2SeqModel, count_parameters, select_batch_dim
from pipeline.models.seq2seq import recent_first_segments
from pipeline.models.transformer import Transformer, TransformerConfig
from tests.batches import chitchat_generate_batch, make_history, random_generate_batch

SMALL = {"d_model": 16, "n_heads": 2, "d_head": 8, "d_ff": 32, "n_decoder_layers": 2}
VOCAB = 50


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# --------------------------------------------------------------------------- helpers


def pad_columns(batch: GenerateBatch, history: int, target: int) -> GenerateBatch:
    """The same batch with extra all-padding columns at the end of history and target."""

    def extend(t: Tensor, n: int) -> Tensor:
        return torch.cat([t, torch.zeros(t.shape[0], n, dtype=t.dtype)], dim=1)

    h = batch.history
    padded = History(*(extend(getattr(h, f.name), history) for f in dataclasses.fields(h)))
    return dataclasses.replace(
        batch,
        history=padded,
        target_ids=extend(batch.target_ids, target),
        target_mask=extend(batch.target_mask, target),
    )


def single(batch: GenerateBatch, i: int) -> GenerateBatch:
    """Row ``i`` alone, without any padding."""
    h = batch.history
    length, t_length = int(h.input_mask[i].sum()), int(batch.target_mask[i].sum())
    alone = History(*(getattr(h, f.name)[i : i + 1, :length] for f in dataclasses.fields(h)))
    return dataclasses.replace(
        batch,
        history=alone,
        target_ids=batch.target_ids[i : i + 1, :t_length],
        target_mask=batch.target_mask[i : i + 1, :t_length],
        turn=batch.turn[i : i + 1],
        dialogue_id=batch.dialogue_id[i : i + 1],
    )


def teacher_forced_logits(model: Seq2SeqModel, batch: GenerateBatch) -> Tensor:
    logits, _ = model.decode(batch.target_ids[:, :-1], model.encode(batch))
    return logits


@torch.no_grad()
def assert_padding_invariant(model: Seq2SeqModel, batch: GenerateBatch) -> None:
    """Extra pad columns change no real output nor the loss; batched == one by one."""
    model.eval()
    base = teacher_forced_logits(model, batch)
    loss = model.loss(batch)
    assert not base.isnan().any()
    for extra_h, extra_t in ((1, 0), (3, 2), (4, 1)):
        padded = pad_columns(batch, extra_h, extra_t)
        logits = teacher_forced_logits(model, padded)
        assert not logits.isnan().any()
        torch.testing.assert_close(logits[:, : base.shape[1]], base, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.loss(padded).loss, loss.loss, atol=1e-6, rtol=1e-5)
    total = torch.zeros(())
    for i in range(batch.batch_size):
        row = single(batch, i)
        alone = teacher_forced_logits(model, row)
        torch.testing.assert_close(alone[0], base[i, : alone.shape[1]], atol=1e-5, rtol=1e-5)
        total += model.loss(row).nll_sum
    torch.testing.assert_close(total, loss.nll_sum, atol=1e-4, rtol=1e-5)


@torch.no_grad()
def assert_decoder_causal(model: Seq2SeqModel, batch: GenerateBatch, t: int = 3) -> None:
    """Changing target token ``t`` changes no logit before position ``t``."""
    model.eval()
    memory = model.encode(batch)
    tokens = batch.target_ids.clone()
    base, _ = model.decode(tokens, memory)
    tokens[:, t] = (tokens[:, t] + 7) % (model.config.vocab_size - 5) + 5
    changed, _ = model.decode(tokens, memory)
    torch.testing.assert_close(changed[:, :t], base[:, :t])
    assert not torch.allclose(changed[:, t], base[:, t])


@torch.no_grad()
def assert_incremental_matches_full(model: Seq2SeqModel, batch: GenerateBatch) -> None:
    """Decoding through the state (a chunk, then single steps, then a beam reorder) equals
    decoding the whole prefix at once."""
    model.eval()
    tokens = batch.target_ids
    memory = model.encode(batch)
    full, _ = model.decode(tokens, memory)
    state = model.init_state(memory, batch.batch_size)
    assert state is not None
    pieces = [model.decode(tokens[:, :2], memory, state)[0]]
    for t in range(2, 4):
        logits, state = model.decode(tokens[:, t : t + 1], memory, state)
        pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full[:, :4], atol=1e-5, rtol=1e-5)
    order = torch.arange(batch.batch_size).flip(0).repeat_interleave(2)
    state = state.select(order)
    memory = select_batch_dim(memory, order)
    rest = []
    for t in range(4, tokens.shape[1]):
        logits, state = model.decode(tokens[order, t : t + 1], memory, state)
        rest.append(logits)
    torch.testing.assert_close(torch.cat(rest, 1), full[order, 4:], atol=1e-5, rtol=1e-5)


def overfit(model: Seq2SeqModel, batch: GenerateBatch, steps: int = 15) -> tuple[float, float]:
    """Adam (lr 1e-2, clip 1) on one batch; returns the first and the last loss. Small models
    halve their loss within ~10 steps: few steps keep the test fast on a busy machine."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    first = last = 0.0
    for step in range(steps):
        loss = model.loss(batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    return first, last


def small(name: str, vocab_size: int = VOCAB, **overrides) -> Seq2SeqModel:
    model = registry.build(name, vocab_size, **{**SMALL, **overrides})
    assert isinstance(model, Seq2SeqModel)
    return model


# --------------------------------------------------------------------------- tests


def test_segments_count_from_the_most_recent_utterance() -> None:
    history = make_history(
        [[[2, 7, 3], [2, 8, 9, 3], [2, 5, 3]], [[2, 6, 3]]],
        [[1, 2, 1], [2]],
    )
    expected = [[2, 2, 2, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert recent_first_segments(history).tolist() == expected


def test_last_utterance_embedding_does_not_depend_on_history_length() -> None:
    model = small("transformer").eval()
    short = make_history([[[2, 7, 3]]], [[1]])
    long = make_history([[[2, 9, 9, 3], [2, 7, 3]]], [[2, 1]])
    a = model.embedding.segments(recent_first_segments(short))[0, -1]
    b = model.embedding.segments(recent_first_segments(long))[0, -1]
    torch.testing.assert_close(a, b)


def test_shapes_and_pad_outputs() -> None:
    batch = random_generate_batch(4, VOCAB)
    model = small("transformer").eval()
    memory = model.encode(batch)
    length = batch.history.input_ids.shape[1]
    assert memory.states.shape == (4, length, 16)
    assert (memory.states[~batch.history.input_mask] == 0).all()
    logits, _ = model.decode(batch.target_ids, memory)
    assert logits.shape == (*batch.target_ids.shape, VOCAB)
    out = model.loss(batch)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert out.n_tokens == batch.target_mask[:, 1:].sum()


def test_encoder_and_decoder_share_the_embedding() -> None:
    model = small("transformer")
    assert model.embedding.tokens is model.decoder.embed
    assert model.decoder.output.weight is model.decoder.embed.weight


def test_decoder_is_causal() -> None:
    assert_decoder_causal(small("transformer"), random_generate_batch(3, VOCAB, max_target=8))


@pytest.mark.parametrize("name", ["transformer", "adj_transformer"])
def test_padding_invariance_and_batched_equals_one_by_one(name: str) -> None:
    overrides = {"d_model": 15, "d_head": 4} if name == "adj_transformer" else {}
    model = small(name, **overrides)
    assert_padding_invariant(model, random_generate_batch(4, VOCAB, seed=1))


def test_incremental_decoding_matches_full_decoding() -> None:
    assert_incremental_matches_full(
        small("transformer"), random_generate_batch(3, VOCAB, max_target=8, seed=2)
    )


def test_gradients_reach_every_parameter() -> None:
    model = small("transformer")
    model.loss(random_generate_batch(3, VOCAB)).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_invalid_configs_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"transformer\.n_heads: 8 heads do not divide"):
        registry.build("transformer", VOCAB, d_model=30, n_heads=8, d_head=None)
    with pytest.raises(ConfigError, match=r"transformer\.dropout"):
        registry.build("transformer", VOCAB, dropout=1.5)
    with pytest.raises(ConfigError, match=r"adj_transformer\.bogus"):
        registry.build("adj_transformer", VOCAB, bogus=1)


def transformer_parameters(vocab: int, d: int, heads: int, d_head: int, d_ff: int) -> int:
    """Hand count: shared embedding/output, 6 encoder + 6 decoder layers, 32 segments."""
    inner = heads * d_head
    attention = 3 * (d * inner + inner) + inner * d + d
    ffn = d * d_ff + d_ff + d_ff * d + d
    norm = 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    return vocab * d + 32 * d + 6 * encoder_layer + 6 * decoder_layer


def test_paper_sizes_and_parameter_counts() -> None:
    transformer = registry.build("transformer", 20_000)
    adj = registry.build("adj_transformer", 20_000)
    assert count_parameters(transformer) == transformer_parameters(20_000, 256, 8, 64, 1024)
    assert count_parameters(adj) == transformer_parameters(20_000, 301, 8, 64, 1204)
    # The paper: ADJ-Transformer matches the U-Net's 25M.
    assert abs(count_parameters(adj) - 25e6) / 25e6 < 0.10
    # The paper quotes 18M for the vanilla Transformer, but its stated sizes (8 heads of
    # key/value size 64 at d=256, FFN 1024, 6+6 layers, shared 20k embedding) give 20.9M,
    # as does the authors' code; 18M is not reachable with them (see the report).
    assert 20.5e6 < count_parameters(transformer) < 21.3e6


def test_defaults_are_the_papers() -> None:
    c = TransformerConfig(vocab_size=10)
    assert (c.d_model, c.n_encoder_layers, c.n_decoder_layers) == (256, 6, 6)
    assert (c.n_heads, c.head_size, c.d_ff, c.dropout) == (8, 64, 1024, 0.1)
    model = Transformer(c)
    assert len(model.encoder.layers) == 6 and len(model.decoder.layers) == 6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformer", "adj_transformer"])
def test_overfits_a_real_chitchat_batch(name: str) -> None:
    batch, vocab = chitchat_generate_batch(8, 400)
    extra = {"d_model": 31, "d_head": 8} if name == "adj_transformer" else {"d_model": 32}
    model = small(name, len(vocab), n_heads=4, d_ff=64, n_encoder_layers=2, dropout=0.0, **extra)
    first, last = overfit(model, batch)
    assert last < first / 2, (first, last)
