"""The evaluate stage's logic: every trained seed of a run, scored on the test split.

``evaluate_run`` reads ``data/train/<model>-<corpus>/manifest.json`` (one entry per seed),
loads each seed's exported weights and writes ``metrics/<model>-<corpus>.json`` and
``data/eval/<model>-<corpus>/``:

- ``metrics/<key>.json``: flat ``{metric: value}``; with several seeds each value is the
  mean over seeds and ``<metric>_ci95`` the half-width of its 95% Student-t interval. It
  lies outside the git-ignored ``data/`` so that git (and so every commit and DVC
  experiment) holds it: DVC's convention for metrics (``cache: false`` in dvc.yaml);
- ``seeds.json``: every seed's own metrics;
- ``per_example.jsonl``: one row per test example per seed (``seed``, ``id`` =
  ``<dialogue id>#<turn>``, ``nll_sum``, ``n_tokens``, ``history_tokens``; generate:
  ``hypothesis[_<suffix>]`` and ``reference``; select: ``rank``), for paired bootstraps;
- ``samples.md``: the first histories with their reference and generated responses.

Metrics by task (names are the report's contract):

- generate: ``test_loss`` (mean token NLL, teacher forcing) and ``test_ppl``; for each
  decoding (``evaluate.decodes``; greedy without suffix, beam 5 as ``_beam5``) the ChatEval
  set ``distinct_1 distinct_2 avg_length embedding_average embedding_extrema
  embedding_greedy``, sacrebleu ``bleu`` and, on MultiWOZ, ``inform success entity_f1
  combined``; ``length_loss_pearson_r``/``_p`` between history tokens and per-example
  mean NLL (U-Net paper, Table 7);
- select: ``recall_at_1/10/50`` and ``mrr`` (pessimistic ties, ``pipeline.eval.ranking``);
- lm: ``test_loss`` and ``test_ppl`` over the sentence tokens;
- every task: ``n_examples``.

The metrics of each seed are also logged to that seed's training run in MLflow (the ids
are in the train manifest), prefixed ``eval/``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline import tracking
from pipeline.config import (
    CorpusName,
    CorpusParams,
    DecodeParams,
    EvaluateParams,
    Task,
    TokenizeParams,
    TrackingParams,
)
from pipeline.data.batch import History, LMBatch, SelectBatch
from pipeline.data.examples import Example
from pipeline.data.loader import ExampleDataset, load_vocab, open_split
from pipeline.data.vocab import Vocab
from pipeline.errors import DataError
from pipeline.eval import ranking, stats, text
from pipeline.eval.embeddings import load_vectors, train_word2vec
from pipeline.eval.perplexity import example_nll, history_tokens, perplexity
from pipeline.progress import Mode, Reporter

TEST_SPLIT = "test"
TRAIN_SPLIT = "train"
TRAIN_MANIFEST = "manifest.json"
METRICS_DIR = "metrics"  # metrics/<key>.json, tracked by git (module docstring)
SEEDS_FILE = "seeds.json"
PER_EXAMPLE_FILE = "per_example.jsonl"
SAMPLES_FILE = "samples.md"
RECALL_KS = (1, 10, 50)
MULTIWOZ_CORPORA = frozenset({CorpusName.MULTIWOZ.value, CorpusName.MULTIWOZ21.value})
MLFLOW_PREFIX = "eval/"


@dataclass(frozen=True)
class EvalSettings:
    """What the evaluate stage reads of params.yaml."""

    evaluate: EvaluateParams
    corpus: CorpusParams
    tracking: TrackingParams


@dataclass(frozen=True)
class TrainedSeed:
    """One trained model of a run: its seed, exported weights and MLflow run (if tracked)."""

    seed: int | None
    checkpoint: Path
    run_name: str
    mlflow: dict[str, Any] | None


@dataclass
class SeedResult:
    """One seed's metrics, per-example rows and samples text."""

    metrics: dict[str, float]
    rows: list[dict[str, Any]]
    samples: str = ""


