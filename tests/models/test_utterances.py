"""split_utterances: flat history -> [B, U, Lu] grid, exactly and with clear errors;
utterance_groups/context_groups: the UT/CT-masks as attention groups of the real tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.data.special import BOS_ID, EOS_ID, PAD_ID, SPEAKER_OTHER
from pipeline.models import masks
from pipeline.models.layers import TokenGroups
from pipeline.models.utterances import context_groups, split_utterances, utterance_groups
from tests.batches import make_history, random_generate_batch


def test_by_hand() -> None:
    history = make_history(
        [[[BOS_ID, 7, EOS_ID], [BOS_ID, 8, 9, EOS_ID]], [[BOS_ID, 5, EOS_ID]]],
        [[2, 1], [2]],
    )
    utt = split_utterances(history)
    assert utt.ids.tolist() == [
        [[BOS_ID, 7, EOS_ID, PAD_ID], [BOS_ID, 8, 9, EOS_ID]],
        [[BOS_ID, 5, EOS_ID, PAD_ID], [PAD_ID] * 4],
    ]
    assert torch.equal(utt.mask, utt.ids != PAD_ID)
    assert utt.utt_mask.tolist() == [[True, True], [True, False]]
    assert utt.count.tolist() == [2, 1]
    assert utt.speaker[0, :, 0].tolist() == [2, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip(seed: int) -> None:
    h = random_generate_batch(5, 40, max_utterances=5, seed=seed).history
    utt = split_utterances(h)
    real = h.input_mask
    rows = torch.arange(5)[:, None].expand_as(real)
    back = utt.ids[rows[real], h.utt_index[real], h.utt_pos[real]]
    assert torch.equal(back, h.input_ids[real])
    assert int(utt.mask.sum()) == int(real.sum())
    for b in range(5):
        for i in range(int(utt.count[b])):
            tokens = h.input_ids[b][real[b] & (h.utt_index[b] == i)]
            assert utt.ids[b, i][utt.mask[b, i]].tolist() == tokens.tolist()
        assert not utt.mask[b, int(utt.count[b]) :].any()


def test_knowledge_features_follow_their_tokens() -> None:
    h = random_generate_batch(3, 40, seed=4).history
    knowledge = torch.stack([h.input_ids.float(), -h.input_ids.float()], dim=-1)
    utt = split_utterances(h, knowledge)
    assert torch.equal(utt.knowledge[..., 0], utt.ids.float())


def test_rejects_gaps_and_clashes_and_allows_empty_rows() -> None:
    h = make_history([[[BOS_ID, 7, EOS_ID], [BOS_ID, 8, EOS_ID]]], [[2, 1]])
    gap = dataclasses.replace(h, utt_index=torch.where(h.utt_index == 1, 2, h.utt_index))
    with pytest.raises(ValueError, match="utt_index"):
        split_utterances(gap)
    one = make_history([[[BOS_ID, 7, EOS_ID]]], [[SPEAKER_OTHER]])
    with pytest.raises(ValueError, match="same slot"):
        split_utterances(dataclasses.replace(one, utt_pos=torch.zeros_like(one.utt_pos)))
    empty = dataclasses.replace(h, input_ids=h.input_ids * 0, input_mask=h.input_mask & False)
    assert not split_utterances(empty).utt_mask.any()


def allowed_pairs(blocks: tuple[TokenGroups, ...], n: int) -> torch.Tensor:
    """``[n, n]``: which (query, key) token pairs the groups let attend."""
    allowed = torch.zeros(n, n, dtype=torch.bool)
    everyone = torch.arange(n)
    for block in blocks:
        queries = everyone if block.queries is None else block.queries
        keys = everyone if block.keys is None else block.keys
        q_group = block.query_grid.slots // block.query_grid.mask.shape[1]
        k_group = block.key_grid.slots // block.key_grid.mask.shape[1]
        allowed[queries[:, None], keys[None, :]] = q_group[:, None] == k_group[None, :]
    return allowed


def real_pairs(mask: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """A ``[B, L, L]`` mask restricted to real tokens, as one ``[n, n]`` block diagonal."""
    blocks = [mask[b][real[b]][:, real[b]].float() for b in range(real.shape[0])]
    return torch.block_diag(*blocks).bool()


def test_groups_by_hand() -> None:
    history = make_history(
        [[[BOS_ID, 7, EOS_ID], [BOS_ID, 8, 9, EOS_ID]], [[BOS_ID, 5, EOS_ID]]],
        [[2, 1], [2]],
    )
    groups = utterance_groups(history)
    grid = groups.query_grid
    assert groups.key_grid is grid and groups.queries is None and groups.keys is None
    # Three utterances, the longest 4 tokens: a 3 x 4 grid, filled in token order.
    assert grid.mask.tolist() == [
        [True, True, True, False],
        [True, True, True, True],
        [True, True, True, False],
    ]
    assert grid.slots.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    tokens = history.input_ids[history.input_mask].unsqueeze(-1)
    assert grid.scatter(tokens).squeeze(-1).tolist() == [
        [BOS_ID, 7, EOS_ID, 0],
        [BOS_ID, 8, 9, EOS_ID],
        [BOS_ID, 5, EOS_ID, 0],
    ]
    assert torch.equal(grid.gather(grid.scatter(tokens)), tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_groups_are_the_masks_on_real_tokens(seed: int) -> None:
    h = random_generate_batch(5, 40, max_utterances=5, seed=seed).history
    n = int(h.input_mask.sum())
    ut = allowed_pairs((utterance_groups(h),), n)
    assert torch.equal(ut, real_pairs(masks.utterance_mask(h), h.input_mask))
    ct = allowed_pairs(context_groups(h), n)
    assert torch.equal(ct, real_pairs(masks.context_mask(h, "hier"), h.input_mask))
    # The two blocks of the CT groups split the tokens: every token is a query once.
    earlier, final = context_groups(h)
    queries = torch.cat([earlier.queries, final.queries]).sort().values
    assert torch.equal(queries, torch.arange(n))


def test_groups_of_empty_rows_and_numbering_gaps() -> None:
    h = make_history([[[BOS_ID, 7, EOS_ID], [BOS_ID, 8, EOS_ID]]], [[2, 1]])
    gap = dataclasses.replace(h, utt_index=torch.where(h.utt_index == 1, 2, h.utt_index))
    grid = utterance_groups(gap).query_grid
    # Utterance 1 is missing: its group stays empty, the others keep their tokens apart.
    assert grid.mask.sum(1).tolist() == [3, 0, 3]
    assert torch.equal(
        allowed_pairs(context_groups(gap), 6), real_pairs(masks.context_mask(gap), gap.input_mask)
    )
    empty = dataclasses.replace(h, input_ids=h.input_ids * 0, input_mask=h.input_mask & False)
    assert utterance_groups(empty).query_grid.slots.numel() == 0
    earlier, final = context_groups(empty)
    assert earlier.queries.numel() == final.queries.numel() == 0
