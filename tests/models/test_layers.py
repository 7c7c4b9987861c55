"""The shared layers: mask convention, fully masked rows, congruent attention, KV caches,
sinusoidal positions by arbitrary index, initialisation gains."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeline.models.base import RESIDUAL_INIT_GAIN as OUTPUT_GAIN
from pipeline.models.base import BlockDims, count_parameters
from pipeline.models.blocks import Decoder, EncoderLayer
from pipeline.models.layers import (
    FeedForward,
    KVCache,
    MultiHeadAttention,
    SegmentEmbedding,
    SinusoidalPositions,
    TokenEmbedding,
    TokenGrid,
    TokenGroups,
    attend,
    causal_mask,
    padding_mask,
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def reference_attention(q, k, v, allowed):
    """Plain softmax attention; ``allowed`` broadcastable to ``[B, H, Lq, Lk]``."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


# --------------------------------------------------------------------------- masks


def test_causal_mask_by_hand() -> None:
    assert causal_mask(3, 3).tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]
    # The last 2 of 4 positions: query 0 is position 2.
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_true_means_may_attend() -> None:
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    key_mask = torch.tensor([[True, True, False, True, False], [True, False, True, True, True]])
    out = attend(q, k, v, padding_mask(key_mask), causal=False, dropout=0.0)
    expected = reference_attention(q, k, v, padding_mask(key_mask))
    torch.testing.assert_close(out, expected)
    # A masked key's value never reaches the output.
    v2 = v.clone()
    v2[0, :, 2] += 100.0
    v2[1, :, 1] -= 100.0
    torch.testing.assert_close(attend(q, k, v2, padding_mask(key_mask), False, 0.0), out)


def test_three_dim_mask_combines_with_causal() -> None:
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    mask = torch.tensor([[[True, False, True], [True, True, True], [False, True, True]]])
    out = attend(q, k, v, mask, causal=True, dropout=0.0)
    allowed = mask.unsqueeze(1) & causal_mask(3, 3)
    torch.testing.assert_close(out, reference_attention(q, k, v, allowed))


def test_fully_masked_rows_are_zero_without_nan() -> None:
    q = torch.randn(2, 2, 3, 4, requires_grad=True)
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    mask = torch.ones(2, 1, 3, 3, dtype=torch.bool)
    mask[0, :, 1] = False  # query 1 of row 0 may attend nothing
    mask[1] = False  # row 1 entirely masked
    out = attend(q, k, v, mask, causal=False, dropout=0.0)
    assert not out.isnan().any()
    assert (out[0, :, 1] == 0).all() and (out[1] == 0).all()
    torch.testing.assert_close(out[0, :, 0], reference_attention(q, k, v, mask)[0, :, 0])
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# --------------------------------------------------------------------------- attention module


def test_separate_query_key_output_widths_and_head_size() -> None:
    mha = MultiHeadAttention(d_query=6, n_heads=3, d_head=5, d_kv=10, d_out=7)
    out = mha(torch.randn(2, 4, 6), torch.randn(2, 9, 10))
    assert out.shape == (2, 4, 7)
    inner = 3 * 5
    assert count_parameters(mha) == (6 * inner + inner) + 2 * (10 * inner + inner) + inner * 7 + 7


def test_heads_must_divide_width_without_explicit_head_size() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadAttention(10, n_heads=3)
    assert MultiHeadAttention(10, n_heads=3, d_head=4).d_head == 4


def test_congruent_attention_shares_query_and_key_projection() -> None:
    plain = MultiHeadAttention(8, n_heads=2)
    congruent = MultiHeadAttention(8, n_heads=2, congruent=True)
    assert congruent.q_proj is congruent.k_proj
    assert count_parameters(plain) - count_parameters(congruent) == 8 * 8 + 8
    # Shared W_q = W_k makes the head-wise score matrix of a sequence with itself symmetric.
    x = torch.randn(1, 5, 8)
    q = congruent._heads(congruent.q_proj(x))
    k = congruent._heads(congruent.k_proj(x))
    scores = q @ k.transpose(-1, -2)
    torch.testing.assert_close(scores, scores.transpose(-1, -2))
    congruent(x).sum().backward()
    assert congruent.q_proj.weight.grad is not None
    with pytest.raises(ValueError, match="congruent"):
        MultiHeadAttention(8, n_heads=2, d_kv=6, congruent=True)


