"""Evaluating a language model on the test split: test loss and perplexity over the
documents' sentence tokens (``eval.perplexity``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.data.batch import LMBatch
from pipeline.data.loader import ExampleDataset
from pipeline.eval.catalogue import N_EXAMPLES
from pipeline.eval.collect import Collected, Evaluator, SeedResult, example_id, test_batches
from pipeline.eval.perplexity import example_nll
from pipeline.progress import Reporter


@dataclass(frozen=True)
class LMEvaluator(Evaluator):
    """Evaluates language models on one corpus's test split."""

    @torch.no_grad()
    def __call__(
        self, model: nn.Module, dataset: ExampleDataset, bar: Reporter | None, seed: int
    ) -> SeedResult:
        """Test loss and perplexity of one language model (``history_tokens`` = the
        document's tokens)."""
        ev, got = self.settings, Collected()
        for examples, batch in test_batches(dataset, ev.batch_size, ev.max_batches, bar):
            batch: LMBatch = batch.to(self.device)
            nll = example_nll(model, batch)
            got.ids += [example_id(e) for e in examples]
            got.nll_sum += nll.nll_sum.cpu().tolist()
            got.n_tokens += nll.n_tokens.cpu().tolist()
            got.history_tokens += batch.flat_mask.long().sum(-1).cpu().tolist()
        got.require(dataset)
        return SeedResult({N_EXAMPLES.key: float(len(got.ids)), **got.nll_metrics()}, got)
