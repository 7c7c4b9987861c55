"""U-Net Transformer: sizes, lengths, pad propagation, each ablation switch, padding
invariance, incremental decoding, config errors, paper-size parameter counts, overfitting."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from pipeline.errors import ConfigError
from pipeline.models import registry
from pipeline.models.base import count_parameters
from pipeline.models.transformer import Transformer, TransformerConfig
from pipeline.models.unet import UNetConfig, UNetTransformer, pool_mask
from tests.batches import chitchat_generate_batch, random_generate_batch
from tests.models.test_transformer import (
    SMALL,
    VOCAB,
    assert_decoder_causal,
    assert_incremental_matches_full,
    assert_padding_invariant,
    overfit,
    transformer_parameters,
)
from tests.models.test_transformer import small as small_transformer

NAMES = ["unet", "unet_linear", "unet_per_layer_att", "transformer_skip", "transformer_skip_conv"]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def small(name: str, vocab_size: int = VOCAB, **overrides) -> UNetTransformer:
    """A registered model at small sizes; per-layer attention needs 6 decoder layers."""
    if name == "unet_per_layer_att":
        overrides = {"n_decoder_layers": 6, **overrides}
    model = small_transformer(name, vocab_size, **overrides)
    assert isinstance(model, UNetTransformer)
    return model


def unet(**switches) -> UNetTransformer:
    """A small U-Net with the given switches (full U-Net by default), eval mode."""
    sizes = {**SMALL, "n_decoder_layers": 6} if switches.get("per_layer_attention") else SMALL
    return UNetTransformer(UNetConfig(vocab_size=VOCAB, **sizes, **switches)).eval()


def embedded(model: UNetTransformer, length: int, batch: int = 2):
    """Random encoder input with right padding: row 0 full, row 1 about half."""
    x = torch.randn(batch, length, model.config.d_model)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1:, (length + 1) // 2 :] = False
    return x * mask.unsqueeze(-1), mask


# --------------------------------------------------------------------------- sizes and lengths


def test_paper_widths_head_sizes_and_ffn() -> None:
    c = UNetConfig(vocab_size=10)
    assert c.widths == [256, 362, 512, 362, 256, 256]
    assert c.head_sizes == [64, 91, 128, 91, 64, 64]
    assert c.ffn_sizes == [1024, 1448, 2048, 1448, 1024, 1024]
    assert (c.n_heads, c.n_layers, c.n_decoder_layers, c.dropout) == (8, 6, 6, 0.1)
    model = UNetTransformer(c)
    layer = model.encoder.layers[2]  # second down layer: 362 -> 512
    assert layer.attn.q_proj.in_features == 512 and layer.attn.k_proj.in_features == 362
    assert layer.attn.n_heads == 8 and layer.attn.d_head == 128
    assert layer.conv.depthwise.groups == 362


@pytest.mark.parametrize("length", [1, 2, 5, 6, 7, 8, 13])
def test_lengths_halve_and_come_back_exactly(length: int) -> None:
    model = unet()
    x, mask = embedded(model, length)
    outputs, masks = model.encoder(x, mask)
    half, quarter = math.ceil(length / 2), math.ceil(length / 4)
    assert [o.shape[1] for o in outputs] == [length, half, quarter, half, length, length]
    assert [o.shape[2] for o in outputs] == model.config.widths
    assert [m.shape[1] for m in masks] == [o.shape[1] for o in outputs]
    assert torch.equal(masks[-1], mask)


def brute_force_pool(mask: torch.Tensor) -> torch.Tensor:
    """Each row alone (cut at its last real token): MaxPool1d(3, 2, 1) has ceil(L/2)
    windows; an output is real iff its window holds a real token."""
    rows = []
    for row in mask:
        length = int(row.nonzero().max()) + 1 if row.any() else 0
        rows.append(
            [
                j < math.ceil(length / 2)
                and bool(row[max(0, 2 * j - 1) : min(2 * j + 2, length)].any())
                for j in range(math.ceil(mask.shape[1] / 2))
            ]
        )
    return torch.tensor(rows, dtype=torch.bool)


def test_pool_mask_by_hand_and_by_brute_force() -> None:
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    assert pool_mask(mask).tolist() == [[True, True, False, False]]
    mask = torch.tensor([[0, 0, 1, 0, 0, 0]], dtype=torch.bool)  # window {1, 2, 3} only
    assert pool_mask(mask).tolist() == [[False, True, False]]
    # Even length 4 alone pools to 2 outputs; the window {3, 4, 5} that padding adds holds
    # only token 3, already in window {1, 2, 3}: it stays padding.
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert pool_mask(mask).tolist() == [[True, True, False]]
    random = torch.rand(30, 11) < 0.5
    assert torch.equal(pool_mask(random), brute_force_pool(random))
    right_padded = torch.arange(12)[None, :] < torch.arange(13)[:, None]
    assert torch.equal(pool_mask(right_padded), right_padded[:, ::2])


def test_down_output_is_pad_iff_its_whole_window_is_pad() -> None:
    model = unet()
    x, mask = embedded(model, 11, batch=3)
    mask[2, 3:] = False
    x = x * mask.unsqueeze(-1)
    outputs, masks = model.encoder(x, mask)
    assert torch.equal(masks[1], brute_force_pool(mask))
    assert torch.equal(masks[2], brute_force_pool(masks[1]))
    for out, m in zip(outputs, masks, strict=True):
        assert (out[~m] == 0).all()
        assert (out[m].abs().sum(-1) > 0).all()


# --------------------------------------------------------------------------- ablation switches


def reference_encoder(model: UNetTransformer, x, mask, skip: bool):
    """The paper's wiring for 6 layers, written out: skips add the in-layer's and the first
    down layer's outputs to the outputs of the up layers of the same size."""
    layers = model.encoder.layers
    m0 = mask
    m1 = pool_mask(m0) if model.config.down_up else m0
    m2 = pool_mask(m1) if model.config.down_up else m1
    h0 = layers[0](x, m0, m0)
    h1 = layers[1](h0, m0, m1)
    h2 = layers[2](h1, m1, m2)
    h3 = layers[3](h2, m2, m1)
    h4 = layers[4](h3 + h1 if skip else h3, m1, m0)
    return layers[5](h4 + h0 if skip else h4, m0, m0)


