"""The evaluate stage on really trained tiny models: metrics recomputed independently."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from pipeline.artifacts import (
    PER_EXAMPLE_FILE,
    SEEDS_FILE,
    EvalRecord,
    ExampleResult,
    Layout,
    read_examples,
    read_train,
)
from pipeline.config import ConfigError, DecodeStrategy, Precision, parse_params
from pipeline.data.loader import load_vocab, open_split
from pipeline.data.shards import read_manifest
from pipeline.data.tokenize import tokenize_corpus
from pipeline.decode import DecodeConfig, generate
from pipeline.eval import text
from pipeline.eval.collect import aggregate
from pipeline.eval.generation import batch_seed, decode_label
from pipeline.eval.ranking import first_correct_ranks
from pipeline.eval.stage import EvalSettings, evaluate_run
from pipeline.models import registry
from pipeline.models.saved import load_model
from pipeline.plan import SEED_STRIDE, RunRequest, plan_training
from pipeline.train.training import train_seeds
from tests.trained import write_trained

TOKENIZE = {
    "corpora": {
        "chitchat": {
            "tasks": ["generate", "select", "lm"],
            "max_dialogues": 24,
            "vocab": {"size": 300},
            "split": {"valid": 0.2, "test": 0.15},
            "generate": {"max_history": 40, "max_utterances": 4, "max_response": 10},
            "select": {"n_candidates_train": 4, "n_candidates_eval": 8, "max_candidate": 10},
            "lm": {"sentences_per_document": 4, "max_sentence": 12},
        }
    }
}
MODELS = {
    "transformer": {
        "d_model": 16,
        "n_encoder_layers": 1,
        "n_decoder_layers": 1,
        "n_heads": 2,
        "d_head": 8,
        "d_ff": 32,
    },
    "transformer_ranker": {"d_embed": 16, "d_model": 12, "n_heads": 2, "d_ff": 16, "n_layers": 1},
    "gpt": {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32},
}
KEY = "transformer-chitchat"


def project_params(tracking: bool = False, **evaluate) -> dict:
    """params.yaml content for tiny runs of the three tasks on chitchat."""
    return {
        "tokenize": TOKENIZE,
        "train": {
            "defaults": {
                "epochs": 2,
                "batch_size": 16,
                "max_batches_per_epoch": 4,
                "patience": None,
                "optimizer": {"lr": 0.01},
                "precision": "fp32",
            },
            "models": {name: {"model": config} for name, config in MODELS.items()},
            "runs": {f"{name}-chitchat": {"model": name, "corpus": "chitchat"} for name in MODELS},
        },
        "tracking": {"enabled": tracking, "log_model": False, "sample_generations": 0},
        "evaluate": {
            "batch_size": 8,
            "decodes": [
                {"strategy": "greedy"},
                {"strategy": "beam", "beam_size": 3, "min_length": 2},
            ],
            "word2vec": {"dim": 8, "epochs": 1},
            "n_samples": 2,
            **evaluate,
        },
    }


def settings(raw: dict) -> EvalSettings:
    params = parse_params(raw)
    return EvalSettings(params.evaluate, params.corpus("chitchat"), params.tracking)


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> Path:
    """A project with tokenized chitchat."""
    root = tmp_path_factory.mktemp("evalproject")
    tokenize_corpus(
        "chitchat", None, root / "data" / "shards" / "chitchat", parse_params(project_params())
    )
    return root


@pytest.fixture(scope="module")
def project(tokenized) -> Path:
    """The tokenized project with one trained seed of each tiny model."""
    params = parse_params(project_params())
    for name in MODELS:
        train_seeds(RunRequest.of(params, f"{name}-chitchat"), tokenized, show_progress=False)
    return tokenized


def read_rows(root: Path, key: str) -> tuple[ExampleResult, ...]:
    return read_examples(Layout(root).eval_out(key) / PER_EXAMPLE_FILE)


def test_evaluate_params_need_greedy_and_distinct_suffixes():
    with pytest.raises(ConfigError, match="greedy") as caught:
        parse_params({"evaluate": {"decodes": [{"strategy": "beam"}]}})
    assert caught.value.key == "evaluate.decodes"
    with pytest.raises(ConfigError, match="suffix"):
        parse_params({"evaluate": {"decodes": [{}, {"strategy": "greedy"}]}})
    with pytest.raises(ConfigError) as caught:
        parse_params({"evaluate": {"models": {"hier": [{"strategy": "beam"}]}}})
    assert caught.value.key == "evaluate.models.hier" and "greedy" in caught.value.reason
    with pytest.raises(ConfigError) as caught:
        parse_params({"train": {"defaults": {"seeds": 0}}})
    assert caught.value.key == "train.defaults.seeds"
    raw = {"tokenize": TOKENIZE, "evaluate": {"models": {"hier": [{}, {"strategy": "beam"}]}}}
    ev = parse_params(raw).evaluate
    assert [d.suffix for d in ev.decodes_for("hier")] == ["", "_beam5"]
    assert [d.suffix for d in ev.decodes_for("unet")] == [""]


def test_aggregate_means_and_ci_over_seeds():
    one = aggregate([{"bleu": 2.0, "n_examples": 5.0}])
    assert one == {"bleu": 2.0, "n_examples": 5.0}  # one seed: no interval
    three = aggregate([{"bleu": 1.0, "n_examples": 5.0}, {"bleu": 2.0, "n_examples": 5.0},
                       {"bleu": 3.0, "n_examples": 5.0}])  # fmt: skip
    # t_{0.975, 2} = 4.302653; s = 1; half-width = 4.302653 / sqrt(3)
    assert three["bleu"] == pytest.approx(2.0)
    assert three["bleu_ci95"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)
    assert "n_examples_ci95" not in three


def test_settings_recorded_beside_metrics_get_no_interval():
    stream = {"lm_stream_context_tokens": 130.0, "lm_stream_stride_tokens": 10.0}
    three = aggregate([{"test_ppl": p, **stream} for p in (60.0, 61.0, 62.0)])
    assert three["lm_stream_context_tokens"] == 130.0 and "test_ppl_ci95" in three
    assert not any(key.startswith("lm_stream") and key.endswith("_ci95") for key in three)


def test_seeds_override_only_the_seed(tokenized):
    raw = project_params()
    raw["train"]["runs"]["gpt-chitchat"]["overrides"] = {"seeds": 3}
    params = parse_params(raw)
    plan = plan_training(RunRequest.of(params, "gpt-chitchat"), tokenized)
    assert SEED_STRIDE == 1000 and plan.seeds == [1234, 2234, 3234]
    seeded = plan.for_seed(1)
    assert seeded.knobs.seed == 2234 and seeded.seed_index == 1
    assert seeded.knobs.model_dump(exclude={"seed"}) == plan.knobs.model_dump(exclude={"seed"})
    assert seeded.config == plan.config and seeded.seeds == plan.seeds
    assert seeded.name != plan.name  # each seed its own run (checkpoints, MLflow run)
    out = Layout(tokenized.resolve()).train_out("gpt-chitchat")
    assert seeded.model_file == out / "seed-1" / "model.pt"
    assert plan.knobs.seed == 1234  # a copy: the first seed's plan is unchanged
    other = plan_training(RunRequest.of(params, "transformer-chitchat"), tokenized)
    assert other.knobs.seed == 1234 and other.seeds == [1234]


@pytest.mark.slow  # trains three tiny models once (module fixture)
def test_generate_metrics_match_direct_computation(project):
    raw = project_params()
    metrics = evaluate_run(settings(raw), "transformer", "chitchat", project)
    out = project / "data" / "eval" / KEY
    # metrics outside the git-ignored data/, where git and DVC experiments hold them
    written = json.loads((project / "metrics" / f"{KEY}.json").read_text())
    assert written == pytest.approx(metrics, nan_ok=True)
    rows = read_rows(project, KEY)
    test = open_split(project / "data" / "shards" / "chitchat", "generate", "test")
    assert len(rows) == len(test) == metrics["n_examples"]
    assert [r.id for r in rows] == [f"{e.dialogue_id}#{e.turn}" for e in test]

    # perplexity recomputed here from the model, not from the rows
    (seed,) = read_train(Layout(project), KEY).seeds
    model = load_model(project / seed.checkpoint)
    batch = test.collate([test[i] for i in range(len(test))])
    with torch.no_grad():
        memory = model.encode(batch)
        logits, _ = model.decode(batch.target_ids[:, :-1], memory)
    mask = batch.target_mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch.target_ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(mask)[mask]
    assert metrics["test_loss"] == pytest.approx(float(nll.mean()), rel=1e-4)
    assert metrics["test_ppl"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-4)
    assert sum(r.n_tokens for r in rows) == int(mask.sum())

    # greedy and beam hypotheses are what generate() gives; BLEU/distinct recomputed
    vocab = load_vocab(project / "data" / "shards" / "chitchat")
    for suffix, config in (("", DecodeConfig(max_length=10)),
                           ("_beam3", DecodeConfig(strategy=DecodeStrategy.BEAM, beam_size=3,
                                                   min_length=2, max_length=10))):  # fmt: skip
        out_ids = generate(model, test.collate([test[0], test[1]]), config)
        first = [
            vocab.decode(t[:n].tolist())
            for t, n in zip(out_ids.tokens, out_ids.lengths, strict=True)
        ]
        assert [r.hypotheses[decode_label(suffix)] for r in rows[:2]] == first
        hyps = [r.hypotheses[decode_label(suffix)] for r in rows]
        refs = [r.reference for r in rows]
        assert metrics[f"bleu{suffix}"] == pytest.approx(text.corpus_bleu(hyps, refs))
        words = [w for h in hyps for w in h.split()]
        assert words, f"decode {suffix!r} produced only empty responses"
        assert metrics[f"distinct_1{suffix}"] == pytest.approx(len(set(words)) / len(words))
        assert metrics[f"avg_length{suffix}"] == pytest.approx(len(words) / len(hyps))
        for name in ("embedding_average", "embedding_extrema", "embedding_greedy"):
            assert -1.0 <= metrics[f"{name}{suffix}"] <= 1.0
    assert rows[0].reference == vocab.decode(test[0].target_ids)
    assert "<bos>" not in rows[0].reference and rows[0].seed == 1234

    lengths = np.array([r.history_tokens for r in rows], dtype=float)
    losses = np.array([r.nll_sum / r.n_tokens for r in rows])
    assert metrics["length_loss_pearson_r"] == pytest.approx(np.corrcoef(lengths, losses)[0, 1])
    assert 0.0 <= metrics["length_loss_pearson_p"] <= 1.0
    samples = (out / "samples.md").read_text()
    assert rows[0].id in samples and "generated (beam3)" in samples
    # evaluate.n_samples (2) examples, each with its history, reference and decodings
    assert samples.count("\n## ") == 2 and samples.count("- history: ") == 2
    assert f"## {rows[1].id}\n" in samples and f"## {rows[2].id}\n" not in samples
    assert EvalRecord.read(out / SEEDS_FILE).seeds[0].metrics == pytest.approx(metrics, nan_ok=True)


@pytest.mark.slow  # trains three tiny models once (module fixture)
def test_each_test_batch_samples_with_its_own_seed(project):
    """A sampled decoding draws batch i with ``batch_seed(seed, i)``: batches do not repeat
    one another's random draws, and the run repeats exactly."""
    nucleus = {"strategy": "nucleus", "top_p": 0.9, "temperature": 0.7, "seed": 5}
    raw = project_params(decodes=[{"strategy": "greedy"}, nucleus], batch_size=4)
    evaluate_run(settings(raw), "transformer", "chitchat", project)
    rows = read_rows(project, KEY)
    test = open_split(project / "data" / "shards" / "chitchat", "generate", "test")
    vocab = load_vocab(project / "data" / "shards" / "chitchat")
    (seed,) = read_train(Layout(project), KEY).seeds
    model = load_model(project / seed.checkpoint)
    seeds = [batch_seed(5, i) for i in range(3)]
    assert len(set(seeds)) == 3 and seeds == [batch_seed(5, i) for i in range(3)]
    for i, seed_of_batch in enumerate(seeds):
        config = DecodeConfig(**{**nucleus, "seed": seed_of_batch}, max_length=10)
        out = generate(model, test.collate([test[j] for j in range(4 * i, 4 * i + 4)]), config)
        drawn = [
            text.strip_special(vocab.decode(t[:n].tolist()))
            for t, n in zip(out.tokens, out.lengths, strict=True)
        ]
        label = decode_label("_topp0.9")
        assert [r.hypotheses[label] for r in rows[4 * i : 4 * i + 4]] == drawn