@dataclass
class _Collected:
    """Per-example values gathered over the test batches of one seed."""

    ids: list[str] = field(default_factory=list)
    nll_sum: list[float] = field(default_factory=list)
    n_tokens: list[int] = field(default_factory=list)
    history_tokens: list[int] = field(default_factory=list)
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, key: str, values: Sequence[Any]) -> None:
        self.extra.setdefault(key, []).extend(values)

    def rows(self, seed: int | None) -> list[dict[str, Any]]:
        out = []
        for i, example_id in enumerate(self.ids):
            row = {
                "seed": seed,
                "id": example_id,
                "nll_sum": self.nll_sum[i],
                "n_tokens": self.n_tokens[i],
                "history_tokens": self.history_tokens[i],
            }
            row.update({k: v[i] for k, v in self.extra.items()})
            out.append(row)
        return out


# --------------------------------------------------------------------------- inputs


def trained_seeds(train_dir: Path, root: Path) -> list[TrainedSeed]:
    """The seeds of a trained run, from its ``manifest.json`` (a ``seeds`` list, or the
    single-seed manifest ``train_run`` writes, whose seed is then unknown: ``None``)."""
    path = train_dir / TRAIN_MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(path, "no trained model: run the train stage for this run first") from None
    except json.JSONDecodeError as err:
        raise DataError(path, f"invalid JSON ({err.msg})", line=err.lineno) from None
    entries = manifest.get("seeds") or [manifest]
    seeds = []
    for entry in entries:
        if "checkpoint" not in entry:
            raise DataError(path, "a seed entry has no 'checkpoint'; rerun the train stage")
        checkpoint = Path(entry["checkpoint"])
        seeds.append(
            TrainedSeed(
                seed=entry.get("seed"),
                checkpoint=checkpoint if checkpoint.is_absolute() else root / checkpoint,
                run_name=str(entry.get("run_name", "")),
                mlflow=entry.get("mlflow"),
            )
        )
    return seeds


def load_model(checkpoint: Path, device: torch.device) -> nn.Module:
    """The exported model of ``checkpoint``, rebuilt through the registry, in eval mode."""
    from pipeline.models import registry
    from pipeline.train.checkpoint import load_checkpoint

    state = load_checkpoint(checkpoint)
    name = state["model_name"]
    config = registry.spec(name).config_cls.model_validate(state["model_config"])
    model = registry.build_from_config(name, config)
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def word_vectors(settings: EvaluateParams, shards: Path, vocab: Vocab) -> text.Vectors:
    """The embedding metrics' vectors: the configured file, else word2vec trained on the
    training split's responses (decoded, so every vocabulary word the model can emit and
    that occurs in training gets a vector)."""
    w2v = settings.word2vec
    if w2v.vectors is not None:
        return load_vectors(w2v.vectors)
    train = open_split(shards, Task.GENERATE, TRAIN_SPLIT)
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
) -> SeedResult:
    """Teacher-forced NLL and the decoded responses' metrics of one generate model.

    ``multiwoz``: ``(test dialogues, MultiWozDB)`` to add Inform/Success/Entity-F1;
    ``bar``: progress over the batches, naming the decoding under way.
    """
    from pipeline.decode import generate

    ev, corpus = settings.evaluate, settings.corpus
    max_length = corpus.generate.max_response
    configs = {d.suffix: decode_config(d, max_length) for d in decodes}
    got = _Collected()
    samples: list[str] = []
    for examples, batch in test_batches(dataset, ev.batch_size, ev.max_batches, bar):
        batch = batch.to(device)
        nll = example_nll(model, batch)
        got.ids += [example_id(e) for e in examples]
        got.nll_sum += nll.nll_sum.tolist()
        got.n_tokens += nll.n_tokens.tolist()
        got.history_tokens += history_tokens(batch.history).tolist()
        refs = [vocab.decode(e.target_ids) for e in examples]
        got.add("reference", refs)
        hyps_by_suffix = {}
        for suffix, config in configs.items():
            if bar is not None and len(configs) > 1:
                bar.update(info=f"decoding {suffix.lstrip('_') or 'greedy'}")
            out = generate(model, batch, config)
            hyps = [
                text.strip_special(vocab.decode(row[:n].tolist()))
                for row, n in zip(out.tokens.cpu(), out.lengths.cpu(), strict=True)
            ]
            got.add(f"hypothesis{suffix}", hyps)
            hyps_by_suffix[suffix] = hyps
        for i in range(len(examples)):
            if len(samples) >= ev.n_samples:
                break
            samples += [
                f"## {example_id(examples[i])}",
                "",
                f"- history: {history_text(batch.history.to('cpu'), i, vocab)}",
                f"- reference: {refs[i]}",
                *(f"- {_label(s)}: {h[i]}" for s, h in hyps_by_suffix.items()),
                "",
            ]
    _require_examples(got, dataset)
    metrics = {"n_examples": float(len(got.ids)), **_nll_metrics(got)}
    refs = got.extra["reference"]
    bleu_tokenize = "none" if multiwoz is not None else text.DEFAULT_TOKENIZE
    for suffix in configs:
        hyps = got.extra[f"hypothesis{suffix}"]
        chat = text.chateval(hyps, refs, vectors)
        metrics.update(
            {
                f"distinct_1{suffix}": chat.distinct_1,
                f"distinct_2{suffix}": chat.distinct_2,
                f"avg_length{suffix}": chat.avg_length,
                f"embedding_average{suffix}": chat.embedding_average,
                f"embedding_extrema{suffix}": chat.embedding_extrema,
                f"embedding_greedy{suffix}": chat.greedy_matching,
                f"bleu{suffix}": text.corpus_bleu(hyps, refs, tokenize=bleu_tokenize),
            }
        )
        if multiwoz is not None:
            scores = multiwoz_metrics(got.ids, hyps, refs, *multiwoz)
            metrics.update({f"{k}{suffix}": v for k, v in scores.items()})
    lengths = np.asarray(got.history_tokens, dtype=float)
    counts = np.asarray(got.n_tokens, dtype=float)
    keep = counts > 0
    if keep.sum() >= 2:
        mean_nll = np.asarray(got.nll_sum)[keep] / counts[keep]
        corr = stats.pearson(lengths[keep], mean_nll)
        metrics["length_loss_pearson_r"] = corr.r
        metrics["length_loss_pearson_p"] = corr.p_value
    return SeedResult(metrics, got.rows(None), "\n".join(samples))