@torch.no_grad()
@pytest.mark.parametrize("down_up", [True, False])
def test_skip_switch_adds_exactly_the_same_size_outputs(down_up: bool) -> None:
    with_skip, without = unet(down_up=down_up), unet(down_up=down_up, skip=False)
    assert with_skip.state_dict().keys() == without.state_dict().keys()
    without.load_state_dict(with_skip.state_dict())
    x, mask = embedded(with_skip, 9)
    a = with_skip.encoder(x, mask)[0][-1]
    b = without.encoder(x, mask)[0][-1]
    torch.testing.assert_close(a, reference_encoder(with_skip, x, mask, skip=True))
    torch.testing.assert_close(b, reference_encoder(with_skip, x, mask, skip=False))
    assert not torch.allclose(a, b)


@torch.no_grad()
def test_all_switches_off_is_exactly_the_transformer() -> None:
    plain = unet(skip=False, conv=False, down_up=False, width_growth=1.0)
    transformer = Transformer(TransformerConfig(vocab_size=VOCAB, **SMALL)).eval()
    transformer.load_state_dict(plain.state_dict())  # strict: identical parameters
    batch = random_generate_batch(4, VOCAB, seed=3)
    torch.testing.assert_close(plain.loss(batch).loss, transformer.loss(batch).loss)
    torch.testing.assert_close(plain.encode(batch).states, transformer.encode(batch).states)