@pytest.mark.slow  # trains three tiny models once (module fixture)
def test_select_ranks_match_model_scores(project):
    key = "transformer_ranker-chitchat"
    metrics = evaluate_run(settings(project_params()), "transformer_ranker", "chitchat", project)
    rows = read_rows(project, key)
    test = open_split(project / "data" / "shards" / "chitchat", "select", "test")
    assert len(rows) == len(test) == metrics["n_examples"]
    (seed,) = read_train(Layout(project), key).seeds
    model = load_model(project / seed.checkpoint)
    ranks = []
    for start in range(0, len(test), 8):
        batch = test.collate([test[i] for i in range(start, min(start + 8, len(test)))])
        with torch.no_grad():
            scores = model.score(batch)
        scores = scores.masked_fill(~batch.candidate_mask.any(-1), float("-inf"))
        ranks += first_correct_ranks(scores, batch.labels).tolist()
    assert [r.rank for r in rows] == ranks
    ranks_np = np.array(ranks)
    assert metrics["recall_at_1"] == pytest.approx(np.mean((ranks_np >= 1) & (ranks_np <= 1)))
    assert metrics["recall_at_10"] == pytest.approx(np.mean((ranks_np >= 1) & (ranks_np <= 10)))
    assert metrics["mrr"] == pytest.approx(np.mean([1 / r if r else 0 for r in ranks]))
    assert "test_ppl" not in metrics and "bleu" not in metrics


