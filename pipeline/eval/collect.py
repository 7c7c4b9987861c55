"""What every evaluator shares: the test batches in file order, the per-example values of
one seed (the rows of ``per_example.jsonl``), and their aggregation over seeds. The batch
size and precision evaluation runs at are the run's execution policy's
(``pipeline.execution``), as in the training loop's validation."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from pipeline.artifacts import ExampleResult
from pipeline.config import EvaluateParams
from pipeline.data.batch import History
from pipeline.data.loader import ExampleDataset
from pipeline.data.records import Example
from pipeline.data.vocab import Vocab
from pipeline.errors import DataError
from pipeline.eval import stats
from pipeline.eval.catalogue import (
    CI_SUFFIX,
    SETTINGS,
    TEST_LOSS,
    TEST_LOSS_ELBO,
    TEST_PPL,
    TEST_PPL_ELBO,
)
from pipeline.eval.perplexity import perplexity
from pipeline.execution import ExecutionPolicy
from pipeline.progress import Reporter


@dataclass
class Collected:
    """Per-example values gathered over the test batches of one seed (the columns of
    ``per_example.jsonl``)."""

    ids: list[str] = field(default_factory=list)
    nll_sum: list[float] = field(default_factory=list)
    n_tokens: list[int] = field(default_factory=list)
    nll_bound: list[float] = field(default_factory=list)  # latent-variable models' ELBO
    history_tokens: list[int] = field(default_factory=list)
    references: list[str] = field(default_factory=list)
    hypotheses: dict[str, list[str]] = field(default_factory=dict)  # by decoding label
    ranks: list[int] = field(default_factory=list)

    def rows(self, seed: int) -> list[ExampleResult]:
        return [
            ExampleResult(
                seed=seed,
                id=example_id,
                nll_sum=self.nll_sum[i],
                n_tokens=self.n_tokens[i],
                history_tokens=self.history_tokens[i],
                reference=self.references[i] if self.references else None,
                hypotheses={label: hyps[i] for label, hyps in self.hypotheses.items()},
                rank=self.ranks[i] if self.ranks else None,
            )
            for i, example_id in enumerate(self.ids)
        ]

    def nll_metrics(self) -> dict[str, float]:
        """Test loss and perplexity over every scored token (and the ELBO bound's)."""
        total, count = math.fsum(self.nll_sum), sum(self.n_tokens)
        metrics = {TEST_LOSS.key: total / count, TEST_PPL.key: perplexity(total, count)}
        if self.nll_bound:
            bound = math.fsum(self.nll_bound)
            metrics[TEST_LOSS_ELBO.key] = bound / count
            metrics[TEST_PPL_ELBO.key] = perplexity(bound, count)
        return metrics

    def require(self, dataset: ExampleDataset) -> None:
        """A ``DataError`` when no test example was scored."""
        if not self.ids:
            raise DataError(
                dataset.table.root,
                f"no {dataset.task.value} test examples; check tokenize.corpora.<name>.split",
            )


@dataclass(frozen=True)
class Evaluator:
    """Evaluates the models of one task on one corpus's test split: called with a model,
    the test set, a progress bar (or None) and the seed the model was trained with (a
    latent-variable model's importance samples draw from it). ``settings``: the evaluate
    params; ``policy``: how the models use their device (the test batches reach it through
    ``policy.evaluation_batches``)."""

    settings: EvaluateParams
    policy: ExecutionPolicy

    def __call__(
        self, model: nn.Module, dataset: ExampleDataset, bar: Reporter | None, seed: int
    ) -> SeedResult:
        raise NotImplementedError


@dataclass
class SeedResult:
    """One seed's metrics, per-example values and samples text."""

    metrics: dict[str, float]
    examples: Collected
    samples: str = ""


def n_test_batches(dataset: ExampleDataset, batch_size: int, max_batches: int | None) -> int:
    """How many batches :func:`test_batches` yields."""
    n = math.ceil(len(dataset) / batch_size)
    return n if max_batches is None else min(n, max_batches)


def test_batches(
    dataset: ExampleDataset,
    batch_size: int,
    max_batches: int | None,
    bar: Reporter | None = None,
) -> Iterator[tuple[list[Example], Any]]:
    """The test examples in file order (so every model sees them identically), with their
    collated batch; at most ``max_batches`` batches. ``bar`` advances as the next is asked
    for (on CUDA ``policy.evaluation_batches`` asks one batch ahead of its caller)."""
    n = len(dataset)
    for b, start in enumerate(range(0, n, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        examples = [dataset[i] for i in range(start, min(start + batch_size, n))]
        yield examples, dataset.collate(examples)
        if bar is not None:  # the caller is done with this batch
            bar.advance()


def example_id(example: Example) -> str:
    """``<dialogue id>#<turn>``: an example's name in ``per_example.jsonl``."""
    return f"{example.dialogue_id}#{example.turn}"


def history_text(history: History, row: int, vocab: Vocab) -> str:
    """The utterances of one history, oldest first, separated by `` | ``."""
    mask = history.input_mask[row]
    ids = history.input_ids[row][mask].tolist()
    index = history.utt_index[row][mask].tolist()
    utterances: dict[int, list[int]] = {}
    for token, u in zip(ids, index, strict=True):
        utterances.setdefault(u, []).append(token)
    return " | ".join(vocab.decode(u) for _, u in sorted(utterances.items()))


def aggregate(per_seed: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean over seeds of every metric all seeds have; with several seeds also
    ``<metric>_ci95``, the 95% Student-t half-width (``stats.mean_ci``)."""
    if not per_seed:
        raise ValueError("aggregate: no seeds")
    names = [k for k in per_seed[0] if all(k in m for m in per_seed)]
    out: dict[str, float] = {}
    for name in names:
        values = [m[name] for m in per_seed]
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if len(finite) != len(values):
            out[name] = math.nan
            continue
        ci = stats.mean_ci(finite)
        out[name] = ci.mean
        if len(values) > 1 and name not in SETTINGS:
            out[f"{name}{CI_SUFFIX}"] = ci.half_width
    return out
