"""The LM recipe's dropouts: locked (one mask per sequence) and word-type embedding dropout,
in training and in eval mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.models.dropout import SiteDropout, drop_word_types
from pipeline.models.layers import FeedForward, TokenEmbedding


def test_locked_dropout_keeps_one_mask_per_sequence_and_scales() -> None:
    p = 0.5
    drop = SiteDropout(p, locked=True).train()
    torch.manual_seed(0)
    x = torch.rand(4, 7, 16) + 0.5  # no zeros: a zero out means a dropped feature
    out = drop(x)
    ratio = out / x
    # the same mask at every position of a sequence, values 0 or 1/(1-p)
    assert torch.equal(ratio, ratio[:, :1].expand_as(ratio))
    kept = ratio[:, 0] != 0
    torch.testing.assert_close(ratio[:, 0][kept], torch.full_like(ratio[:, 0][kept], 1 / (1 - p)))
    assert 0 < kept.float().mean() < 1
    # sequences of a batch draw their own masks
    assert not torch.equal(ratio[0, 0], ratio[1, 0])
    # a plain (per-position) dropout differs along positions: the test can tell them apart
    plain = SiteDropout(p).train()(x) / x
    assert not torch.equal(plain, plain[:, :1].expand_as(plain))


def test_locked_dropout_is_the_identity_in_eval_mode_and_at_zero() -> None:
    x = torch.randn(2, 5, 8)
    assert SiteDropout(0.6, locked=True).eval()(x) is x
    assert SiteDropout(0.0, locked=True).train()(x) is x
    with pytest.raises(ValueError, match=r"\[batch, positions, features\]"):
        SiteDropout(0.5, locked=True).train()(torch.randn(5, 8))
    with pytest.raises(ValueError, match="not in"):
        SiteDropout(1.0)


def test_unlocked_site_dropout_is_nn_dropout_bit_for_bit() -> None:
    x = torch.randn(3, 5, 8)
    torch.manual_seed(1)
    ours = SiteDropout(0.3).train()(x)
    torch.manual_seed(1)
    theirs = nn.Dropout(0.3).train()(x)
    assert torch.equal(ours, theirs)


def test_locked_feed_forward_masks_its_inner_activation_per_sequence() -> None:
    torch.manual_seed(0)
    ffn = FeedForward(4, 32, dropout=0.5, locked=True).train()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    ffn.dropout.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    ffn(torch.randn(3, 6, 4))
    inner, out = seen[0]
    active = inner > 0  # ReLU zeros say nothing about the mask
    ratio = torch.where(active, out / inner.clamp(min=1e-9), torch.nan)
    lo = ratio.nan_to_num(nan=torch.inf).amin(1)
    hi = ratio.nan_to_num(nan=-torch.inf).amax(1)
    seen_twice = active.sum(1) > 1
    assert seen_twice.any()
    # each unit of a sequence is kept (x2) or dropped (0) at all of its positions
    assert torch.equal(lo[seen_twice], hi[seen_twice])
    assert set(lo[seen_twice].unique().tolist()) == {0.0, 2.0}


def test_word_type_dropout_drops_whole_rows_and_scales_the_rest() -> None:
    torch.manual_seed(0)
    weight = torch.randn(200, 6)
    dropped = drop_word_types(weight, 0.25)
    zero = (dropped == 0).all(-1)
    assert 0.1 < zero.float().mean() < 0.4
    torch.testing.assert_close(dropped[~zero], weight[~zero] / 0.75)
    assert not (dropped[~zero] == 0).any()  # a row is dropped whole or not at all


def test_token_embedding_looks_every_occurrence_up_in_one_step_table() -> None:
    torch.manual_seed(0)
    embed = TokenEmbedding(50, 8, pad_id=0, type_dropout=0.5).train()
    table = embed.step_table()
    assert table is not None
    ids = torch.arange(1, 50).repeat(2, 1)  # every type twice
    out = embed(ids, table)
    assert torch.equal(out[0], out[1])  # the same type, the same (dropped or kept) vector
    dropped = (out[0] == 0).all(-1)
    assert dropped.any() and not dropped.all()
    torch.testing.assert_close(out[0][~dropped], embed(ids[0])[~dropped] * 2.0)
    assert embed.eval().step_table() is None
    assert TokenEmbedding(50, 8).train().step_table() is None
