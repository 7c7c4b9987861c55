"""Packed utterance layers compute exactly what the dense UT-mask computes."""

from __future__ import annotations

import pytest
import torch

from bench.bench_hier_attention import STACKS, PackedHier, dense_utterance_stack, pack_utterances
from bench.common import synthetic_batch
from pipeline.models import registry
from pipeline.models.hier import HierTransformer
from tests.batches import random_generate_batch

VOCAB = 50
BATCHES = {
    "whole utterances": random_generate_batch(5, VOCAB, max_utterances=5, max_utt_len=8, seed=4),
    "truncated first utterance": synthetic_batch(4, 37, 9, VOCAB, utterance=(3, 11), seed=2),
}


def tiny_hier() -> HierTransformer:
    torch.manual_seed(0)
    model = registry.build(
        "hier",
        VOCAB,
        d_model=16,
        d_ff=24,
        n_heads=2,
        n_utterance_layers=2,
        n_context_layers=1,
        n_decoder_layers=1,
        dropout=0.0,
    )
    assert isinstance(model, HierTransformer)
    return model


@pytest.mark.parametrize("name", BATCHES)
def test_pack_places_every_real_token_once(name: str) -> None:
    h = BATCHES[name].history
    packing = pack_utterances(h)
    n_utterances = int(((h.utt_index * h.input_mask).amax(1) + 1).sum())
    assert packing.mask.shape[0] == n_utterances
    assert int(packing.mask.sum()) == int(h.input_mask.sum())
    x = torch.randn(*h.input_ids.shape, 3)
    packed = packing.pack(x)
    # Row n holds one utterance's tokens in order: same utt_index, utt_pos 0, 1, ...
    utt = packing.pack(h.utt_index[..., None].float())[..., 0]
    pos = packing.pack(h.utt_pos[..., None].float())[..., 0]
    for n in range(n_utterances):
        real = packing.mask[n]
        assert torch.equal(pos[n][real], torch.arange(int(real.sum())).float())
        assert len(set(utt[n][real].tolist())) == 1
    assert torch.equal(packing.unpack(packed), x * h.input_mask[..., None])
    # slots: where each real token (in x[mask] order) sits in the flattened grid
    grid = torch.zeros(packing.mask.numel(), 3).index_copy(0, packing.slots, x[h.input_mask])
    assert torch.equal(grid.view(*packing.mask.shape, 3)[packing.mask], packed[packing.mask])


@pytest.mark.parametrize("variant", ["packed", "varlen"])
@pytest.mark.parametrize("name", BATCHES)
def test_packed_utterance_layers_equal_the_dense_mask(name: str, variant: str) -> None:
    batch, model = BATCHES[name], tiny_hier().eval()
    h = batch.history
    with torch.no_grad():
        dense = dense_utterance_stack(model.encoder, h)
        packed = STACKS[variant](model.encoder, h)
    real = h.input_mask
    torch.testing.assert_close(packed[real], dense[real], atol=1e-5, rtol=1e-5)
    assert bool((packed[~real] == 0).all())


@pytest.mark.parametrize("variant", ["packed", "varlen"])
@pytest.mark.parametrize("name", BATCHES)
def test_packed_model_has_the_same_loss_and_gradients(name: str, variant: str) -> None:
    batch, model = BATCHES[name], tiny_hier()
    dense_loss = model.loss(batch).loss
    dense_loss.backward()
    dense_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    packed_loss = PackedHier(model, variant).loss(batch)
    packed_loss.backward()
    torch.testing.assert_close(packed_loss, dense_loss, atol=1e-5, rtol=1e-5)
    for k, grad in dense_grads.items():
        torch.testing.assert_close(model.get_parameter(k).grad, grad, atol=1e-5, rtol=1e-4)
