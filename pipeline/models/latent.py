"""Gaussian latent variables and how a latent-variable model's likelihood is evaluated.

VHRED and VHCR are trained on the ELBO, a lower bound of ``log p(y | x)``. Their reported
numbers follow the authors (Serban et al. 2017; Park et al. 2018, whose code evaluates this
way): validation (early stopping, tuning) uses the negative ELBO, reconstruction + KL at
weight 1, with one posterior sample; test NLL is importance-sampled with the posterior as
proposal,

    log p(y | x) ~= logsumexp_k [log p(y | x, z_k) + log p(z_k | x) - log q(z_k | x, y)] - log K,

``z_k ~ q``, which never exceeds the ELBO estimate from the same samples (Jensen) and
approaches the true NLL as ``K`` grows (the papers use K = 100). Every draw is seeded per
example, from the example's tokens (:class:`RowNoise`), so an evaluation repeats exactly
and an example's number does not depend on the batch it is in. Scoring ``p(y | x, z)``
with ``z`` from the posterior alone (no KL, no weights) would leak the response into its
own likelihood.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.data.batch import GenerateBatch

_LOG_2PI = math.log(2 * math.pi)


class RowNoise:
    """Standard normal noise whose row ``i`` depends only on ``seed`` and the example's
    own tokens (``keys[i]``): one generator per example, consumed in order by every draw of
    an evaluation, so an example gets the same draws alone, padded or in any batch."""

    def __init__(self, seed: int, keys: list[int]) -> None:
        self.generators = [torch.Generator().manual_seed(seed * 1_000_003 + k) for k in keys]

    @classmethod
    def for_batch(cls, seed: int, batch: GenerateBatch) -> RowNoise:
        """One generator per example of ``batch``, keyed by its history and response."""
        keys = []
        history, target = batch.history.cpu(), batch.target_ids.cpu()
        target_mask = batch.target_mask.cpu()
        for i in range(target.shape[0]):
            tokens = torch.cat(
                [history.input_ids[i][history.input_mask[i]], target[i][target_mask[i]]]
            )
            keys.append(zlib.crc32(tokens.numpy().astype(np.int64).tobytes()))
        return cls(seed, keys)

    def like(self, mean: Tensor) -> Tensor:
        """Noise of ``mean``'s shape ``[rows, d]``, dtype and device."""
        rows = [torch.randn(mean.shape[-1], generator=g) for g in self.generators]
        return torch.stack(rows).to(device=mean.device, dtype=mean.dtype)


@dataclass
class Gaussian:
    """A diagonal Gaussian by mean and log-variance."""

    mean: Tensor
    logvar: Tensor

    def sample(self, noise: RowNoise | None = None) -> Tensor:
        """A reparameterised draw; from ``noise`` when given (seeded), else unseeded."""
        eps = noise.like(self.mean) if noise is not None else torch.randn_like(self.mean)
        return self.mean + eps * (0.5 * self.logvar).exp()

    def log_prob(self, z: Tensor) -> Tensor:
        """``log N(z; mean, var)`` summed over dimensions, ``[B]``."""
        return -0.5 * (_LOG_2PI + self.logvar + (z - self.mean) ** 2 / self.logvar.exp()).sum(-1)

    def kl(self, prior: Gaussian | None = None) -> Tensor:
        """``KL(self || prior)`` summed over dimensions, ``[B]``; ``prior=None`` is N(0, I)."""
        if prior is None:
            return 0.5 * (self.logvar.exp() + self.mean**2 - 1.0 - self.logvar).sum(-1)
        var_ratio = (self.logvar - prior.logvar).exp()
        mahalanobis = (self.mean - prior.mean) ** 2 / prior.logvar.exp()
        return 0.5 * (var_ratio + mahalanobis - 1.0 - (self.logvar - prior.logvar)).sum(-1)


def standard_normal_log_prob(z: Tensor) -> Tensor:
    """``log N(z; 0, I)`` summed over dimensions, ``[B]``."""
    return -0.5 * (_LOG_2PI + z**2).sum(-1)


class GaussianNet(nn.Module):
    """Two tanh layers then linear mean and log-variance heads (VHRED's prior/posterior)."""

    def __init__(self, d_in: int, d_hidden: int, d_latent: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Linear(d_hidden, d_hidden), nn.Tanh()
        )
        self.mean = nn.Linear(d_hidden, d_latent)
        self.logvar = nn.Linear(d_hidden, d_latent)

    def forward(self, x: Tensor) -> Gaussian:
        h = self.body(x)
        return Gaussian(self.mean(h), self.logvar(h))


@dataclass(frozen=True)
class LatentNLL:
    """Per-example NLL of a response in nats, float64 ``[B]``: the importance-sampled
    estimate and the negative ELBO of the same samples (its upper bound)."""

    importance: Tensor
    elbo: Tensor


def importance_estimates(log_weights: Tensor) -> LatentNLL:
    """From ``log p(y, z_k | x) - log q(z_k | x, y)`` ``[K, B]``: the module's estimates."""
    log_weights = log_weights.double()
    k = log_weights.shape[0]
    return LatentNLL(
        importance=-(torch.logsumexp(log_weights, 0) - math.log(k)),
        elbo=-log_weights.mean(0),
    )
