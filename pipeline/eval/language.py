"""Evaluating a language model on the test split: test loss and perplexity over the
documents' sentence tokens (``eval.perplexity``), under one of two protocols
(``evaluate.lm.protocol``, ``config.evaluate.LMEvaluateParams``):

- ``document`` (the default): each test document on its own, from ``<bos>``;
- ``stream``: the test documents, in file order, as one text, as LM papers report PTB
  (Transformer-XL's ``train.py`` l. 299-329): windows advance ``stride`` units at a time,
  each scoring its last ``stride`` units with up to ``context`` units before them, so every
  token is scored exactly once, with the text before it in its window. Its unit is the
  model's ``stream_unit``: tokens for a flat model (GPT), whole sentences for a
  hierarchical one (HGPT, whose document GPT reads sentences); ``evaluate.lm.unit:
  sentences`` streams every model by sentences, so flat and hierarchical models read the
  same windows (equal context). Each window is read as one document, from ``<bos>``
  (HGPT: its begin-of-document vector). A run's streamed validation
  (``tokenize.corpora.<c>.lm.validation``) reads the same windows of the valid split
  (``data.streams``).

Both score the same tokens (every sentence token, ``<eos>`` included), and a streamed
token's NLL counts for the document it belongs to, so ``per_example.jsonl`` and the paired
bootstraps keep their meaning. A streamed evaluation records its window in the metrics
(:data:`STREAM_KEYS`); without those keys a run was scored per document.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from pipeline.config.evaluate import LMProtocol
from pipeline.data.batch import LMBatch
from pipeline.data.loader import ExampleDataset, collate_lm
from pipeline.data.records import LMExample
from pipeline.data.streams import UNITS, TextStream, window_bounds
from pipeline.eval.catalogue import LM_STREAM, N_EXAMPLES
from pipeline.eval.collect import Collected, Evaluator, SeedResult, example_id, test_batches
from pipeline.eval.perplexity import example_nll
from pipeline.models.base import LanguageModel
from pipeline.progress import Reporter

# The metrics a streamed evaluation adds (context, stride), by the model's stream unit.
STREAM_KEYS = {unit: (context.key, stride.key) for unit, (context, stride) in LM_STREAM.items()}


def protocol_text(metrics: Mapping[str, float]) -> str:
    """How a run's LM perplexity was measured, read from its metrics (:data:`STREAM_KEYS`;
    none: per document): the report's statement of the protocol."""

    def count(n: float, unit: str) -> str:
        return f"{n:g} {unit.removesuffix('s') if n == 1 else unit}"

    for unit, (context, stride) in STREAM_KEYS.items():
        if context in metrics and stride in metrics:
            return (
                f"streamed over the test text, {count(metrics[stride], unit)} scored per "
                f"window after up to {count(metrics[context], unit)} of context"
            )
    return "per document (each test document on its own, from `<bos>`)"


@dataclass(frozen=True)
class Window:
    """One model input of a streamed evaluation: ``sentences``, read as one document, whose
    last ``len(owners)`` tokens are scored, the ``i``-th of them belonging to test document
    ``owners[i]`` (the tokens before them are its context)."""

    sentences: list[np.ndarray]
    owners: np.ndarray


def stream_windows(
    documents: Sequence[Sequence[np.ndarray]], unit: str, context: int, stride: int
) -> Iterator[Window]:
    """The windows that score every token of ``documents`` (each a list of sentences)
    once, streamed as one text by ``unit`` (``tokens`` or ``sentences``): window ``k``
    scores units ``[k * stride, (k + 1) * stride)`` after up to ``context`` units before
    them (``data.streams.window_bounds``, the windows streamed validation reads too)."""
    if unit not in UNITS:
        raise ValueError(f"stream unit {unit!r}: tokens or sentences")
    stream = TextStream.of_documents(documents)
    owner = np.repeat(np.arange(len(documents)), [sum(len(s) for s in d) for d in documents])
    for bounds in window_bounds(stream.size(unit), context, stride):  # type: ignore[arg-type]
        lo, hi = stream.token_span(int(bounds[1]), int(bounds[2]), unit)  # type: ignore[arg-type]
        sentences = stream.example(bounds, unit).sentences  # type: ignore[arg-type]
        yield Window(list(sentences), owner[lo:hi])