def _two_groups() -> tuple[TokenGroups, torch.Tensor]:
    """Five tokens in groups {0, 1, 2} and {3, 4} (slots of a 2 x 3 grid) and the
    equivalent ``[1, 5, 5]`` block-diagonal mask over the same tokens as one sequence."""
    groups = TokenGroups.within(
        TokenGrid(
            slots=torch.tensor([0, 1, 2, 3, 4]),
            mask=torch.tensor([[True, True, True], [True, True, False]]),
        )
    )
    group = torch.tensor([0, 0, 0, 1, 1])
    return groups, (group[:, None] == group[None, :]).unsqueeze(0)


def test_grouped_attention_equals_a_block_diagonal_mask() -> None:
    groups, block = _two_groups()
    layer = EncoderLayer(BlockDims(8, 2, 16, dropout=0.0)).train()
    x = torch.randn(5, 8, requires_grad=True)
    grouped = layer(x, groups=groups)
    masked = layer(x.unsqueeze(0), mask=block).squeeze(0)
    assert torch.allclose(grouped, masked, atol=1e-6)
    (g_grouped,) = torch.autograd.grad(grouped.square().sum(), x)
    (g_masked,) = torch.autograd.grad(masked.square().sum(), x)
    assert torch.allclose(g_grouped, g_masked, atol=1e-6)


def test_blocks_of_queries_attend_their_own_key_sets() -> None:
    """Tokens 0-2 see each other; tokens 3-4 see all five (the HIER CT-mask's shape)."""
    earlier = torch.tensor([0, 1, 2])
    grid = TokenGrid(torch.tensor([0, 1, 2]), torch.ones(1, 3, dtype=torch.bool))
    blocks = (
        TokenGroups(grid, grid, queries=earlier, keys=earlier),
        TokenGroups(
            TokenGrid(torch.tensor([0, 1]), torch.ones(1, 2, dtype=torch.bool)),
            TokenGrid(torch.arange(5), torch.ones(1, 5, dtype=torch.bool)),
            queries=torch.tensor([3, 4]),
        ),
    )
    mask = torch.ones(1, 5, 5, dtype=torch.bool)
    mask[0, :3, 3:] = False
    layer = EncoderLayer(BlockDims(8, 2, 16, dropout=0.0))
    x = torch.randn(5, 8)
    assert torch.allclose(layer(x, groups=blocks), layer(x[None], mask=mask)[0], atol=1e-6)


def test_attention_dropout_is_separate_from_dropout() -> None:
    layer = EncoderLayer(BlockDims(8, 2, 16, dropout=0.3, attention_dropout=0.0))
    assert layer.attn.dropout == 0.0 and layer.attn_dropout.p == layer.ffn_dropout.p == 0.3
    assert EncoderLayer(BlockDims(8, 2, 16, dropout=0.3)).attn.dropout == 0.3
    decoder = Decoder(11, 1, BlockDims(8, 2, 16, dropout=0.2, attention_dropout=0.5))
    assert decoder.layers[0].self_attn.dropout == decoder.layers[0].cross_attn.dropout == 0.5
    # Attention-probability dropout alone still randomises training outputs.
    only_attn = EncoderLayer(BlockDims(8, 2, 16, dropout=0.0, attention_dropout=0.5)).train()
    x = torch.randn(2, 6, 8)
    assert not torch.allclose(only_attn(x), only_attn(x))
    assert torch.allclose(only_attn.eval()(x), only_attn(x))