def _keys(model) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@torch.no_grad()
def test_conv_switch_adds_only_the_conv_module_and_its_norm() -> None:
    with_conv = registry.build("transformer_skip_conv", VOCAB, **SMALL).eval()
    without = registry.build("transformer_skip", VOCAB, **SMALL).eval()
    on, off = _keys(with_conv), _keys(without)
    added = set(on) - set(off)
    assert set(off) <= set(on)
    assert {k.split(".")[3] for k in added} == {"conv", "norm_conv"}
    assert all(on[k] == off[k] for k in off)
    # Without conv the query is the layer input; with it, a token's query depends only on
    # its neighbours (kernel 3) and, same size in and out, on itself through the residual.
    layer_off, layer_on = without.encoder.layers[0], with_conv.encoder.layers[0]
    x, mask = embedded(with_conv, 9)
    assert layer_off.query(x, mask, mask) is x
    y = x.clone()
    y[0, 4] += 1.0
    changed = (layer_on.query(y, mask, mask) - layer_on.query(x, mask, mask)).abs().sum(-1)
    assert changed[0].nonzero().flatten().tolist() == [3, 4, 5]
    assert (changed[1] == 0).all()
    without.load_state_dict({k: v for k, v in with_conv.state_dict().items() if k in off})
    batch = random_generate_batch(3, VOCAB)
    assert not torch.allclose(with_conv.loss(batch).loss, without.loss(batch).loss)


@torch.no_grad()
def test_down_up_switch_changes_lengths_and_nothing_else() -> None:
    resampled, flat = unet(), unet(down_up=False)
    assert _keys(resampled) == _keys(flat)  # the same parameters, shape for shape
    flat.load_state_dict(resampled.state_dict())
    x, mask = embedded(resampled, 10)
    out_r, _ = resampled.encoder(x, mask)
    out_f, _ = flat.encoder(x, mask)
    assert [o.shape[1] for o in out_r] == [10, 5, 3, 5, 10, 10]
    assert [o.shape[1] for o in out_f] == [10] * 6
    torch.testing.assert_close(out_r[0], out_f[0])  # the in-layer does not resample
    assert not torch.allclose(out_r[-1], out_f[-1])
    assert isinstance(resampled.encoder.layers[3].conv.depthwise, torch.nn.ConvTranspose1d)
    assert isinstance(flat.encoder.layers[3].conv.depthwise, torch.nn.Conv1d)


@torch.no_grad()
def test_linear_skip_adds_only_a_linear_that_at_identity_is_the_plain_skip() -> None:
    linear, plain = unet(linear_skip=True), unet()
    on, off = _keys(linear), _keys(plain)
    assert set(on) - set(off) == {
        f"encoder.skip_proj.{t}.{p}" for t in (3, 4) for p in ("weight", "bias")
    }
    linear.load_state_dict(plain.state_dict(), strict=False)
    batch = random_generate_batch(3, VOCAB, seed=4)
    assert not torch.allclose(linear.loss(batch).loss, plain.loss(batch).loss)
    for proj in linear.encoder.skip_proj.values():
        proj.weight.copy_(torch.eye(proj.in_features))
        proj.bias.zero_()
    torch.testing.assert_close(linear.loss(batch).loss, plain.loss(batch).loss)


