"""Attention masks built from a ``History``'s layout (``input_mask``, ``utt_index``, ``utt_pos``).

Convention (as in ``layers``): bool, **True = may attend**; self-attention masks are
``[B, L_query, L_key]`` (``attend`` broadcasts them over heads), key masks ``[B, L]``.
Every mask is combined with padding: a real token never attends a pad, and a pad query
row may be all-False (``attend`` turns such rows into zeros instead of NaN). For a
well-formed history (every utterance has a token with ``utt_pos == 0``) no real token's
row is empty. All masks are built once per batch with broadcasting, no Python loops. The
UT- and CT-masks are each defined once, as a mask mod (``flex.MaskMod``, the predicate
``mod(b, h, q, k)``): ``utterance_mask``/``context_mask`` evaluate it at every pair, and
``history_flex_mask`` gives FlexAttention its block mask.

The HT-Encoder (Santra et al., 2021) turns an (M+N)-layer encoder into a hierarchical one
by masks alone: the UT-mask (a token sees its own utterance) in the first M layers and a
CT-mask in the last N. CT-mask variants:

- ``HIER`` (default; the authors' released library and the paper's Figure 1): a token
  sees its own utterance, and tokens of the final utterance see every utterance;
- ``HIER_NAACL`` (the authors' NAACL experiment code): the transpose, every utterance's
  tokens also see the final utterance;
- ``CLS`` (HIER-CLS, HRED/HIBERT-like): every token sees only the first token of each
  utterance (``utt_pos == 0``);
- ``FULL``: every real token sees every real token (a plain encoder).

SET (utterance encoder only) uses the UT-mask in every layer; MAT (context encoder
only) uses a CT-mask in every layer.
"""

from __future__ import annotations

import enum

from torch import Tensor

from pipeline.data.batch import History
from pipeline.models.flex import FlexMask, MaskMod, evaluate, flex_mask
from pipeline.models.layers import causal_mask

__all__ = [
    "ContextMask",
    "MemoryKeys",
    "causal_mask",
    "causal_padding_mask",
    "context_mask",
    "context_mod",
    "final_utterance",
    "first_tokens",
    "full_mask",
    "history_flex_mask",
    "memory_mask",
    "paper_ut_mask",
    "utterance_mask",
    "utterance_mod",
]


class ContextMask(enum.StrEnum):
    """Which CT-mask the context layers of an HT-Encoder use (see the module docstring)."""

    HIER = "hier"
    HIER_NAACL = "hier_naacl"
    CLS = "cls"
    FULL = "full"


class MemoryKeys(enum.StrEnum):
    """Which encoder outputs the decoder cross-attends to.

    ``ALL`` every real token (default); ``FINAL_UTTERANCE`` only the last utterance (the
    released library's HIER decoder); ``FIRST_TOKENS`` each utterance's first token
    (HIER-CLS).
    """

    ALL = "all"
    FINAL_UTTERANCE = "final_utterance"
    FIRST_TOKENS = "first_tokens"


def _pairs(query: Tensor, key: Tensor) -> Tensor:
    """``[B, L]`` query and key conditions -> ``[B, L, L]`` (both hold)."""
    return query[:, :, None] & key[:, None, :]


def full_mask(history: History) -> Tensor:
    """``[B, L, L]`` padding-only mask: every real query sees every real key."""
    real = history.input_mask
    return _pairs(real, real)


def causal_padding_mask(real: Tensor) -> Tensor:
    """``[B, L, L]`` from a ``[B, L]`` real-token mask: a real query sees the real keys at
    or before its own position."""
    length = real.shape[1]
    return _pairs(real, real) & causal_mask(length, length, real.device)


def utterance_mod(history: History) -> MaskMod:
    """The UT-mask as a mask mod (``flex``): a real token sees the real tokens of its own
    utterance."""
    real, utt = history.input_mask, history.utt_index

    def mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return real[b, q] & real[b, k] & (utt[b, q] == utt[b, k])

    return mod


def utterance_mask(history: History) -> Tensor:
    """UT-mask ``[B, L, L]``: block diagonal, a real token sees the real tokens of its own
    utterance."""
    return _dense(history, utterance_mod(history))


def final_utterance(history: History) -> Tensor:
    """``[B, L]``: real tokens of each row's last utterance (largest ``utt_index``)."""
    real = history.input_mask
    index = history.utt_index.masked_fill(~real, -1)
    return real & (index == index.max(dim=1, keepdim=True).values)


def first_tokens(history: History) -> Tensor:
    """``[B, L]``: the first (CLS/``<bos>``) token of every utterance."""
    return history.input_mask & (history.utt_pos == 0)


def context_mod(history: History, kind: ContextMask | str = ContextMask.HIER) -> MaskMod:
    """The CT-mask of the given variant as a mask mod (``flex``), combined with padding."""
    kind = ContextMask(kind)
    real, utt = history.input_mask, history.utt_index
    # Per-token conditions computed once per batch; the mod only looks them up.
    first = first_tokens(history)
    final = final_utterance(history)

    def full(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return real[b, q] & real[b, k]

    def cls(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return real[b, q] & first[b, k]

    def hier(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return real[b, q] & real[b, k] & ((utt[b, q] == utt[b, k]) | final[b, q])

    def naacl(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return real[b, q] & real[b, k] & ((utt[b, q] == utt[b, k]) | final[b, k])

    mods = {
        ContextMask.FULL: full,
        ContextMask.CLS: cls,
        ContextMask.HIER: hier,
        ContextMask.HIER_NAACL: naacl,
    }
    return mods[kind]


def context_mask(history: History, kind: ContextMask | str = ContextMask.HIER) -> Tensor:
    """CT-mask ``[B, L, L]`` of the given variant, combined with padding."""
    return _dense(history, context_mod(history, kind))


def history_flex_mask(history: History, mod: MaskMod) -> FlexMask:
    """``mod`` (:func:`utterance_mod`, :func:`context_mod`) over ``history``'s ``[B, L]``
    positions as a ``flex.FlexMask``."""
    b, length = history.input_mask.shape
    return flex_mask(mod, b, length, length, history.input_mask.device)


def _dense(history: History, mod: MaskMod) -> Tensor:
    b, length = history.input_mask.shape
    return evaluate(mod, b, length, length, history.input_mask.device)


def memory_mask(history: History, keys: MemoryKeys | str = MemoryKeys.ALL) -> Tensor:
    """``[B, L]`` key mask for the decoder's cross-attention over the encoder outputs."""
    keys = MemoryKeys(keys)
    if keys is MemoryKeys.FINAL_UTTERANCE:
        return final_utterance(history)
    if keys is MemoryKeys.FIRST_TOKENS:
        return first_tokens(history)
    return history.input_mask


def paper_ut_mask(c_i: Tensor) -> Tensor:
    """The paper's literal UT-mask for one unpadded context (Section 2.2), for testing.

    ``C_IR = repeat(C_I, len(C_I), 0)`` and ``A = 1(2 C_IR == C_IR^T + C_IR)``, with
    ``c_i`` ``[L]`` the utterance index of every token. Returns ``[L, L]`` bool.
    """
    c_ir = c_i.unsqueeze(0).repeat(c_i.shape[0], 1)
    return 2 * c_ir == c_ir.T + c_ir