def test_growing_cache_equals_full_causal_attention() -> None:
    mha = MultiHeadAttention(8, n_heads=2).eval()
    x = torch.randn(2, 6, 8)
    full = mha(x, causal=True)
    cache = KVCache()
    pieces = [mha(x[:, :3], causal=True, cache=cache)]  # a prefix chunk, then single steps
    pieces += [mha(x[:, t : t + 1], causal=True, cache=cache) for t in range(3, 6)]
    assert cache.length == 6
    torch.testing.assert_close(torch.cat(pieces, 1), full)


def test_static_cache_projects_memory_once() -> None:
    mha = MultiHeadAttention(8, n_heads=2, d_kv=4).eval()
    memory = torch.randn(2, 5, 4)
    cache = KVCache(static=True)
    first = mha(torch.randn(2, 1, 8), memory, cache=cache)
    query = torch.randn(2, 1, 8)
    # The cached memory is used even when another (here: garbage) memory is passed.
    with_cache = mha(query, torch.randn(2, 5, 4), cache=cache)
    torch.testing.assert_close(with_cache, mha(query, memory))
    assert first.shape == (2, 1, 8) and cache.length == 5
    order = torch.tensor([1, 1, 0])
    picked = cache.select(order)
    assert picked.static and torch.equal(picked.k, cache.k[order])


# --------------------------------------------------------------------------- stacks


def test_encoder_layer_as_gpt_block_is_causal() -> None:
    layer = EncoderLayer(BlockDims(8, 2, 16, dropout=0.0)).eval()
    x = torch.randn(1, 6, 8)
    y = x.clone()
    y[0, 4] += 1.0
    a, b = layer(x, causal=True), layer(y, causal=True)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def _decoder(d_memory=None) -> Decoder:
    return Decoder(30, 2, BlockDims(8, 2, 16, dropout=0.0), d_memory=d_memory).eval()


def test_decoder_cache_equals_full_decoding_and_reorders() -> None:
    decoder = _decoder()
    tokens = torch.randint(1, 30, (3, 7))
    memory = torch.randn(3, 4, 8)
    memory_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    full = decoder(tokens, memory, memory_mask)
    cache = decoder.init_cache()
    steps = [decoder(tokens[:, :2], memory, memory_mask, cache)]
    steps += [decoder(tokens[:, t : t + 1], memory, memory_mask, cache) for t in range(2, 5)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, :5])
    assert cache.position == 5
    # Beam reordering: continue rows [2, 0, 0] from the cache.
    order = torch.tensor([2, 0, 0])
    cache = cache.select(order)
    rest = [
        decoder(tokens[order, t : t + 1], memory[order], memory_mask[order], cache)
        for t in range(5, 7)
    ]
    torch.testing.assert_close(torch.cat(rest, 1), full[order, 5:])


def test_decoder_output_is_tied_to_embedding() -> None:
    decoder = _decoder()
    assert decoder.output.weight is decoder.embed.weight


def test_decoder_per_layer_memories() -> None:
    decoder = _decoder(d_memory=[5, 3])
    assert decoder.layers[0].cross_attn.k_proj.in_features == 5
    assert decoder.layers[1].cross_attn.k_proj.in_features == 3
    tokens = torch.randint(1, 30, (2, 4))
    memories = [torch.randn(2, 6, 5), torch.randn(2, 2, 3)]
    masks = [torch.ones(2, 6, dtype=torch.bool), torch.tensor([[True, False], [True, True]])]
    out = decoder(tokens, memories, masks)
    changed = [memories[0], memories[1].clone()]
    changed[1][0, 1] += 5.0  # a masked key of layer 1's memory: no effect
    torch.testing.assert_close(decoder(tokens, changed, masks), out)
    changed[1][1, 1] += 5.0  # a real key: an effect
    assert not torch.allclose(decoder(tokens, changed, masks)[1], out[1])


# --------------------------------------------------------------------------- encodings