@torch.no_grad()
def test_per_layer_attention_feeds_decoder_layer_i_encoder_layer_i() -> None:
    model = unet(per_layer_attention=True)
    widths = model.config.widths
    assert [layer.cross_attn.k_proj.in_features for layer in model.decoder.layers] == widths
    batch = random_generate_batch(3, VOCAB, seed=5)
    memory = model.encode(batch)
    outputs, masks = model.encoder(model.embedding(batch.history), batch.history.input_mask)
    seen: list[torch.Tensor] = []
    hooks = [
        layer.cross_attn.register_forward_pre_hook(lambda _m, args: seen.append(args[1]))
        for layer in model.decoder.layers
    ]
    model.decode(batch.target_ids, memory)
    for hook in hooks:
        hook.remove()
    for got, want in zip(seen, outputs, strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(memory.masks, masks, strict=True):
        assert torch.equal(got, want)
    plain = unet()
    assert isinstance(plain.encode(batch).states, torch.Tensor)


# --------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("name", NAMES)
def test_padding_invariance_and_batched_equals_one_by_one(name: str) -> None:
    batch = random_generate_batch(4, VOCAB, max_utterances=4, max_utt_len=7, seed=6)
    assert_padding_invariant(small(name), batch)


@pytest.mark.parametrize("name", ["unet", "unet_per_layer_att"])
def test_incremental_decoding_matches_full_decoding(name: str) -> None:
    batch = random_generate_batch(3, VOCAB, max_target=8, seed=7)
    assert_incremental_matches_full(small(name), batch)


def test_decoder_is_causal() -> None:
    assert_decoder_causal(small("unet"), random_generate_batch(3, VOCAB, max_target=8))


def test_empty_history_row_gives_no_nan() -> None:
    batch = random_generate_batch(2, VOCAB)
    history = batch.history
    for field in ("input_ids", "input_mask", "utt_index", "utt_pos", "speaker"):
        getattr(history, field)[1] = 0
    model = small("unet").eval()
    out = model.loss(batch)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_every_parameter(name: str) -> None:
    model = small(name)
    model.loss(random_generate_batch(3, VOCAB)).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_invalid_configs_name_the_field() -> None:
    cases = [
        ("unet", {"n_layers": 5}, r"unet\.n_layers"),
        ("unet", {"width_growth": 0.5}, r"unet\.width_growth"),
        ("unet", {"skip": False}, r"unet\.skip.*fixed"),
        ("transformer_skip", {"conv": True}, r"transformer_skip\.conv.*fixed"),
        ("unet_per_layer_att", {"n_decoder_layers": 2}, r"per_layer_attention"),
        ("unet", {"d_model": 30, "n_heads": 8, "d_head": None}, r"unet\.n_heads: 8 heads do not"),
    ]
    for name, overrides, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            registry.build(name, VOCAB, **overrides)
    for switches, field in [
        ({"conv": False}, "conv"),  # widening (default sqrt 2) needs the conv module
        ({"conv": False, "width_growth": 1.0}, "down_up"),
        ({"skip": False, "linear_skip": True}, "linear_skip"),
    ]:
        with pytest.raises(ValidationError) as err:
            UNetConfig(vocab_size=VOCAB, **switches)
        assert err.value.errors()[0]["loc"] == (field,)


def unet_parameters(c: UNetConfig) -> int:
    """Hand count of the U-Net Transformer (decoder and embeddings as the Transformer's)."""
    d_ins = [c.d_model, *c.widths[:-1]]
    encoder = 0
    for d_in, d_out, d_head, d_ff in zip(d_ins, c.widths, c.head_sizes, c.ffn_sizes, strict=True):
        inner = c.n_heads * d_head
        conv = 3 * d_in + d_in + d_in * d_out + d_out + 2 * d_out
        attention = d_out * inner + inner + 2 * (d_in * inner + inner) + inner * d_out + d_out
        ffn = 2 * d_out * d_ff + d_ff + d_out
        encoder += conv + attention + ffn + 4 * d_out
    transformer = transformer_parameters(c.vocab_size, c.d_model, c.n_heads, c.d_head, c.d_ff)
    transformer_encoder_layer = (
        (4 * c.d_model * c.n_heads * c.d_head + 3 * c.n_heads * c.d_head + c.d_model)
        + (2 * c.d_model * c.d_ff + c.d_ff + c.d_model)
        + 4 * c.d_model
    )
    return transformer - 6 * transformer_encoder_layer + encoder


def test_registered_names() -> None:
    generate = set(registry.names("generate"))
    assert {*NAMES, "transformer", "adj_transformer"} <= generate
    assert registry.make_config("transformer_skip", VOCAB).widths == [256] * 6


def test_paper_parameter_counts() -> None:
    model = registry.build("unet", 20_000)
    assert count_parameters(model) == unet_parameters(model.config)
    # The paper: 25M for the U-Net (and for ADJ-Transformer, its parameter-matched baseline).
    assert abs(count_parameters(model) - 25e6) / 25e6 < 0.10
    adj = count_parameters(registry.build("adj_transformer", 20_000))
    assert abs(count_parameters(model) - adj) / adj < 0.05
    linear = count_parameters(registry.build("unet_linear", 20_000))
    assert linear - count_parameters(model) == 256 * 256 + 256 + 362 * 362 + 362


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_overfits_a_real_chitchat_batch(name: str) -> None:
    batch, vocab = chitchat_generate_batch(8, 400)
    layers = {"n_layers": 4, "n_decoder_layers": 4} if name == "unet_per_layer_att" else {}
    model = small(name, len(vocab), d_model=32, n_heads=4, d_ff=64, dropout=0.0, **layers)
    first, last = overfit(model, batch)
    assert last < first / 2, (first, last)
