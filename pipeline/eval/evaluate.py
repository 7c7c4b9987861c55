"""The evaluate stage's logic: every trained seed of a run, scored on the test split.

``evaluate_run`` reads the run's :class:`~pipeline.artifacts.TrainRecord` (one entry per
seed), loads each seed's exported weights (``artifacts.load_model``) and writes, through
the stage contract (``pipeline.artifacts``):

- ``metrics/<key>.json``: flat ``{metric: value}``; with several seeds each value is the
  mean over seeds and ``<metric>_ci95`` the half-width of its 95% Student-t interval
  (git-tracked DVC metrics);
- ``data/eval/<key>/seeds.json`` (:class:`~pipeline.artifacts.EvalRecord`): every seed's
  own metrics;
- ``data/eval/<key>/per_example.jsonl`` (:class:`~pipeline.artifacts.ExampleResult`): one
  row per test example per seed (``id`` = ``<dialogue id>#<turn>``), for paired bootstraps;
- ``data/eval/<key>/samples.md``: the first histories with their reference and generated
  responses.

Metrics by task (names are the report's contract):

- generate: ``test_loss`` (mean token NLL, teacher forcing) and ``test_ppl``; for VHRED
  and VHCR the NLL is importance-sampled (``evaluate.latent_samples`` posterior draws,
  seeded by the trained seed) and ``test_loss_elbo``/``test_ppl_elbo`` give the ELBO bound
  of the same draws (``pipeline.models.latent``); for each
  decoding (``evaluate.decodes``; greedy without suffix, beam 5 as ``_beam5``) the ChatEval
  set ``distinct_1 distinct_2 avg_length embedding_average embedding_extrema
  embedding_greedy``, sacrebleu ``bleu`` and, on MultiWOZ, ``inform success entity_f1
  combined inform_standardized success_standardized`` and ``bleu_hier`` (the HT-Encoder
  paper's BLEU convention, ``text.wrapped_bleu``); ``length_loss_pearson_r``/``_p``
  between history tokens and per-example mean NLL (U-Net paper, Table 7);
- select: ``recall_at_1/10/50`` and ``mrr`` (pessimistic ties, ``pipeline.eval.ranking``);
- lm: ``test_loss`` and ``test_ppl`` over the sentence tokens;
- every task: ``n_examples``.

The metrics of each seed are also logged to that seed's training run in MLflow (the ids
are in the train manifest), prefixed ``eval/``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline import tracking
from pipeline.artifacts import (
    PER_EXAMPLE_FILE,
    SAMPLES_FILE,
    SEEDS_FILE,
    EvalRecord,
    ExampleResult,
    Layout,
    SeedMetrics,
    TrainedSeed,
    load_model,
    read_train,
    write_examples,
    write_metrics,
)
from pipeline.config import (
    CorpusParams,
    DecodeParams,
    EvaluateParams,
    Task,
    TokenizeParams,
    TrackingParams,
)
from pipeline.data.batch import History, LMBatch, SelectBatch
from pipeline.data.corpora import corpus_spec
from pipeline.data.loader import ExampleDataset, load_vocab, open_split
from pipeline.data.records import Example
from pipeline.data.splits import Split
from pipeline.data.vocab import Vocab
from pipeline.errors import DataError
from pipeline.eval import ranking, stats, text
from pipeline.eval.embeddings import load_vectors, train_word2vec
from pipeline.eval.perplexity import example_nll, history_tokens, perplexity
from pipeline.models.base import candidate_bce
from pipeline.progress import Mode, Reporter

RECALL_KS = (1, 10, 50)
MLFLOW_PREFIX = "eval/"


@dataclass(frozen=True)
class EvalSettings:
    """What the evaluate stage reads of params.yaml."""

    evaluate: EvaluateParams
    corpus: CorpusParams
    tracking: TrackingParams


@dataclass
class _Collected:
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


@dataclass
class SeedResult:
    """One seed's metrics, per-example values and samples text."""

    metrics: dict[str, float]
    examples: _Collected
    samples: str = ""


# --------------------------------------------------------------------------- inputs


