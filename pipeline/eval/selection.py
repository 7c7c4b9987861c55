"""Evaluating a select model on the test split: Recall@k of the true response among the
example's candidates and MRR (``eval.ranking``: ties counted pessimistically), and per
example its ranking loss (``models.base.candidate_bce`` over the real candidates)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from pipeline.data.batch import SelectBatch
from pipeline.data.loader import ExampleDataset
from pipeline.eval import ranking
from pipeline.eval.catalogue import MRR, N_EXAMPLES, RECALL
from pipeline.eval.collect import Collected, Evaluator, SeedResult, example_id, test_batches
from pipeline.eval.perplexity import history_tokens
from pipeline.models.base import candidate_bce
from pipeline.progress import Reporter


@dataclass(frozen=True)
class SelectEvaluator(Evaluator):
    """Evaluates select models on one corpus's test split."""

    @torch.no_grad()
    def __call__(
        self, model: nn.Module, dataset: ExampleDataset, bar: Reporter | None, seed: int
    ) -> SeedResult:
        """Recall@k and MRR of one selection model; per example the BCE over its real
        candidates (``nll_sum``, ``n_tokens`` = 1) and the rank of the first correct one."""
        ev, got = self.settings, Collected()
        batches = test_batches(dataset, ev.batch_size, ev.max_batches, bar)
        for examples, moved in self.policy.evaluation_batches(batches):
            batch = cast(SelectBatch, moved)
            real = batch.candidate_mask.any(-1)
            logits = model.score(batch).float()
            per_example = candidate_bce(logits, batch.labels, real)
            scores = logits.masked_fill(~real, float("-inf"))
            got.ids += [example_id(e) for e in examples]
            got.nll_sum += per_example.double().cpu().tolist()
            got.n_tokens += [1] * len(examples)
            got.history_tokens += history_tokens(batch.history).cpu().tolist()
            got.ranks += ranking.first_correct_ranks(scores, batch.labels).cpu().tolist()
        got.require(dataset)
        ranks = torch.tensor(got.ranks)
        metrics = {N_EXAMPLES.key: float(len(got.ids))}
        for k, metric in RECALL.items():
            metrics[metric.key] = ranking.recall_from_ranks(ranks, k)
        metrics[MRR.key] = ranking.mrr_from_ranks(ranks)
        return SeedResult(metrics, got)