def _label(suffix: str) -> str:
    return f"generated ({suffix.lstrip('_')})" if suffix else "generated (greedy)"


def multiwoz_metrics(
    ids: Sequence[str], hyps: Sequence[str], refs: Sequence[str], dialogues: Any, db: Any
) -> dict[str, float]:
    """Inform, Success, Entity-F1 and Combined over the test dialogues whose every system
    turn was evaluated (a ``max_batches`` cut leaves the last dialogue partial)."""
    from pipeline.eval.multiwoz import multiwoz_scores, system_turns

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
    return {
        "inform": scores.inform,
        "success": scores.success,
        "entity_f1": scores.entity_f1,
        "combined": scores.combined,
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
            scores = model.score(batch).float().masked_fill(~real, float("-inf"))
            bce = nn.functional.binary_cross_entropy_with_logits(
                scores.masked_fill(~real, 0.0), batch.labels, reduction="none"
            )
            per_example = (bce * real).sum(-1) / real.sum(-1).clamp(min=1)
            rank = ranking.first_correct_ranks(scores, batch.labels).cpu()
            ranks.append(rank)
            got.ids += [example_id(e) for e in examples]
            got.nll_sum += per_example.double().cpu().tolist()
            got.n_tokens += [1] * len(examples)
            got.history_tokens += history_tokens(batch.history).cpu().tolist()
            got.add("rank", rank.tolist())
    _require_examples(got, dataset)
    all_ranks = torch.cat(ranks)
    metrics = {"n_examples": float(len(got.ids))}
    for k in RECALL_KS:
        metrics[f"recall_at_{k}"] = ranking.recall_from_ranks(all_ranks, k)
    metrics["mrr"] = ranking.mrr_from_ranks(all_ranks)
    return SeedResult(metrics, got.rows(None))


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
    return SeedResult({"n_examples": float(len(got.ids)), **_nll_metrics(got)}, got.rows(None))


def _nll_metrics(got: _Collected) -> dict[str, float]:
    total, count = math.fsum(got.nll_sum), sum(got.n_tokens)
    return {"test_loss": total / count, "test_ppl": perplexity(total, count)}


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


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON: written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def metrics_path(root: Path, key: str) -> Path:
    """Where the evaluate stage writes run ``key``'s aggregated metrics (module docstring)."""
    return root / METRICS_DIR / f"{key}.json"


def _write_json(path: Path, content: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_json_safe(content), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _multiwoz_inputs(corpus_name: str, settings: EvalSettings, root: Path) -> tuple[Any, Any]:
    from pipeline.data.formats import ParseStats
    from pipeline.data.tokenize import read_splits
    from pipeline.eval.multiwoz import MultiWozDB

    raw = root / "data" / "raw" / corpus_name
    section = TokenizeParams(corpora={corpus_name: settings.corpus})
    dialogues = read_splits(corpus_name, raw, section, ParseStats()).get(TEST_SPLIT, [])
    return dialogues, MultiWozDB.load(raw)


def _log_to_mlflow(seed: TrainedSeed, metrics: dict[str, float], samples: Path, root: Path):
    info = seed.mlflow
    if not info or not info.get("run_id"):
        return
    ref = tracking.RunRef(
        tracking.resolve_uri(info["tracking_uri"], root),  # manifests keep it relative
        info["run_id"],
        info["experiment"],
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
) -> dict[str, float]:
    """Evaluate every seed of ``<model>-<corpus>``; writes ``metrics/<key>.json`` and
    ``data/eval/<key>/`` (module docstring) and returns the aggregated metrics.
    ``progress``: per seed, the test batches done of the total (``pipeline.progress``)."""
    from pipeline.config import run_key
    from pipeline.models import registry

    root = Path(root).resolve()
    key = run_key(model_name, corpus)
    task = registry.spec(model_name).task
    shards = root / "data" / "shards" / corpus
    seeds = trained_seeds(root / "data" / "train" / key, root)
    out = root / "data" / "eval" / key
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = load_vocab(shards)
    dataset = open_split(shards, task.value, TEST_SPLIT)
    vectors = multiwoz = None
    decodes = settings.evaluate.decodes_for(model_name)
    if task.value == Task.GENERATE:
        vectors = word_vectors(settings.evaluate, shards, vocab)
        if corpus in MULTIWOZ_CORPORA:
            multiwoz = _multiwoz_inputs(corpus, settings, root)

    per_seed: list[dict[str, Any]] = []
    samples_text = ""
    with (out / PER_EXAMPLE_FILE).open("w") as rows_file:
        ev = settings.evaluate
        for seed in seeds:
            model = load_model(seed.checkpoint, device)
            bar = Reporter(
                f"evaluate {key}" + (f" (seed {seed.seed})" if seed.seed is not None else ""),
                n_test_batches(dataset, ev.batch_size, ev.max_batches),
                unit="batch",
                units="batches",
                show=progress,
            )
            with torch.no_grad(), bar:
                if task.value == Task.GENERATE:
                    result = evaluate_generate(
                        model, dataset, vocab, settings, decodes, vectors, device, multiwoz, bar
                    )
                elif task.value == Task.SELECT:
                    result = evaluate_select(model, dataset, settings, device, bar)
                else:
                    result = evaluate_lm(model, dataset, settings, device, bar)
            for row in result.rows:
                rows_file.write(json.dumps(_json_safe({**row, "seed": seed.seed})) + "\n")
            if not samples_text:
                samples_text = result.samples
            per_seed.append(
                {"seed": seed.seed, "checkpoint": str(seed.checkpoint), "metrics": result.metrics}
            )
            seed_samples = out / SAMPLES_FILE
            seed_samples.write_text(_samples_md(key, samples_text))
            if settings.tracking.enabled:
                _log_to_mlflow(seed, result.metrics, seed_samples, root)
    metrics = aggregate([s["metrics"] for s in per_seed])
    _write_json(out / SEEDS_FILE, {"model": model_name, "corpus": corpus, "seeds": per_seed})
    metrics_file = metrics_path(root, key)
    metrics_file.parent.mkdir(parents=True, exist_ok=True)
    _write_json(metrics_file, metrics)
    return metrics


def _samples_md(key: str, body: str) -> str:
    if not body:
        return f"# {key}\n\nNo generated samples (not a generate model).\n"
    return f"# {key}: test samples (first seed)\n\n{body}\n"