def word_vectors(settings: EvaluateParams, shards: Path, vocab: Vocab) -> text.Vectors:
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
    collated batch; at most ``max_batches`` batches. ``bar`` advances as each is done."""
    n = len(dataset)
    for b, start in enumerate(range(0, n, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        examples = [dataset[i] for i in range(start, min(start + batch_size, n))]
        yield examples, dataset.collate(examples)
        if bar is not None:  # the caller is done with this batch
            bar.advance()


def example_id(example: Example) -> str:
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


# --------------------------------------------------------------------------- per task


def decode_config(decode: DecodeParams, max_length: int) -> Any:
    from pipeline.decode import DecodeConfig

    return DecodeConfig(max_length=max_length, **decode.model_dump())


def evaluate_generate(
    model: nn.Module,
    dataset: ExampleDataset,
    vocab: Vocab,
    settings: EvalSettings,
    decodes: Sequence[DecodeParams],
    vectors: text.Vectors,
    device: torch.device,
    multiwoz: Any = None,
    bar: Reporter | None = None,
    bleu_tokenize: str = text.DEFAULT_TOKENIZE,
    seed: int = 0,
) -> SeedResult:
    """Teacher-forced NLL and the decoded responses' metrics of one generate model.

    ``multiwoz``: ``(test dialogues, MultiWozDB)`` to add Inform/Success/Entity-F1;
    ``bleu_tokenize``: the corpus' sacrebleu tokenizer (``CorpusSpec.bleu_tokenize``);
    ``bar``: progress over the batches, naming the decoding under way; ``seed`` seeds a
    latent-variable model's importance samples.
    """
    from pipeline.decode import generate

    ev, corpus = settings.evaluate, settings.corpus
    max_length = corpus.generate.max_response
    configs = {d.suffix: decode_config(d, max_length) for d in decodes}
    got = _Collected()
    samples: list[str] = []
    for examples, batch in test_batches(dataset, ev.batch_size, ev.max_batches, bar):
        batch = batch.to(device)
        nll = example_nll(model, batch, ev.latent_samples, seed)
        got.ids += [example_id(e) for e in examples]
        got.nll_sum += nll.nll_sum.tolist()
        got.n_tokens += nll.n_tokens.tolist()
        if nll.bound is not None:
            got.nll_bound += nll.bound.tolist()
        got.history_tokens += history_tokens(batch.history).tolist()
        refs = [vocab.decode(e.target_ids) for e in examples]
        got.references += refs
        hyps_by_suffix = {}
        for suffix, config in configs.items():
            if bar is not None and len(configs) > 1:
                bar.update(info=f"decoding {suffix.lstrip('_') or 'greedy'}")
            out = generate(model, batch, config)
            hyps = [
                text.strip_special(vocab.decode(row[:n].tolist()))
                for row, n in zip(out.tokens.cpu(), out.lengths.cpu(), strict=True)
            ]
            got.hypotheses.setdefault(decode_label(suffix), []).extend(hyps)
            hyps_by_suffix[suffix] = hyps
        for i in range(len(examples)):
            if len(samples) >= ev.n_samples:
                break
            samples += [
                f"## {example_id(examples[i])}",
                "",
                f"- history: {history_text(batch.history.to('cpu'), i, vocab)}",
                f"- reference: {refs[i]}",
                *(f"- generated ({decode_label(s)}): {h[i]}" for s, h in hyps_by_suffix.items()),
                "",
            ]
    _require_examples(got, dataset)
    metrics = {"n_examples": float(len(got.ids)), **_nll_metrics(got)}
    refs = got.references

    for suffix in configs:
        hyps = got.hypotheses[decode_label(suffix)]
        chat = text.chateval(hyps, refs, vectors)
        metrics.update(
            {
                f"distinct_1{suffix}": chat.distinct_1,
                f"distinct_2{suffix}": chat.distinct_2,
                f"avg_length{suffix}": chat.avg_length,
                f"embedding_average{suffix}": chat.embedding_average,
                f"embedding_extrema{suffix}": chat.embedding_extrema,
                f"embedding_greedy{suffix}": chat.greedy_matching,
                f"embedding_skipped{suffix}": float(chat.embedding_skipped),
                f"bleu{suffix}": text.corpus_bleu(hyps, refs, tokenize=bleu_tokenize),
            }
        )
        if multiwoz is not None:
            scores = multiwoz_metrics(got.ids, hyps, refs, *multiwoz)
            scores["bleu_hier"] = text.wrapped_bleu(hyps, refs)
            metrics.update({f"{k}{suffix}": v for k, v in scores.items()})
    lengths = np.asarray(got.history_tokens, dtype=float)
    counts = np.asarray(got.n_tokens, dtype=float)
    keep = counts > 0
    if keep.sum() >= 2:
        mean_nll = np.asarray(got.nll_sum)[keep] / counts[keep]
        corr = stats.pearson(lengths[keep], mean_nll)
        metrics["length_loss_pearson_r"] = corr.r
        metrics["length_loss_pearson_p"] = corr.p_value
    return SeedResult(metrics, got, "\n".join(samples))


def decode_label(suffix: str) -> str:
    """A decoding's name in ``per_example.jsonl`` and samples: its metric suffix without
    the underscore (``beam5``), ``greedy`` for greedy's empty suffix."""
    return suffix.lstrip("_") or "greedy"


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
        "inform": scores.inform,
        "success": scores.success,
        "entity_f1": scores.entity_f1,
        "combined": scores.combined,
        "inform_standardized": standardized.inform,
        "success_standardized": standardized.success,
    }