@pytest.mark.slow  # trains three tiny models once (module fixture)
def test_lm_perplexity_and_quick_max_batches(project):
    key = "gpt-chitchat"
    metrics = evaluate_run(settings(project_params(max_batches=1)), "gpt", "chitchat", project)
    rows = read_rows(project, key)
    assert len(rows) == metrics["n_examples"] == min(8, len(open_split(
        project / "data" / "shards" / "chitchat", "lm", "test")))  # fmt: skip
    nll, n = sum(r.nll_sum for r in rows), sum(r.n_tokens for r in rows)
    assert metrics["test_ppl"] == pytest.approx(math.exp(nll / n))
    assert (project / "data" / "eval" / key / "samples.md").read_text().startswith("# gpt")
    assert read_train(Layout(project), key).precision == Precision.FP32  # what evaluate reads


@pytest.mark.slow  # trains three tiny models once (module fixture)
def test_missing_run_says_to_train_first(project):
    from pipeline.errors import DataError

    with pytest.raises(DataError, match="run the train stage"):
        evaluate_run(settings(project_params()), "s2sa", "chitchat", project)


@pytest.mark.slow
def test_several_seeds_mean_ci_and_mlflow(tmp_path, monkeypatch, project):
    """Two seeds, tracked: per-seed folders, metrics = mean with CI, rows per seed, and the
    metrics logged to each seed's training run."""
    root = tmp_path / "p"
    shutil.copytree(project / "data" / "shards", root / "data" / "shards")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    raw = project_params(tracking=True)
    raw["train"]["runs"][KEY]["overrides"] = {"seeds": 2}
    record = train_seeds(RunRequest.of(parse_params(raw), KEY), root, False)
    assert [s.seed for s in record.seeds] == [1234, 2234]
    assert record.seeds[1].checkpoint == f"data/train/{KEY}/seed-1/model.pt"

    metrics = evaluate_run(settings(raw), "transformer", "chitchat", root)
    per_seed = EvalRecord.read(Layout(root).eval_out(KEY) / SEEDS_FILE).seeds
    losses = [s.metrics["test_loss"] for s in per_seed]
    assert losses[0] != losses[1]
    assert metrics["test_loss"] == pytest.approx(np.mean(losses))
    assert metrics["test_loss_ci95"] == pytest.approx(12.7062047 * np.std(losses, ddof=1) / 2**0.5)
    rows = read_rows(root, KEY)
    assert len(rows) == 2 * metrics["n_examples"]
    assert {r.seed for r in rows} == {1234, 2234}
    client = mlflow.tracking.MlflowClient(uri)
    for entry, seed in zip(record.seeds, per_seed, strict=True):
        run = client.get_run(entry.mlflow.run_id)
        assert run.data.metrics["eval/test_loss"] == pytest.approx(seed.metrics["test_loss"])


