"""Evaluating a generate model on the test split: teacher-forced NLL (perplexity), and for
each decoding (``evaluate.decodes``) the decoded responses' ChatEval metrics, sacrebleu
BLEU and, on a task-oriented corpus, MultiWOZ's Inform/Success/Entity-F1 in both schemes
and the HT-Encoder paper's BLEU; the Pearson r of history length and per-example loss."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from pipeline.config import DecodeParams, EvaluateParams
from pipeline.data.loader import ExampleDataset, open_split
from pipeline.data.records import Example
from pipeline.data.splits import Split
from pipeline.data.vocab import Vocab
from pipeline.errors import DataError
from pipeline.eval import catalogue as m
from pipeline.eval import stats, text
from pipeline.eval.collect import (
    Collected,
    Evaluator,
    SeedResult,
    example_id,
    history_text,
    test_batches,
)
from pipeline.eval.embeddings import load_vectors, train_word2vec
from pipeline.eval.perplexity import example_nll, history_tokens
from pipeline.names import Task
from pipeline.progress import Reporter


def decode_label(suffix: str) -> str:
    """A decoding's name in ``per_example.jsonl`` and samples: its metric suffix without
    the underscore (``beam5``), ``greedy`` for greedy's empty suffix."""
    return suffix.lstrip("_") or "greedy"


def decode_config(decode: DecodeParams, max_length: int) -> Any:
    """The decoder's config of one ``evaluate.decodes`` entry."""
    from pipeline.decode import DecodeConfig

    return DecodeConfig(max_length=max_length, **decode.model_dump())


def embedding_vectors(settings: EvaluateParams, shards: Path, vocab: Vocab) -> text.Vectors:
    """The embedding metrics' vectors: the configured file, else word2vec trained on the
    training split's responses (decoded, so every vocabulary word the model can emit and
    that occurs in training gets a vector)."""
    w2v = settings.word2vec
    if w2v.vectors is not None:
        return load_vectors(w2v.vectors)
    train = open_split(shards, Task.GENERATE, Split.TRAIN)
    n = len(train) if w2v.max_sentences is None else min(len(train), w2v.max_sentences)
    sentences = [text.words(vocab.decode(train[i].target_ids)) for i in range(n)]
    return train_word2vec(
        sentences,
        dim=w2v.dim,
        window=w2v.window,
        min_count=w2v.min_count,
        epochs=w2v.epochs,
        seed=w2v.seed,
    )


def multiwoz_metrics(
    ids: Sequence[str], hyps: Sequence[str], refs: Sequence[str], dialogues: Any, db: Any
) -> dict[str, float]:
    """Inform, Success, Entity-F1 and Combined (the official scheme the HT-Encoder paper
    reports, ``eval.multiwoz``) and Inform/Success in the standardized scheme of the
    field's current table (``*_standardized``, ``eval.multiwoz_standard``: ground-truth
    states, domains from the placeholders or the state) over the test dialogues whose every
    system turn was evaluated (a ``max_batches`` cut leaves the last dialogue partial)."""
    from pipeline.eval.multiwoz import multiwoz_scores, official_responses, system_turns
    from pipeline.eval.multiwoz_standard import Prediction, standardized_rates

    by_dialogue: dict[str, dict[int, tuple[str, str]]] = {}
    for example, hyp, ref in zip(ids, hyps, refs, strict=True):
        did, turn = example.rsplit("#", 1)
        by_dialogue.setdefault(did, {})[int(turn)] = (hyp, ref)
    known = {d.id: d for d in dialogues}
    responses, references = {}, {}
    for did, turns in by_dialogue.items():
        dialogue = known.get(did)
        if dialogue is None or sorted(turns) != system_turns(dialogue):
            continue
        responses[did] = [turns[t][0] for t in sorted(turns)]
        references[did] = [turns[t][1] for t in sorted(turns)]
    if not responses:
        raise DataError(
            "data/raw", "no test dialogue was evaluated whole; raise evaluate.max_batches"
        )
    scores = multiwoz_scores(dialogues, responses, references, db)
    standardized = standardized_rates(
        known,
        {
            did: [Prediction(r) for r in official_responses(known[did], generated)]
            for did, generated in responses.items()
        },
        db,
    )
    return {
        m.INFORM.key: scores.inform,
        m.SUCCESS.key: scores.success,
        m.ENTITY_F1.key: scores.entity_f1,
        m.COMBINED.key: scores.combined,
        m.INFORM_STD.key: standardized.inform,
        m.SUCCESS_STD.key: standardized.success,
    }


def batch_seed(seed: int, index: int) -> int:
    """The decoding seed of test batch ``index``: drawn from ``(seed, index)``, so every
    batch samples afresh and a run repeats exactly. (One seed for every batch gave the
    examples at one position of their batches the same random draws: a model that ignores
    the history then "said" the same sampled sentence to each of them.)"""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