def evaluate_select(
    model: nn.Module,
    dataset: ExampleDataset,
    settings: EvalSettings,
    device: torch.device,
    bar: Reporter | None = None,
) -> SeedResult:
    """Recall@k and MRR of one selection model; per example the BCE over its real
    candidates (``nll_sum``, ``n_tokens`` = 1) and the rank of the first correct one."""
    ev = settings.evaluate
    got = _Collected()
    ranks: list[torch.Tensor] = []
    with torch.no_grad():
        for examples, batch in test_batches(dataset, ev.batch_size, ev.max_batches, bar):
            batch: SelectBatch = batch.to(device)
            real = batch.candidate_mask.any(-1)
            logits = model.score(batch).float()
            per_example = candidate_bce(logits, batch.labels, real)
            scores = logits.masked_fill(~real, float("-inf"))
            rank = ranking.first_correct_ranks(scores, batch.labels).cpu()
            ranks.append(rank)
            got.ids += [example_id(e) for e in examples]
            got.nll_sum += per_example.double().cpu().tolist()
            got.n_tokens += [1] * len(examples)
            got.history_tokens += history_tokens(batch.history).cpu().tolist()
            got.ranks += rank.tolist()
    _require_examples(got, dataset)
    all_ranks = torch.cat(ranks)
    metrics = {"n_examples": float(len(got.ids))}
    for k in RECALL_KS:
        metrics[f"recall_at_{k}"] = ranking.recall_from_ranks(all_ranks, k)
    metrics["mrr"] = ranking.mrr_from_ranks(all_ranks)
    return SeedResult(metrics, got)


def evaluate_lm(
    model: nn.Module,
    dataset: ExampleDataset,
    settings: EvalSettings,
    device: torch.device,
    bar: Reporter | None = None,
) -> SeedResult:
    """Test loss and perplexity of one language model (``history_tokens`` = the
    document's tokens)."""
    ev = settings.evaluate
    got = _Collected()
    for examples, batch in test_batches(dataset, ev.batch_size, ev.max_batches, bar):
        batch: LMBatch = batch.to(device)
        nll = example_nll(model, batch)
        got.ids += [example_id(e) for e in examples]
        got.nll_sum += nll.nll_sum.cpu().tolist()
        got.n_tokens += nll.n_tokens.cpu().tolist()
        got.history_tokens += batch.flat_mask.long().sum(-1).cpu().tolist()
    _require_examples(got, dataset)
    return SeedResult({"n_examples": float(len(got.ids)), **_nll_metrics(got)}, got)


def _nll_metrics(got: _Collected) -> dict[str, float]:
    total, count = math.fsum(got.nll_sum), sum(got.n_tokens)
    metrics = {"test_loss": total / count, "test_ppl": perplexity(total, count)}
    if got.nll_bound:
        bound = math.fsum(got.nll_bound)
        metrics |= {"test_loss_elbo": bound / count, "test_ppl_elbo": perplexity(bound, count)}
    return metrics


def _require_examples(got: _Collected, dataset: ExampleDataset) -> None:
    if not got.ids:
        raise DataError(
            dataset.table.root,
            f"no {dataset.task.value} test examples; check tokenize.corpora.<name>.split",
        )


# --------------------------------------------------------------------------- the run


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
        if len(values) > 1 and name != "n_examples":
            out[f"{name}_ci95"] = ci.half_width
    return out