@pytest.mark.slow  # trains three tiny models once (module fixture)
def test_progress_shows_batches_and_decodes_and_no_progress_is_silent(project, monkeypatch, capsys):
    import yaml

    from pipeline import progress
    from stages import evaluate as stage

    clock = [0.0]

    def now() -> float:  # 30 s between two looks at the clock: every batch is worth a line
        clock[0] += 30.0
        return clock[0]

    monkeypatch.setattr(progress, "now", now)
    raw = project_params(max_batches=2)
    evaluate_run(settings(raw), "transformer", "chitchat", project, progress=True)
    lines = capsys.readouterr().err.splitlines()  # captured: not a terminal, so lines
    label = "evaluate transformer-chitchat (seed 1234)"
    assert lines[0] == f"{label}: batch 0/2 (0%)"
    assert re.fullmatch(
        rf"{re.escape(label)}: batch 1/2 \(50%\), decoding beam3, [\d.]+ s/batch, ETA .+",
        lines[1],
    )
    assert lines[2].startswith(f"{label}: finished batch 2/2 (100%), decoding beam3 in ")
    assert len(lines) == 3

    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(project)
    assert stage.main(["transformer-chitchat", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert stage.main(["gpt-chitchat"]) == 0
    assert "evaluate gpt-chitchat (seed 1234): finished batch 2/2" in capsys.readouterr().err


@pytest.mark.slow  # trains three tiny models once (module fixture)
def test_unigram_baseline_scores_the_tokens_the_models_score(project):
    from pipeline.eval.unigram import unigram_score

    shards = project / "data" / "shards" / "chitchat"
    for model, task in (("transformer", "generate"), ("gpt", "lm")):
        evaluate_run(settings(project_params(max_batches=2)), model, "chitchat", project)
        rows = read_rows(project, f"{model}-chitchat")
        score = unigram_score(shards, task, [r.id for r in rows])
        assert score.n_examples == len(rows)
        assert score.n_tokens == sum(r.n_tokens for r in rows)
        assert math.isfinite(score.ppl) and score.ppl > 1


def test_evaluation_runs_at_the_precision_the_run_trained_at(tokenized, tmp_path, monkeypatch):
    """The train record's precision decides the evaluate stage's autocast: bf16 for a run
    trained in bf16 (on a CPU too), none for fp32 (on CUDA the stage ran bf16 whatever the
    run trained at)."""
    from pipeline.eval import stage

    # a project of its own: the gpt run it writes would replace the module project's
    root = tmp_path / "p"
    shutil.copytree(tokenized / "data" / "shards", root / "data" / "shards")

    seen: list[torch.dtype | None] = []
    load = stage.load_model

    def spied(path):
        model = load(path)
        for module in model.modules():  # evaluators call its methods, not forward
            module.register_forward_pre_hook(lambda *_: seen.append(_autocast_dtype()))
        return model

    monkeypatch.setattr(stage, "load_model", spied)
    torch.manual_seed(0)
    sizes = read_manifest(root / "data" / "shards" / "chitchat").data_sizes()
    model = registry.build("gpt", sizes, **MODELS["gpt"])
    raw = project_params(max_batches=1)
    for precision, dtype in ((Precision.BF16, torch.bfloat16), (Precision.FP32, None)):
        write_trained(root, "gpt", model, precision=precision)
        seen.clear()
        evaluate_run(settings(raw), "gpt", "chitchat", root)
        assert seen and set(seen) == {dtype}


def _autocast_dtype() -> torch.dtype | None:
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


@pytest.mark.slow  # trains three tiny models once (module fixture)
def test_a_test_batch_out_of_memory_is_evaluated_again_at_half_the_size(
    project, monkeypatch, capsys
):
    """An evaluation that runs out of memory is started over at half the batch, down to
    what fits, and a quick run's limit then covers the same examples: the same rows as
    evaluating at that size from the start."""
    from pipeline.eval.language import LMEvaluator

    evaluate = LMEvaluator.__call__

    def out_of_memory(self, model, dataset, bar, seed):
        if self.settings.batch_size > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return evaluate(self, model, dataset, bar, seed)

    key = "gpt-chitchat"
    expected = evaluate_run(settings(project_params(max_batches=4, batch_size=2)), "gpt",
                            "chitchat", project)  # fmt: skip
    rows = read_rows(project, key)
    monkeypatch.setattr(LMEvaluator, "__call__", out_of_memory)
    metrics = evaluate_run(settings(project_params(max_batches=1)), "gpt", "chitchat", project)
    assert "evaluation out of memory at batch 4: trying 2" in capsys.readouterr().err
    assert metrics == pytest.approx(expected) and metrics["n_examples"] == 8
    again = read_rows(project, key)
    assert [(r.id, r.n_tokens) for r in again] == [(r.id, r.n_tokens) for r in rows]
    assert [r.nll_sum for r in again] == pytest.approx([r.nll_sum for r in rows])
