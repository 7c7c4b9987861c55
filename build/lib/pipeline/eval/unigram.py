"""The unigram baseline of a perplexity table: what a model that ignores all context scores.

A trained generation or language model that does not beat this has learnt word frequencies
at best, so the report prints it as a row of every perplexity table.

Convention: word probabilities are the training split's target-token counts with add-one
(Laplace) smoothing over the whole vocabulary, ``p(w) = (c(w) + 1) / (N + V)``. The tokens
counted and scored are exactly those the models are scored on (``scored_tokens``): a
response's tokens after ``<bos>``, ``<eos>`` included (generate); every sentence's tokens,
``<eos>`` included (lm). Perplexity is ``exp(sum NLL / sum tokens)`` over the test examples
the table's runs were evaluated on, the same definition as the models'.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.loader import load_vocab, open_split
from pipeline.data.records import Example, GenerateExample, LMExample
from pipeline.data.splits import Split
from pipeline.eval.collect import example_id
from pipeline.eval.perplexity import perplexity_of


def scored_tokens(example: Example) -> np.ndarray:
    """The target tokens a model of the example's task is scored on."""
    if isinstance(example, GenerateExample):
        return np.asarray(example.target_ids[1:])
    if isinstance(example, LMExample):
        return np.concatenate([np.asarray(s) for s in example.sentences])
    raise TypeError(f"no perplexity for {type(example).__name__} examples")


@dataclass(frozen=True)
class Unigram:
    """Add-one smoothed token log-probabilities (``log_probs[token]``, nats)."""

    log_probs: np.ndarray

    @classmethod
    def fit(cls, token_arrays: Iterable[np.ndarray], vocab_size: int) -> Unigram:
        counts = np.zeros(vocab_size, dtype=np.float64)
        for tokens in token_arrays:
            counts += np.bincount(tokens, minlength=vocab_size)[:vocab_size]
        return cls(np.log((counts + 1.0) / (counts.sum() + vocab_size)))

    def nll(self, tokens: np.ndarray) -> float:
        """Summed negative log-likelihood of ``tokens`` (nats)."""
        return float(-self.log_probs[tokens].sum())


@dataclass(frozen=True)
class UnigramScore:
    """The baseline on a set of test examples."""

    nll_sum: float
    n_tokens: int
    n_examples: int

    @property
    def loss(self) -> float:
        return self.nll_sum / self.n_tokens if self.n_tokens else math.nan

    @property
    def ppl(self) -> float:
        return perplexity_of(self.loss) if self.n_tokens else math.nan


def unigram_score(shards: str | Path, task: str, ids: Iterable[str]) -> UnigramScore:
    """Fit on the ``train`` split of ``task`` in ``shards`` and score the ``test`` examples
    whose ids are ``ids`` (all test examples if ``ids`` is empty)."""
    vocab_size = len(load_vocab(shards))
    model = Unigram.fit(
        (scored_tokens(e) for e in open_split(shards, task, Split.TRAIN)), vocab_size
    )
    wanted = set(ids)
    nll, tokens, examples = 0.0, 0, 0
    for example in open_split(shards, task, "test"):
        if wanted and example_id(example) not in wanted:
            continue
        scored = scored_tokens(example)
        nll += model.nll(scored)
        tokens += len(scored)
        examples += 1
    return UnigramScore(nll, tokens, examples)