def _multiwoz_inputs(corpus_name: str, settings: EvalSettings, raw: Path) -> tuple[Any, Any]:
    from pipeline.data.formats import ParseStats
    from pipeline.data.tokenize import read_splits
    from pipeline.eval.multiwoz import MultiWozDB

    section = TokenizeParams(corpora={corpus_name: settings.corpus})
    dialogues = read_splits(corpus_name, raw, section, ParseStats()).get(Split.TEST, [])
    return dialogues, MultiWozDB.load(raw)


def _log_to_mlflow(seed: TrainedSeed, metrics: dict[str, float], samples: Path, root: Path):
    info = seed.mlflow
    if info is None:
        return
    ref = tracking.RunRef(
        tracking.resolve_uri(info.tracking_uri, root),  # records keep it relative
        info.run_id,
        info.experiment,
        seed.run_name,
        tracking.fallback_uri(root),
    )
    tracker = ref.attach()
    finite = {f"{MLFLOW_PREFIX}{k}": v for k, v in metrics.items() if math.isfinite(v)}
    tracker.log_metrics(finite, step=0)
    if samples.is_file():
        tracker.log_artifact(samples, MLFLOW_PREFIX.rstrip("/"))


def evaluate_run(
    settings: EvalSettings,
    model_name: str,
    corpus: str,
    root: str | Path = ".",
    progress: bool | Mode = False,
    variant: str | None = None,
) -> dict[str, float]:
    """Evaluate every seed of run ``<model>-<corpus>[-<variant>]``; writes
    ``metrics/<key>.json`` and ``data/eval/<key>/`` (module docstring) and returns the
    aggregated metrics. ``progress``: per seed, the test batches done of the total
    (``pipeline.progress``)."""
    from pipeline.config import run_key
    from pipeline.models import registry

    start = time.perf_counter()
    layout = Layout(Path(root).resolve())
    key = run_key(model_name, corpus, variant)
    task = registry.spec(model_name).task
    shards = layout.shards(corpus)
    seeds = read_train(layout, key).seeds
    out = layout.eval_out(key)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = load_vocab(shards)
    dataset = open_split(shards, task.value, Split.TEST)
    vectors = multiwoz = None
    decodes = settings.evaluate.decodes_for(model_name)
    if task.value == Task.GENERATE:
        vectors = word_vectors(settings.evaluate, shards, vocab)
        if corpus_spec(corpus).task_oriented:
            multiwoz = _multiwoz_inputs(corpus, settings, layout.raw(corpus))

    per_seed: list[SeedMetrics] = []
    rows: list[ExampleResult] = []
    samples_text = ""
    ev = settings.evaluate
    for seed in seeds:
        model = load_model(layout.resolve(seed.checkpoint), device)
        bar = Reporter(
            f"evaluate {key} (seed {seed.seed})",
            n_test_batches(dataset, ev.batch_size, ev.max_batches),
            unit="batch",
            units="batches",
            show=progress,
        )
        with torch.no_grad(), bar:
            if task.value == Task.GENERATE:
                result = evaluate_generate(
                    model,
                    dataset,
                    vocab,
                    settings,
                    decodes,
                    vectors,
                    device,
                    multiwoz,
                    bar,
                    corpus_spec(corpus).bleu_tokenize,
                    seed.seed,
                )
            elif task.value == Task.SELECT:
                result = evaluate_select(model, dataset, settings, device, bar)
            else:
                result = evaluate_lm(model, dataset, settings, device, bar)
        rows += result.examples.rows(seed.seed)
        samples_text = samples_text or result.samples
        per_seed.append(
            SeedMetrics(seed=seed.seed, checkpoint=seed.checkpoint, metrics=result.metrics)
        )
        seed_samples = out / SAMPLES_FILE
        seed_samples.write_text(_samples_md(key, samples_text))
        if settings.tracking.enabled:
            _log_to_mlflow(seed, result.metrics, seed_samples, layout.root)
    metrics = aggregate([s.metrics for s in per_seed])
    write_examples(out / PER_EXAMPLE_FILE, rows)
    wall = time.perf_counter() - start
    EvalRecord(model=model_name, corpus=corpus, seeds=per_seed, wall_s=wall).write(out / SEEDS_FILE)
    write_metrics(layout.metrics(key), metrics)
    return metrics


def _samples_md(key: str, body: str) -> str:
    if not body:
        return f"# {key}\n\nNo generated samples (not a generate model).\n"
    return f"# {key}: test samples (first seed)\n\n{body}\n"
