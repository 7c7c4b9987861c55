"""Masks as predicates (``models/flex.py``): the dense evaluation is FlexAttention's own,
and ``layers.attend`` runs a ``FlexMask`` through the kernel or the dense mask with the
same results (zero rows included), falling back to the dense mask for dropout."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from pipeline.models import masks
from pipeline.models.flex import evaluate, flex_mask
from pipeline.models.layers import attend
from tests.batches import random_generate_batch

HISTORY = random_generate_batch(5, 40, max_utterances=4, max_utt_len=6, seed=7).history
MODS = {"ut": masks.utterance_mod(HISTORY)} | {
    f"ct-{kind}": masks.context_mod(HISTORY, kind) for kind in masks.ContextMask
}


@pytest.mark.parametrize("kind", sorted(MODS))
def test_dense_evaluation_is_flex_attentions_own(kind: str):
    """``evaluate`` (broadcast indices) gives what ``create_mask`` (vmapped over scalar
    indices, as the kernel calls a mask mod) gives, for every HT-Encoder mask."""
    b, length = HISTORY.input_mask.shape
    reference = create_mask(MODS[kind], b, 1, length, length, device="cpu")
    assert torch.equal(
        evaluate(MODS[kind], b, length, length, torch.device("cpu")), reference[:, 0]
    )


def qkv(b: int, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, 2, length, 8, generator=g) for _ in range(3))


def test_the_kernel_and_the_dense_mask_agree_and_padding_rows_are_zero():
    b, length = HISTORY.input_mask.shape
    q, k, v = qkv(b, length)
    with torch.no_grad():  # on a CPU FlexAttention runs only without gradients
        mask = masks.history_flex_mask(HISTORY, MODS["ut"])
        assert mask.block is not None
        out = attend(q, k, v, mask, causal=False, dropout=0.0)
    dense = attend(q, k, v, mask.dense(), causal=False, dropout=0.0)
    torch.testing.assert_close(out, dense)
    pad = ~HISTORY.input_mask
    assert pad.any() and torch.equal(
        out.transpose(1, 2)[pad], torch.zeros_like(out.transpose(1, 2)[pad])
    )


def test_gradients_on_a_cpu_take_the_dense_mask():
    b, length = HISTORY.input_mask.shape
    mask = masks.history_flex_mask(HISTORY, MODS["ct-hier"])
    assert mask.block is None  # grad mode on a CPU: no block mask is built
    assert torch.equal(mask.dense(), masks.context_mask(HISTORY, "hier").unsqueeze(1))
    with pytest.raises(ValueError, match="no block mask"):
        mask.attend(*qkv(b, length))


def test_dropout_runs_on_the_dense_mask_and_causality_must_be_in_the_mod():
    b, length = HISTORY.input_mask.shape
    q, k, v = qkv(b, length)
    with torch.no_grad():
        mask = flex_mask(MODS["ut"], b, length, length, torch.device("cpu"))
        torch.manual_seed(3)
        dropped = attend(q, k, v, mask, causal=False, dropout=0.5)
        torch.manual_seed(3)
        expected = attend(q, k, v, mask.dense(), causal=False, dropout=0.5)
        assert torch.equal(dropped, expected)
        assert not torch.equal(dropped, attend(q, k, v, mask, causal=False, dropout=0.0))
        with pytest.raises(ValueError, match="causality"):
            attend(q, k, v, mask, causal=True, dropout=0.0)
