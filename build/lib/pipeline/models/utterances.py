"""Flat histories -> utterance grids, for models that encode utterance by utterance
(HRED family, Highway Recurrent Transformer, hierarchical LSTM rankers), and the
utterances as attention groups of the real tokens (the HT-Encoder's utterance layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.data.batch import History
from pipeline.models import masks
from pipeline.models.layers import TokenGrid, TokenGroups


@dataclass(frozen=True)
class Utterances:
    """A history split into utterances: ``ids``/``mask``/``speaker`` ``[B, U, Lu]``
    (utterance i of example b in slot ``[b, i]``, its tokens left-aligned),
    ``knowledge`` ``[B, U, Lu, K]`` or None, ``count`` ``[B]`` utterances per example."""

    ids: Tensor
    mask: Tensor
    speaker: Tensor
    knowledge: Tensor | None
    count: Tensor

    @property
    def utt_mask(self) -> Tensor:
        """``[B, U]``: True for real utterances."""
        return self.mask.any(-1)


def split_utterances(history: History, knowledge: Tensor | None = None) -> Utterances:
    """Scatter the flat history into ``[B, U, Lu]`` using ``utt_index``/``utt_pos``.

    One scatter per batch; U and Lu are the batch maxima; a row without real tokens gets no
    utterance. Raises ``ValueError`` if two real tokens claim the same (utterance, position)
    slot or a row's utterance numbers skip a value (the batch contract numbers them 0, 1, ...).
    """
    real = history.input_mask
    b, length = real.shape
    n_real = int(real.sum())
    n_utt = int(history.utt_index[real].max()) + 1 if n_real else 1
    utt_len = int(history.utt_pos[real].max()) + 1 if n_real else 1
    rows = torch.arange(b, device=real.device)[:, None].expand(b, length)[real]
    slot = (rows * n_utt + history.utt_index[real]) * utt_len + history.utt_pos[real]

    def scatter(values: Tensor) -> Tensor:
        out = values.new_zeros((b * n_utt * utt_len, *values.shape[2:]))
        out[slot] = values[real]
        return out.view(b, n_utt, utt_len, *values.shape[2:])

    mask = scatter(real)
    if int(mask.sum()) != n_real:
        raise ValueError(
            "history: utt_index/utt_pos place two real tokens in the same slot; "
            "they must number utterances and positions within them uniquely"
        )
    count = torch.where(real, history.utt_index + 1, 0).amax(-1) if length else real.new_zeros(b)
    if not torch.equal(mask.any(-1).sum(1), count.to(torch.long)):
        raise ValueError("history.utt_index: utterances must be numbered 0, 1, ... without gaps")
    return Utterances(
        ids=scatter(history.input_ids),
        mask=mask,
        speaker=scatter(history.speaker),
        knowledge=None if knowledge is None else scatter(knowledge),
        count=count,
    )


def utterance_groups(history: History) -> TokenGroups:
    """Each utterance of ``history`` as one attention group of its real tokens.

    Tokens are taken in the order of ``x[history.input_mask]`` (row-major); utterance
    ``(b, utt_index)`` is group ``sum(n_utterances[:b]) + utt_index``, its tokens placed by
    ``utt_pos`` (which the batch contract makes unique within an utterance). Attention
    within these groups is exactly the UT-mask's (``masks.utterance_mask``) on the real
    tokens. One host read per batch (the grid size).
    """
    return TokenGroups.within(_utterance_grid(history)[0])


def context_groups(history: History) -> tuple[TokenGroups, TokenGroups]:
    """The HIER CT-mask (``masks.ContextMask.HIER``) as attention groups of the real tokens.

    A token of an earlier utterance sees its own utterance (the utterance groups, the final
    utterances' emptied); a token of a row's final utterance sees every real token of its
    row (one group per row: ``[B, final length]`` queries over ``[B, L]`` keys). Together
    ``sum(earlier lengths**2) + sum(final length * row length)`` pairs instead of ``B *
    L**2``. One host read per batch (the grid sizes) besides the boolean indexing.
    """
    real = history.input_mask
    b, length = real.shape
    final_tokens = masks.final_utterance(history)
    grid, final_width = _utterance_grid(history, final_tokens)
    final = final_tokens[real]
    earlier = (~final).nonzero().squeeze(-1)
    last = final.nonzero().squeeze(-1)
    # Earlier utterances: the utterance grid without the final utterances' tokens.
    key_mask = grid.mask.flatten().index_fill(0, grid.slots[last], False).view_as(grid.mask)
    within = TokenGrid(grid.slots[earlier], key_mask)
    earlier_groups = TokenGroups(within, within, queries=earlier, keys=earlier)
    # Final utterances: one group per row; queries by utt_pos, keys by position in the row.
    key_slots = real.flatten().nonzero().squeeze(-1)  # b * L + position, in token order
    final_rows, final_pos = key_slots[last] // length, history.utt_pos[real][last]
    query_mask = torch.zeros(b * final_width, dtype=torch.bool, device=real.device)
    query_slots = final_rows * final_width + final_pos
    query_mask[query_slots] = True
    final_groups = TokenGroups(
        TokenGrid(query_slots, query_mask.view(b, final_width)),
        TokenGrid(key_slots, real),
        queries=last,
    )
    return earlier_groups, final_groups


def _utterance_grid(history: History, final: Tensor | None = None) -> tuple[TokenGrid, int]:
    """The utterance grid of ``history``'s real tokens and, given the final utterances'
    tokens ``final`` ``[B, L]``, the width a grid of them needs (else 1); the sizes come
    back in one host read."""
    real = history.input_mask
    utt_index = history.utt_index.masked_fill(~real, -1)
    n_utt = utt_index.amax(dim=1) + 1 if real.shape[1] else real.new_zeros(real.shape[0])
    first = n_utt.cumsum(0) - n_utt
    groups = (first[:, None] + utt_index)[real]
    positions = history.utt_pos[real]
    one = positions.new_tensor(1)
    final_pos = None if final is None else history.utt_pos.masked_fill(~final, 0)
    sizes = torch.stack(
        [
            n_utt.sum(),
            positions.max() + 1 if positions.numel() else one,
            final_pos.max() + 1 if final_pos is not None and final_pos.numel() else one,
        ]
    )
    n_groups, width, final_width = (int(v) for v in sizes.tolist())
    mask = torch.zeros(n_groups * width, dtype=torch.bool, device=real.device)
    slots = groups * width + positions
    mask[slots] = True
    return TokenGrid(slots, mask.view(n_groups, width)), final_width
