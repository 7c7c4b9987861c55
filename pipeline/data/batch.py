"""Padded tensor batches: the contract between the data layer and every model.

Conventions shared by all batches:
- token id 0 is padding (``special.PAD_ID``); every ``*_mask`` is bool, True = real token;
- a history is the flat concatenation of its most recent utterances, each encoded as
  ``<bos> w1 .. wn <eos>``; ``utt_index`` numbers utterances from 0 (oldest kept),
  ``utt_pos`` is the position inside the utterance (0 = its first kept token), and both
  are 0 at padding; ``speaker`` follows ``special.SPEAKER_*``;
- responses and candidates are ``<bos> w1 .. wn <eos>``; LM sentences are ``w1 .. wn <eos>``
  (models prepend ``<bos>`` themselves, so flat and hierarchical LMs score the same tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Self

import torch
from torch import Tensor

from pipeline.data.special import BOS_ID, EOS_ID, SPEAKER_OTHER


class _TensorBatch:
    """Maps or pads every tensor of a dataclass batch, nested batches included, in one
    call. ``TOKEN_AXES``: the axis of each field that runs over tokens (what
    :meth:`padded` pads)."""

    TOKEN_AXES: ClassVar[dict[str, int]] = {}

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> Self:
        """The batch with ``fn`` of each of its tensors (moving and pinning them is the
        execution policy's: ``pipeline.execution.transfer``)."""
        mapped = {
            f.name: (v.map_tensors(fn) if isinstance(v, _TensorBatch) else fn(v))
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            for v in [getattr(self, f.name)]
            if isinstance(v, Tensor | _TensorBatch)
        }
        return dataclasses.replace(self, **mapped)  # type: ignore[type-var]

    def cpu(self) -> Self:
        """The batch in host memory, where its values are read (as ``Tensor.cpu``)."""
        return self.map_tensors(Tensor.cpu)

    def padded(self, width: Callable[[int], int]) -> Self:
        """Every token axis padded at its end to ``width(its length)`` with the padding
        convention's zeros (token 0, False, no knowledge bits), nested batches included: a
        batch collated from the same examples with longer lengths. The batch size and the
        counts of sentences and candidates stay."""
        changes: dict[str, object] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, _TensorBatch):
                changes[f.name] = value.padded(width)
            elif isinstance(value, Tensor) and f.name in self.TOKEN_AXES:
                axis = self.TOKEN_AXES[f.name]
                extra = width(value.shape[axis]) - value.shape[axis]
                if extra > 0:
                    shape = (*value.shape[:axis], extra, *value.shape[axis + 1 :])
                    changes[f.name] = torch.cat([value, value.new_zeros(shape)], dim=axis)
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @property
    def batch_size(self) -> int:
        """Examples in the batch: the first dimension of its first field (a nested batch's
        size where that is one: a generate or select batch's history)."""
        first = getattr(self, dataclasses.fields(self)[0].name)  # type: ignore[arg-type]
        return first.batch_size if isinstance(first, _TensorBatch) else int(first.shape[0])


@dataclass(frozen=True)
class History(_TensorBatch):
    """A batch of flattened dialogue histories, all ``[B, L]``."""

    TOKEN_AXES: ClassVar[dict[str, int]] = dict.fromkeys(
        ("input_ids", "input_mask", "utt_index", "utt_pos", "speaker"), 1
    )
    input_ids: Tensor
    input_mask: Tensor
    utt_index: Tensor
    utt_pos: Tensor
    speaker: Tensor

    @classmethod
    def empty_turn(cls, rows: int, device: torch.device | str) -> History:
        """``rows`` histories of one empty utterance (``<bos> <eos>``, said by the other
        speaker): a context that tells a model nothing, what an anti-LM decoding
        (``pipeline.decode``) scores a response's unconditional likelihood with."""
        ids = torch.tensor([[BOS_ID, EOS_ID]], device=device).expand(rows, -1)
        return cls(
            input_ids=ids.clone(),
            input_mask=torch.ones_like(ids, dtype=torch.bool),
            utt_index=torch.zeros_like(ids),
            utt_pos=torch.tensor([[0, 1]], device=device).expand(rows, -1).clone(),
            speaker=torch.full_like(ids, SPEAKER_OTHER),
        )


