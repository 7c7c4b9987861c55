"""Model selection on a validation *score*, computed as the test split is scored.

Two scores (``train.*.select_by``), each reported under ``valid_score`` with its parts:

- ``multiwoz_score`` (:class:`MultiWozValidationScore`): the HT-Encoder authors' criterion.
  The HIER authors (bsantraigi/HIER, ``main.py``: ``training`` and ``evaluate``) decode the
  validation dialogues greedily and keep the weights with the best
  ``BLEU + 0.5 * (Inform + Success)``; their Optuna search (``search_params.py``) maximises
  the same number. It is computed with the conventions of the evaluate stage, so a selected
  model's validation score and its test score mean the same:

  - responses: greedy decoding (``pipeline.decode``) of at most the corpus' ``max_response``
    tokens, specials stripped;
  - BLEU: the HT-Encoder paper's convention (``text.wrapped_bleu``, ``bleu_hier``: the
    authors' corpus BLEU on whitespace tokens, 0-100) over every decoded turn;
  - Inform/Success: the official scheme the paper reports (``eval.multiwoz``), over the
    validation dialogues whose every system turn was decoded (``max_eval_batches`` may cut
    the last one), on a 0-100 scale.

  The authors score every 3 epochs; here the score is computed at every evaluation.
- ``mrr`` (:class:`RankingValidationScore`): a select run's mean reciprocal rank of the
  true response among each validation example's candidates (``select.n_candidates_eval``
  of them, as on the test split; ties counted pessimistically, ``eval.ranking``), with
  R@1 and R@10 beside it: what the evaluate stage scores a ranker on
  (``eval.selection``). The ranking loss is no stand-in for it: a ranker trains on
  ``n_candidates_train`` candidates (one true in 10) and validates on 100 (one in 100),
  so its validation BCE mostly measures how far its prior for "true" is from 1/100, and
  falls or rises while the ranking does the opposite.

Both are computed at every evaluation of the loop (``eval_every`` and each epoch's end),
under the run's precision and at the loop's validation batch sizes and limit
(``execution.Evaluation``: on CUDA the largest that fits). Those sizes are global, as the
validation loss's: on several workers each device decodes batches of its share of one
(``size // world_size`` examples, :func:`rank_batches`), every rank at the same size, each
rank every ``world_size``-th of them, and the loop gathers the outputs, so every rank
computes the same score.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import CorpusParams, DecodeParams, Selection, TokenizeParams
from pipeline.data.loader import ExampleDataset, load_vocab, open_split
from pipeline.data.records import Example
from pipeline.data.splits import Split
from pipeline.data.vocab import Vocab
from pipeline.eval import ranking, text
from pipeline.eval.catalogue import MRR, RECALL
from pipeline.eval.collect import example_id, test_batches
from pipeline.eval.generation import multiwoz_metrics
from pipeline.eval.multiwoz import combined_score
from pipeline.eval.multiwoz_db import MultiWozDB
from pipeline.execution import Evaluation
from pipeline.names import Task

SCORE = Selection.MULTIWOZ_SCORE.metric  # the key the loop selects on (every score's)
RANKING_RECALLS = (1, 10)  # the R@k reported beside the validation MRR

# One decoded validation example: (``<dialogue id>#<turn>``, response, reference).
Decoded = tuple[str, str, str]


@dataclass
class MultiWozValidationScore:
    """``BLEU + 0.5 * (Inform + Success)`` of greedy responses on a MultiWOZ corpus'
    validation split (module docstring). Paths are strings and the loaded data is dropped
    on pickling, so a ``TrainJob`` carrying it ships cheaply to Ray workers."""

    shards: str  # the corpus' tokenize output
    raw: str  # its download output (dialogues with goals, the database)
    corpus: str
    corpus_params: CorpusParams

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_data", "_dialogues")}

    @cached_property
    def _data(self) -> tuple[ExampleDataset, Vocab]:
        shards = Path(self.shards)
        return open_split(shards, Task.GENERATE, Split.VALID), load_vocab(shards)

    @cached_property
    def _dialogues(self) -> tuple[list[Any], MultiWozDB]:
        from pipeline.data.formats import ParseStats
        from pipeline.data.tokenize import read_splits

        section = TokenizeParams(corpora={self.corpus: self.corpus_params})
        raw = Path(self.raw)
        dialogues = read_splits(self.corpus, raw, section, ParseStats()).get(Split.VALID, [])
        return dialogues, MultiWozDB.load(raw)

    @torch.no_grad()
    def decode(
        self, model: nn.Module, rank: int, world_size: int, evaluation: Evaluation
    ) -> list[Decoded]:
        """Greedy responses to this rank's share of the validation batches, on
        ``evaluation``'s policy (the run's autocast) at its batch sizes (the validation
        batch size and limit of the run's params; on CUDA the largest that fits)."""
        from pipeline.decode import DecodeConfig, generate

        dataset, vocab = self._data
        config = DecodeConfig(
            max_length=self.corpus_params.generate.max_response,
            **DecodeParams().model_dump(),
        )
        policy = evaluation.policy

        def attempt(size: int, limit: int | None) -> list[Decoded]:
            out: list[Decoded] = []
            batches = rank_batches(dataset, size, limit, rank, world_size)
            for examples, batch in policy.evaluation_batches(batches):
                with policy.autocast():
                    got = generate(model, batch, config)
                rows = zip(examples, got.tokens.cpu(), got.lengths.cpu(), strict=True)
                for example, row, n in rows:
                    response = text.strip_special(vocab.decode(row[:n].tolist()))
                    out.append((example_id(example), response, vocab.decode(example.target_ids)))
            return out

        return evaluation.run(attempt, model)

    def score(self, decoded: list[Decoded]) -> dict[str, float]:
        """``valid_score`` and its parts (``valid_bleu_hier``, ``valid_inform``,
        ``valid_success``) from every rank's responses."""
        decoded = sorted(decoded, key=lambda row: _order(row[0]))
        ids, hyps, refs = (list(column) for column in zip(*decoded, strict=True))
        dialogues, db = self._dialogues
        rates = multiwoz_metrics(ids, hyps, refs, dialogues, db)
        bleu = text.wrapped_bleu(hyps, refs)
        return {
            SCORE: combined_score(bleu, rates["inform"], rates["success"]),
            "valid_bleu_hier": bleu,
            "valid_inform": rates["inform"],
            "valid_success": rates["success"],
        }


def rank_batches(
    dataset: ExampleDataset, size: int, limit: int | None, rank: int, world_size: int
) -> Iterator[tuple[list[Example], Any]]:
    """``rank``'s share of the validation split at ``size`` (global) examples a batch and
    ``limit`` (None: all) global batches: the split in file order cut into batches of one
    device's share, ``size // world_size`` examples (at least one), and of those every
    ``world_size``-th from ``rank``. The ranks together cover the examples that ``limit``
    batches of ``size`` cover, and no device holds more than its share of a global batch
    (the validation loss's per-device batches, ``ShardData.valid``)."""
    per_device = max(1, size // world_size)
    batches = None if limit is None else limit * world_size
    for i, item in enumerate(test_batches(dataset, per_device, batches)):
        if i % world_size == rank:
            yield item


def _order(example_id: str) -> tuple[str, int]:
    dialogue, turn = example_id.rsplit("#", 1)
    return dialogue, int(turn)


# One ranked validation example: (``<dialogue id>#<turn>``, rank of its true response).
Ranked = tuple[str, int]


@dataclass
class RankingValidationScore:
    """The mean reciprocal rank of the true response among a select corpus' validation
    examples' candidates (module docstring). The path is a string and the loaded split is
    dropped on pickling, so a ``TrainJob`` carrying it ships cheaply to Ray workers."""

    shards: str  # the corpus' tokenize output

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_data"}

    @cached_property
    def _data(self) -> ExampleDataset:
        return open_split(Path(self.shards), Task.SELECT, Split.VALID)

    @torch.no_grad()
    def decode(
        self, model: nn.Module, rank: int, world_size: int, evaluation: Evaluation
    ) -> list[Ranked]:
        """The rank of the true response of each example of this rank's share of the
        validation batches, scored on ``evaluation``'s policy at its batch sizes."""
        dataset, policy = self._data, evaluation.policy

        def attempt(size: int, limit: int | None) -> list[Ranked]:
            out: list[Ranked] = []
            batches = rank_batches(dataset, size, limit, rank, world_size)
            for examples, batch in policy.evaluation_batches(batches):
                with policy.autocast():
                    logits = model.score(batch).float()
                real = batch.candidate_mask.any(-1)
                ranks = ranking.first_correct_ranks(
                    logits.masked_fill(~real, float("-inf")), batch.labels
                )
                out += zip((example_id(e) for e in examples), ranks.cpu().tolist(), strict=True)
            return out

        return evaluation.run(attempt, model)

    def score(self, ranked: list[Ranked]) -> dict[str, float]:
        """``valid_score`` (the MRR), ``valid_mrr`` and ``valid_recall_at_<k>`` from every
        rank's ranks."""
        ranks = torch.tensor([r for _, r in sorted(ranked)], dtype=torch.long)
        mrr = ranking.mrr_from_ranks(ranks)
        recalls = {
            f"valid_{RECALL[k].key}": ranking.recall_from_ranks(ranks, k) for k in RANKING_RECALLS
        }
        return {SCORE: mrr, f"valid_{MRR.key}": mrr, **recalls}