@dataclass(frozen=True)
class LMEvaluator(Evaluator):
    """Evaluates language models on one corpus's test split."""

    @torch.no_grad()
    def __call__(
        self, model: nn.Module, dataset: ExampleDataset, bar: Reporter | None, seed: int
    ) -> SeedResult:
        """Test loss and perplexity of one language model (``history_tokens`` = the
        document's tokens), by ``evaluate.lm.protocol``."""
        if self.settings.lm.protocol is LMProtocol.STREAM:
            return self._streamed(model, dataset, bar)  # type: ignore[arg-type]
        ev, got = self.settings, Collected()
        batches = test_batches(dataset, ev.batch_size, ev.max_batches, bar)
        for examples, moved in self.policy.evaluation_batches(batches):
            batch = cast(LMBatch, moved)
            nll = example_nll(model, batch)
            got.ids += [example_id(e) for e in examples]
            got.nll_sum += nll.nll_sum.cpu().tolist()
            got.n_tokens += nll.n_tokens.cpu().tolist()
            got.history_tokens += batch.flat_mask.long().sum(-1).cpu().tolist()
        got.require(dataset)
        return SeedResult({N_EXAMPLES.key: float(len(got.ids)), **got.nll_metrics()}, got)

    def _streamed(
        self, model: LanguageModel, dataset: ExampleDataset, bar: Reporter | None
    ) -> SeedResult:
        """The ``stream`` protocol over the documents the ``document`` one would score
        (the first ``max_batches`` batches), ``batch_size`` windows a forward pass."""
        ev = self.settings
        unit, context, stride = ev.lm.window(model.stream_unit)
        n = len(dataset)
        if ev.max_batches is not None:
            n = min(n, ev.max_batches * ev.batch_size)
        if n == 0:
            Collected().require(dataset)
        examples: list[LMExample] = [dataset[i] for i in range(n)]  # type: ignore[misc]
        documents = [e.sentences for e in examples]
        windows = list(stream_windows(documents, unit, context, stride))
        nll_sum = np.zeros(n)
        n_tokens = np.zeros(n, dtype=np.int64)
        batches_done = 0
        groups = (windows[start : start + ev.batch_size]
                  for start in range(0, len(windows), ev.batch_size))  # fmt: skip
        pairs = ((g, collate_lm([LMExample("window", 0, w.sentences) for w in g])) for g in groups)
        for group, batch in self.policy.evaluation_batches(pairs):
            mask = batch.sentence_mask
            # each row's real tokens in order, read back to the host once a batch
            values = model.token_nll(batch).double()[mask].cpu().numpy()
            ends = np.cumsum(mask.flatten(1).sum(-1).cpu().numpy())
            for window, end in zip(group, ends, strict=True):
                scored = values[end - len(window.owners) : end]
                np.add.at(nll_sum, window.owners, scored)
                np.add.at(n_tokens, window.owners, 1)
            if bar is not None:  # the documents before the last one scored are done
                done = int(group[-1].owners[-1]) // ev.batch_size
                bar.advance(done - batches_done)
                batches_done = done
        if bar is not None:
            bar.advance(-(-n // ev.batch_size) - batches_done)
        got = Collected(
            ids=[example_id(e) for e in examples],
            nll_sum=nll_sum.tolist(),
            n_tokens=n_tokens.tolist(),
            history_tokens=[sum(len(s) for s in d) for d in documents],
        )
        recorded = dict(zip(STREAM_KEYS[unit], (float(context), float(stride)), strict=True))
        metrics = {N_EXAMPLES.key: float(n), **got.nll_metrics(), **recorded}
        return SeedResult(metrics, got)