def test_sinusoidal_positions_by_hand_and_by_arbitrary_index() -> None:
    pe = SinusoidalPositions(4)
    expected = torch.tensor([math.sin(3), math.cos(3), math.sin(3 / 100), math.cos(3 / 100)])
    torch.testing.assert_close(pe(torch.tensor(3)), expected)
    table = pe.range(10)
    torch.testing.assert_close(table[0], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    positions = torch.tensor([[7, 0, 2], [9, 9, 1]])
    torch.testing.assert_close(pe(positions), table[positions])
    assert SinusoidalPositions(5).range(3).shape == (3, 5)


def test_token_embedding_pad_row_and_scale() -> None:
    emb = TokenEmbedding(20, 16)
    assert (emb.weight[0] == 0).all()
    ids = torch.tensor([[3, 0]])
    torch.testing.assert_close(emb(ids)[0, 0], emb.weight[3] * 4.0)
    assert (emb(ids)[0, 1] == 0).all()


def test_segment_embedding_shares_its_last_row_past_the_table() -> None:
    seg = SegmentEmbedding(3, 4)
    out = seg(torch.tensor([0, 2, 5, 100]))
    torch.testing.assert_close(out[2], seg.weight[2])
    torch.testing.assert_close(out[3], seg.weight[2])


# --------------------------------------------------------------------------- initialisation


def _xavier_bound(linear: nn.Linear) -> float:
    fan_out, fan_in = linear.weight.shape
    return math.sqrt(6.0 / (fan_in + fan_out))


@pytest.mark.parametrize("name", ["transformer", "unet", "hier", "transformer_ranker", "gpt"])
@pytest.mark.parametrize("gain", [OUTPUT_GAIN, 1.0])
def test_residual_init_gain_sets_every_residual_branchs_output_projection(name, gain) -> None:
    """``residual_init_gain`` reaches every attention W_O and FFN outer layer of a model's
    Transformer layers (encoder, decoder's self- and cross-attention, U-Net layers): their
    weights span that gain times the Xavier bound, and nothing else is scaled."""
    from pipeline.models import registry
    from pipeline.models.selection import HighwayAttention

    torch.manual_seed(0)
    model = registry.build(name, 300, residual_init_gain=gain, **SMALL[name])
    highway = {id(m.mha) for m in model.modules() if isinstance(m, HighwayAttention)}
    projections = [
        *(
            m.out_proj
            for m in model.modules()
            if isinstance(m, MultiHeadAttention)
            if id(m) not in highway
        ),
        *(m.outer for m in model.modules() if isinstance(m, FeedForward)),
    ]
    assert len(projections) >= 2
    for linear in projections:
        bound = _xavier_bound(linear)
        assert 0.9 * gain * bound < linear.weight.abs().max() <= gain * bound


SMALL = {
    "transformer": {"d_model": 16, "n_heads": 2, "d_head": 8, "d_ff": 32},
    "unet": {"d_model": 16, "n_layers": 4, "n_heads": 2, "d_head": 8, "d_ff": 32},
    "hier": {"d_model": 16, "n_heads": 2, "d_ff": 32},
    "transformer_ranker": {"d_embed": 16, "d_model": 16, "n_heads": 2, "d_ff": 32},
    "gpt": {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32},
}


def test_initialisation_gains() -> None:
    mha = MultiHeadAttention(64, n_heads=4)
    for proj in (mha.q_proj, mha.k_proj, mha.v_proj):
        bound = _xavier_bound(proj)
        assert proj.weight.abs().max() <= bound
        assert proj.weight.abs().max() > 0.9 * bound  # uniform over the whole range
        assert (proj.bias == 0).all()
    out_bound = OUTPUT_GAIN * _xavier_bound(mha.out_proj)
    assert mha.out_proj.weight.abs().max() <= out_bound
    assert mha.out_proj.weight.abs().max() > 0.9 * out_bound

    ffn = FeedForward(64, 256)
    kaiming_bound = math.sqrt(2.0) * math.sqrt(3.0 / 64)  # gain sqrt(2) for ReLU, fan_in 64
    assert ffn.inner.weight.abs().max() <= kaiming_bound
    assert ffn.inner.weight.abs().max() > 0.9 * kaiming_bound
    assert ffn.outer.weight.abs().max() <= OUTPUT_GAIN * _xavier_bound(ffn.outer)
    assert (ffn.inner.bias == 0).all() and (ffn.outer.bias == 0).all()
