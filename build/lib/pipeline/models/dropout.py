"""Dropout as the AWD-LSTM / Transformer-XL PTB recipe applies it to a language model.

Source: the Transformer-XL PTB code published with Fast-Weight-Memory (github
ischlag/Fast-Weight-Memory-public, ``language-modelling/transformer_xl_ptb/``):

- **Locked ("variational") dropout** (``locked_dropout.py`` l. 10-16): one mask per sequence,
  shared by all its positions. Their layout is time-first ``[T, B, d]`` with a ``[1, B, d]``
  mask; ours is batch-first, so the mask is ``[B, 1, d]``. :class:`SiteDropout` is one
  dropout site that is either locked or the ordinary per-position ``nn.Dropout``.
- **Word-type embedding dropout** (``embed_regularize.py`` l. 7-22, AWD-LSTM's
  ``embedded_dropout``): whole rows of the embedding matrix, i.e. every occurrence of a word
  type, dropped for one step, the kept rows scaled by ``1 / (1 - p)``
  (:func:`drop_word_types`). Their dropped rows hold ``1e-12`` instead of 0 (``EPS``): a
  difference of at most ``1e-12 * sqrt(d)`` per input, not copied.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F


class SiteDropout(nn.Module):
    """Dropout at one place of a network: ``locked=False`` is exactly ``nn.Dropout(p)`` (same
    calls, same random numbers); ``locked=True`` draws one mask per sequence, ``[B, 1, .., 1,
    d]`` for an input ``[B, L, .., d]``, scaled by ``1 / (1 - p)``. The identity in eval mode
    and at ``p = 0``."""

    def __init__(self, p: float, locked: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} is not in [0, 1)")
        self.p, self.locked = p, locked

    def extra_repr(self) -> str:
        return f"p={self.p}, locked={self.locked}"

    def forward(self, x: Tensor) -> Tensor:
        if not self.locked:
            return F.dropout(x, self.p, self.training)
        if not self.training or self.p == 0.0:
            return x
        if x.dim() < 3:
            raise ValueError(
                f"locked dropout needs [batch, positions, features] inputs, got {list(x.shape)}"
            )
        shape = (x.shape[0], *([1] * (x.dim() - 2)), x.shape[-1])
        mask = x.new_empty(shape).bernoulli_(1.0 - self.p)
        return x * (mask / (1.0 - self.p))


def drop_word_types(weight: Tensor, p: float) -> Tensor:
    """The embedding table ``weight`` ``[V, d]`` with each row (word type) zeroed with
    probability ``p``, the others scaled by ``1 / (1 - p)``: one draw per call, so a model
    draws once per training step and looks every input up in the same table."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"word-type dropout {p} is not in (0, 1)")
    keep = weight.new_empty(weight.shape[0], 1).bernoulli_(1.0 - p)
    return weight * (keep / (1.0 - p))
