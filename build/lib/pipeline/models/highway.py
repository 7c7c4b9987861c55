"""The Highway Recurrent Transformer (Chiang et al., DSTC7 track 1).

Every utterance and every candidate is embedded (+ optional knowledge features, +
speaker embedding, + within-sequence sinusoidal PE) and encoded by the same Transformer
blocks; the recurrence ``a_1 = v_1, a_i = HighwayAttn(v_i, a_{i-1})`` runs over the
context's utterances (highway attention: ``selection.HighwayAttention``); bi-directional
highway attention between the context (last state, ``hrt_last``; all states,
``hrt_all``) and each candidate, masked max-pool over positions, and the dot product of
the two vectors is the logit.

Unlike the MiuLab recurrence (which keeps the last 50 positions of right-padded tensors
and so drops real tokens of short utterances, and truncates utterances to 100/150
tokens) every real token is kept and padding never changes a score.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from pipeline.data.batch import History, SelectBatch
from pipeline.models.registry import register
from pipeline.models.selection import (
    HighwayAttention,
    RankingModel,
    SequenceEncoder,
    TransformerSelectConfig,
    bidirectional_score,
    check_knowledge,
    encode_candidates,
)
from pipeline.models.utterances import split_utterances
from pipeline.names import Task


class HRTConfig(TransformerSelectConfig):
    """``all_states``: attend candidates to every recurrent state (HRT-All) instead of the
    last one (HRT-Last). The recurrence has its own highway module and the
    context<->candidate matching another (used in both directions), as the authors' code
    (MiuLab, DSTC7 track 1) builds them; ``shared_highway: True`` ties the two into one."""

    all_states: bool = False
    shared_highway: bool = False


@register("hrt_last", Task.SELECT, HRTConfig, all_states=False)
@register("hrt_all", Task.SELECT, HRTConfig, all_states=True)
class HighwayRecurrentTransformer(RankingModel):
    """Highway Recurrent Transformer (HRT-Last / HRT-All).

    ``supports_compile = False``: the recurrence runs once per utterance of the batch's
    longest context, on utterances padded to the longest one; both counts are read from the
    batch's values (``split_utterances``, a host read), and without them as shapes of the
    batch a compiled step would break its graph there.
    """

    config: HRTConfig
    supports_compile: ClassVar[bool] = False
    eager_reason: ClassVar[str] = (
        "its recurrence runs once per utterance of the batch's longest context, a count read "
        "from the batch's values: a graph break, and a recompile, at every step"
    )

    def __init__(self, config: HRTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.encoder = SequenceEncoder.from_config(c)
        self.highway = HighwayAttention.from_config(c)
        self.recurrence = self.highway if c.shared_highway else HighwayAttention.from_config(c)

    def encode_context(
        self, history: History, knowledge: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Run the recurrence. Returns the last state ``[B, Lu, d]`` and its mask, and all
        states' real positions ``[B, L, d]`` (L: the flat history's length) with their
        mask (padding positions masked)."""
        utt = split_utterances(history, knowledge)
        b, n_utt, utt_len = utt.ids.shape
        positions = torch.arange(utt_len, device=utt.ids.device).expand(b * n_utt, utt_len)
        v = self.encoder(
            utt.ids.view(b * n_utt, utt_len),
            utt.mask.view(b * n_utt, utt_len),
            positions,
            utt.speaker.view(b * n_utt, utt_len),
            None if utt.knowledge is None else utt.knowledge.flatten(0, 1),
        ).view(b, n_utt, utt_len, -1)
        state, state_mask = v[:, 0], utt.mask[:, 0]
        states = [state]
        for i in range(1, n_utt):
            current, current_mask = v[:, i], utt.mask[:, i]
            attended = self.recurrence(current, state, state_mask)
            has_state = state_mask.any(-1)[:, None, None]
            has_current = current_mask.any(-1)[:, None, None]
            # a_i = HighwayAttn(v_i, a_{i-1}); the first real utterance starts the state
            # as is (a_1 = v_1); an example whose utterances ran out keeps its state.
            new_state = torch.where(has_state, attended, current)
            state = torch.where(has_current, new_state, state)
            state_mask = torch.where(has_current[..., 0], current_mask, state_mask)
            states.append(state)
        every, every_mask = torch.stack(states, 1).flatten(1, 2), utt.mask.flatten(1, 2)
        # Most of the U x Lu grid is padding (utterances padded to the longest). Every real
        # position is a token of the flat history, whose length bounds their count: keep
        # the real positions first, in order, and cut there. Exact (the matching attends
        # over them and max-pools them, order-free) and ~3x cheaper on HRT-All's matching.
        keep = min(history.input_ids.shape[1], every_mask.shape[1])
        order = torch.argsort((~every_mask).to(torch.int8), dim=1, stable=True)[:, :keep]
        every = every.gather(1, order[..., None].expand(-1, -1, every.shape[-1]))
        return state, state_mask, every, every_mask.gather(1, order)

    def score(self, batch: SelectBatch) -> Tensor:
        config = self.config
        context_knowledge = check_knowledge(config, batch.context_knowledge, "context_knowledge")
        candidate_knowledge = check_knowledge(
            config, batch.candidate_knowledge, "candidate_knowledge"
        )
        last, last_mask, every, every_mask = self.encode_context(batch.history, context_knowledge)
        context, context_mask = (every, every_mask) if self.config.all_states else (last, last_mask)
        candidates, candidate_mask = encode_candidates(self.encoder, batch, candidate_knowledge)
        return bidirectional_score(self.highway, context, context_mask, candidates, candidate_mask)