@dataclass(frozen=True)
class GenerateBatch(_TensorBatch):
    """History -> response examples.

    ``target_ids``/``target_mask`` are ``[B, T]``. MultiWOZ adds ``acts`` (``[B, A]``
    multi-hot dialogue acts of the response), ``belief_ids``/``act_ids`` (``[B, Tb]``,
    ``[B, Ta]``: the belief state and the acts serialised as ``<bos> .. <eos>`` token
    sequences, for HIER-Joint); other corpora leave them ``None``.
    """

    TOKEN_AXES: ClassVar[dict[str, int]] = dict.fromkeys(
        ("target_ids", "target_mask", "belief_ids", "act_ids"), 1
    )

    history: History
    target_ids: Tensor
    target_mask: Tensor
    turn: Tensor
    dialogue_id: tuple[str, ...]
    acts: Tensor | None = None
    belief_ids: Tensor | None = None
    act_ids: Tensor | None = None


@dataclass(frozen=True)
class SelectBatch(_TensorBatch):
    """Context + candidates -> scores.

    ``candidate_ids``/``candidate_mask`` are ``[B, N, Lc]``; ``labels`` ``[B, N]`` float,
    1.0 for every correct candidate (DSTC7 subtask 3 has several, subtask 4 may have none).
    ``context_knowledge`` ``[B, L, K]`` and ``candidate_knowledge`` ``[B, N, Lc, K]`` are
    optional per-token features (DSTC7 Advising: token is a prior / suggested course).
    """

    TOKEN_AXES: ClassVar[dict[str, int]] = {
        "candidate_ids": 2,
        "candidate_mask": 2,
        "context_knowledge": 1,
        "candidate_knowledge": 2,
    }

    history: History
    candidate_ids: Tensor
    candidate_mask: Tensor
    labels: Tensor
    dialogue_id: tuple[str, ...]
    context_knowledge: Tensor | None = None
    candidate_knowledge: Tensor | None = None


@dataclass(frozen=True)
class LMBatch(_TensorBatch):
    """Documents as sentences: ``sentences``/``sentence_mask`` are ``[B, S, Ls]``.

    ``flat_ids``/``flat_mask`` ``[B, Lf]`` hold exactly the same real tokens concatenated
    in order, for flat (GPT) models. ``context_tokens`` ``[B]`` (windows of a stream,
    ``data.streams``): row b's first ``context_tokens[b]`` real tokens are context, read
    but not scored; None: every real token is scored.
    """

    TOKEN_AXES: ClassVar[dict[str, int]] = {
        "sentences": 2,
        "sentence_mask": 2,
        "flat_ids": 1,
        "flat_mask": 1,
    }

    sentences: Tensor
    sentence_mask: Tensor
    flat_ids: Tensor
    flat_mask: Tensor
    dialogue_id: tuple[str, ...]
    context_tokens: Tensor | None = None

    def scored_mask(self) -> Tensor:
        """``[B, S, Ls]``: the real tokens a model is scored on (all, or those after each
        row's context); static shapes, nothing read on the host."""
        if self.context_tokens is None:
            return self.sentence_mask
        b = self.sentence_mask.shape[0]
        seen = self.sentence_mask.reshape(b, -1).cumsum(1).view(self.sentence_mask.shape)
        return self.sentence_mask & (seen > self.context_tokens.view(b, 1, 1))

    def scored_flat_mask(self) -> Tensor:
        """``[B, Lf]``: :meth:`scored_mask` in the flat layout."""
        if self.context_tokens is None:
            return self.flat_mask
        position = torch.arange(self.flat_mask.shape[1], device=self.flat_mask.device)
        return self.flat_mask & (position[None, :] >= self.context_tokens[:, None])


Batch = GenerateBatch | SelectBatch | LMBatch
