"""Masks from a History's layout: hand examples, the paper's construction, padding."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.models import masks
from pipeline.models.masks import ContextMask, MemoryKeys
from tests.batches import make_history

T, F = True, False


def _history(lengths_per_row: list[list[int]]):
    """Histories whose token ids are 5.. (real) with the given utterance lengths."""
    utts = [[[5 + p for p in range(n)] for n in lengths] for lengths in lengths_per_row]
    speakers = [[1] * len(lengths) for lengths in lengths_per_row]
    return make_history(utts, speakers)


# Row 0: utterances of lengths 2, 3, 2 (C_I = 0 0 1 1 1 2 2, P_I = 0 1 0 1 2 0 1).
# Row 1: utterances of lengths 1, 2 and two pad columns.
EXAMPLE = _history([[2, 3, 2], [1, 2]])


def test_layout_is_what_the_hand_matrices_assume():
    assert EXAMPLE.utt_index[0].tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert EXAMPLE.utt_pos[0].tolist() == [0, 1, 0, 1, 2, 0, 1]
    assert EXAMPLE.input_mask[1].tolist() == [T, T, T, F, F, F, F]


def test_utterance_mask_hand_example():
    expected0 = torch.tensor(
        [
            [T, T, F, F, F, F, F],
            [T, T, F, F, F, F, F],
            [F, F, T, T, T, F, F],
            [F, F, T, T, T, F, F],
            [F, F, T, T, T, F, F],
            [F, F, F, F, F, T, T],
            [F, F, F, F, F, T, T],
        ]
    )
    expected1 = torch.zeros(7, 7, dtype=torch.bool)
    expected1[0, 0] = True
    expected1[1:3, 1:3] = True
    ut = masks.utterance_mask(EXAMPLE)
    assert ut.shape == (2, 7, 7)
    assert torch.equal(ut[0], expected0)
    assert torch.equal(ut[1], expected1)


def test_paper_ut_mask_literal_construction():
    # A = 1(2 C_IR == C_IR^T + C_IR) for C_I = [0, 0, 1, 1, 1, 2, 2] (the authors'
    # library example without its padding) is the block diagonal of utterances.
    c_i = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    a = masks.paper_ut_mask(c_i)
    assert torch.equal(a, masks.utterance_mask(EXAMPLE)[0])
    assert torch.equal(
        masks.paper_ut_mask(torch.tensor([0, 0, 1])),
        torch.tensor([[T, T, F], [T, T, F], [F, F, T]]),
    )


def test_hier_ct_mask_final_utterance_sees_everything():
    ct = masks.context_mask(EXAMPLE, ContextMask.HIER)[0]
    ut = masks.utterance_mask(EXAMPLE)[0]
    assert torch.equal(ct[:5], ut[:5])  # earlier utterances: own utterance only
    assert ct[5:].all()  # final utterance: every token
    row1 = masks.context_mask(EXAMPLE, ContextMask.HIER)[1]
    assert row1[1:3, :3].all() and not row1[0, 1:].any()  # utterance 0 is not final
    assert not row1[3:].any() and not row1[:, 3:].any()  # padding


def test_naacl_ct_mask_everyone_sees_final_utterance():
    ct = masks.context_mask(EXAMPLE, ContextMask.HIER_NAACL)[0]
    ut = masks.utterance_mask(EXAMPLE)[0]
    assert ct[:, 5:].all()  # every token sees the final utterance
    assert torch.equal(ct[:, :5], ut[:, :5])  # and otherwise its own utterance
    assert torch.equal(ct, masks.context_mask(EXAMPLE, ContextMask.HIER)[0].T)


def test_cls_ct_mask_sees_only_first_tokens():
    ct = masks.context_mask(EXAMPLE, ContextMask.CLS)
    first0 = torch.tensor([T, F, T, F, F, T, F])
    assert torch.equal(ct[0], first0.expand(7, 7))
    first1 = torch.tensor([T, T, F, F, F, F, F])
    assert torch.equal(ct[1][:3], first1.expand(3, 7))
    assert not ct[1][3:].any()


def test_full_mask_is_padding_only():
    full = masks.context_mask(EXAMPLE, ContextMask.FULL)
    real = EXAMPLE.input_mask
    assert torch.equal(full, real[:, :, None] & real[:, None, :])
    assert torch.equal(full, masks.full_mask(EXAMPLE))


def test_memory_keys():
    assert torch.equal(masks.memory_mask(EXAMPLE, MemoryKeys.ALL), EXAMPLE.input_mask)
    assert masks.memory_mask(EXAMPLE, MemoryKeys.FINAL_UTTERANCE).tolist() == [
        [F, F, F, F, F, T, T],
        [F, T, T, F, F, F, F],
    ]
    assert masks.memory_mask(EXAMPLE, "first_tokens").tolist() == [
        [T, F, T, F, F, T, F],
        [T, T, F, F, F, F, F],
    ]


def test_final_utterance_ignores_padding_with_index_zero():
    # Pads carry utt_index 0; a single-utterance row must still call its tokens final.
    history = _history([[3], [1, 1, 1]])
    assert masks.final_utterance(history)[0].tolist() == [T, T, T]


def test_causal_padding_mask():
    real = torch.tensor([[T, T, T], [T, T, F]])
    m = masks.causal_padding_mask(real)
    assert m[0].tolist() == [[T, F, F], [T, T, F], [T, T, T]]
    assert m[1].tolist() == [[T, F, F], [T, T, F], [F, F, F]]
    assert masks.causal_mask(2, 3).tolist() == [[T, T, F], [T, T, T]]


layouts = st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(layouts)
def test_masks_on_random_layouts(lengths_per_row):
    history = _history(lengths_per_row)
    real = history.input_mask
    ut = masks.utterance_mask(history)
    for b, lengths in enumerate(lengths_per_row):
        n = sum(lengths)
        # The vectorised UT-mask equals the paper's literal construction on real tokens.
        assert torch.equal(ut[b, :n, :n], masks.paper_ut_mask(history.utt_index[b, :n]))
    all_masks = [ut] + [masks.context_mask(history, kind) for kind in ContextMask]
    for m in all_masks:
        pairs = real[:, :, None] & real[:, None, :]
        assert not (m & ~pairs).any()  # nothing involving padding
        assert m.any(-1)[real].all()  # no real token's row is empty
    for keys in MemoryKeys:
        km = masks.memory_mask(history, keys)
        assert km.any(-1).all() and not (km & ~real).any()
    # Batched masks equal the masks of each row built alone.
    for b, lengths in enumerate(lengths_per_row):
        n = sum(lengths)
        alone = _history([lengths])
        for kind in ContextMask:
            assert torch.equal(
                masks.context_mask(history, kind)[b, :n, :n], masks.context_mask(alone, kind)[0]
            )