@dataclass(frozen=True)
class GenerateEvaluator(Evaluator):
    """Evaluates generate models on one corpus's test split.

    ``multiwoz``: ``(test dialogues, MultiWozDB)`` to add Inform/Success/Entity-F1;
    ``bleu_tokenize``: the corpus' sacrebleu tokenizer (``CorpusSpec.bleu_tokenize``);
    ``max_length``: the corpus's ``generate.max_response``.
    """

    vocab: Vocab = field(kw_only=True)
    decodes: Sequence[DecodeParams] = field(kw_only=True)
    vectors: text.Vectors = field(kw_only=True)
    max_length: int = field(kw_only=True)
    multiwoz: Any = None
    bleu_tokenize: str = text.DEFAULT_TOKENIZE

    @property
    def configs(self) -> dict[str, Any]:
        """The decoder's config of each decoding, by metric suffix."""
        return {d.suffix: decode_config(d, self.max_length) for d in self.decodes}

    def __call__(
        self, model: nn.Module, dataset: ExampleDataset, bar: Reporter | None, seed: int
    ) -> SeedResult:
        """Teacher-forced NLL and the decoded responses' metrics of one model; ``seed``
        seeds a latent-variable model's importance samples; ``bar`` shows progress over
        the batches, naming the decoding under way."""
        ev = self.settings
        got = Collected()
        samples: list[str] = []
        batches = test_batches(dataset, ev.batch_size, ev.max_batches, bar)
        for index, (examples, batch) in enumerate(self.policy.evaluation_batches(batches)):
            decoded = self._batch(model, examples, batch, got, bar, seed, index)
            samples += self._samples(examples, batch, got, decoded, ev.n_samples - len(samples))
        got.require(dataset)
        metrics = {m.N_EXAMPLES.key: float(len(got.ids)), **got.nll_metrics()}
        for suffix in self.configs:
            metrics |= self._decoded_metrics(suffix, got)
        return SeedResult(metrics | _length_correlation(got), got, "\n".join(samples))

    def _batch(
        self,
        model: nn.Module,
        examples: list[Example],
        batch: Any,
        got: Collected,
        bar: Reporter | None,
        seed: int,
        index: int,
    ) -> dict[str, list[str]]:
        """Score and decode batch number ``index`` into ``got``; returns its responses by
        suffix."""
        from pipeline.decode import generate

        nll = example_nll(model, batch, self.settings.latent_samples, seed)
        got.ids += [example_id(e) for e in examples]
        got.nll_sum += nll.nll_sum.tolist()
        got.n_tokens += nll.n_tokens.tolist()
        if nll.bound is not None:
            got.nll_bound += nll.bound.tolist()
        got.history_tokens += history_tokens(batch.history).tolist()
        got.references += [self.vocab.decode(e.target_ids) for e in examples]
        decoded = {}
        for suffix, config in self.configs.items():
            if bar is not None and len(self.configs) > 1:
                bar.update(info=f"decoding {decode_label(suffix)}")
            out = generate(
                model, batch, config.model_copy(update={"seed": batch_seed(config.seed, index)})
            )
            decoded[suffix] = [
                text.strip_special(self.vocab.decode(row[:n].tolist()))
                for row, n in zip(out.tokens.cpu(), out.lengths.cpu(), strict=True)
            ]
            got.hypotheses.setdefault(decode_label(suffix), []).extend(decoded[suffix])
        return decoded

    def _samples(
        self,
        examples: list[Example],
        batch: Any,
        got: Collected,
        decoded: dict[str, list[str]],
        room: int,
    ) -> list[str]:
        """``samples.md`` entries (one per example) for the first ``room`` examples."""
        entries: list[str] = []
        history = batch.history.cpu()
        references = got.references[-len(examples) :]
        for i in range(min(room, len(examples))):
            lines = [
                f"## {example_id(examples[i])}",
                "",
                f"- history: {history_text(history, i, self.vocab)}",
                f"- reference: {references[i]}",
                *(f"- generated ({decode_label(s)}): {h[i]}" for s, h in decoded.items()),
                "",
            ]
            entries.append("\n".join(lines))
        return entries

    def _decoded_metrics(self, suffix: str, got: Collected) -> dict[str, float]:
        hyps, refs = got.hypotheses[decode_label(suffix)], got.references
        chat = text.chateval(hyps, refs, self.vectors)
        metrics = {
            m.DISTINCT_1.key: chat.distinct_1,
            m.DISTINCT_2.key: chat.distinct_2,
            m.AVG_LENGTH.key: chat.avg_length,
            m.EMB_AVERAGE.key: chat.embedding_average,
            m.EMB_EXTREMA.key: chat.embedding_extrema,
            m.EMB_GREEDY.key: chat.greedy_matching,
            m.EMB_SKIPPED.key: float(chat.embedding_skipped),
            m.BLEU.key: text.corpus_bleu(hyps, refs, tokenize=self.bleu_tokenize),
        }
        if self.multiwoz is not None:
            metrics |= multiwoz_metrics(got.ids, hyps, refs, *self.multiwoz)
            metrics[m.BLEU_HIER.key] = text.wrapped_bleu(hyps, refs)
        return {f"{k}{suffix}": v for k, v in metrics.items()}


def _length_correlation(got: Collected) -> dict[str, float]:
    """Pearson r (and p) of history tokens and per-example mean NLL (U-Net, Table 7)."""
    lengths = np.asarray(got.history_tokens, dtype=float)
    counts = np.asarray(got.n_tokens, dtype=float)
    keep = counts > 0
    if keep.sum() < 2:
        return {}
    corr = stats.pearson(lengths[keep], np.asarray(got.nll_sum)[keep] / counts[keep])
    return {m.PEARSON_R.key: corr.r, m.PEARSON_P.key: corr.p_value}
