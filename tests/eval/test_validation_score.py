"""The HT-Encoder authors' selection criterion on real MultiWOZ validation dialogues:
``BLEU + 0.5 * (Inform + Success)``, its rank split, and a run selected on it."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.artifacts import SavedModel
from pipeline.config import Precision, parse_params
from pipeline.data.loader import load_vocab, open_split
from pipeline.data.shards import read_manifest
from pipeline.data.splits import Split
from pipeline.data.tokenize import tokenize_corpus
from pipeline.eval.collect import example_id
from pipeline.eval.validation_score import MultiWozValidationScore, RankingValidationScore
from pipeline.execution import Evaluation, ExecutionPolicy
from pipeline.models import registry
from pipeline.plan import RunRequest, checked, plan_training
from tests.gloo import gloo_group, run_ranks

TOKENIZE = {  # delexicalised, as the HT-Encoder paper trains
    "corpora": {
        "multiwoz": {
            "tasks": ["generate"],
            "vocab": {"size": 1500},
            "generate": {"delexicalize": True},
        }
    }
}
TINY_HIER = {
    "d_model": 16,
    "d_ff": 16,
    "n_heads": 2,
    "n_utterance_layers": 1,
    "n_context_layers": 1,
    "n_decoder_layers": 1,
}
CPU = torch.device("cpu")


def _dialogues(shared: Path, part: str, n: int, skip: int = 0) -> dict:
    with zipfile.ZipFile(shared / "multiwoz" / "convlab1" / f"{part}.json.zip") as zf:
        dialogues = json.loads(zf.read(f"{part}.json"))
    return dict(list(dialogues.items())[skip : skip + n])


@pytest.fixture(scope="module")
def project(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``data/raw/multiwoz`` (6 validation dialogues, the database) and its shards."""
    root = tmp_path_factory.mktemp("multiwoz-project")
    raw = root / "data" / "raw" / "multiwoz"
    raw.mkdir(parents=True)
    parts = {
        "train": _dialogues(shared_data, "val", 30, skip=6),
        "val": _dialogues(shared_data, "val", 6),
        "test": _dialogues(shared_data, "test", 3),
    }
    for name, dialogues in parts.items():
        (raw / f"{name}.json").write_text(json.dumps(dialogues))
    shutil.copytree(shared_data / "multiwoz" / "db", raw / "db")
    params = parse_params({"tokenize": TOKENIZE, "corpora": ["multiwoz"]})
    tokenize_corpus("multiwoz", raw, root / "data" / "shards" / "multiwoz", params, False)
    return root


def scorer(project: Path) -> MultiWozValidationScore:
    params = parse_params({"tokenize": TOKENIZE, "corpora": ["multiwoz"]})
    return MultiWozValidationScore(
        shards=str(project / "data" / "shards" / "multiwoz"),
        raw=str(project / "data" / "raw" / "multiwoz"),
        corpus="multiwoz",
        corpus_params=params.corpus("multiwoz"),
    )


def on_cpu(batch_size: int, precision: Precision = Precision.AUTO) -> Evaluation:
    """The loop's evaluation on a CPU: ``batch_size`` examples a batch, ``precision``'s
    autocast."""
    return ExecutionPolicy.for_evaluation(precision, CPU).evaluation(batch_size)


def _references(project: Path) -> list[tuple[str, str, str]]:
    shards = project / "data" / "shards" / "multiwoz"
    dataset, vocab = open_split(shards, "generate", Split.VALID), load_vocab(shards)
    examples = [dataset[i] for i in range(len(dataset))]
    return [
        (example_id(e), vocab.decode(e.target_ids), vocab.decode(e.target_ids)) for e in examples
    ]


def test_the_references_score_bleu_100_plus_half_their_rates_and_silence_scores_0(project):
    score = scorer(project)
    gold = _references(project)
    assert len({i for i, _, _ in gold}) == len(gold) > 20
    perfect = score.score(gold)
    assert perfect["valid_bleu_hier"] == pytest.approx(100.0)
    # the delexicalised references inform and succeed on most of these dialogues
    assert 50.0 <= perfect["valid_inform"] <= 100.0
    assert perfect["valid_score"] == pytest.approx(
        100.0 + 0.5 * (perfect["valid_inform"] + perfect["valid_success"])
    )
    silent = score.score([(i, "", ref) for i, _, ref in gold])
    # (BLEU is not exactly 0: the authors' convention wraps every text in GO_ ... EOS_; a
    # dialogue whose goal names no venue informs without a word, as the official scheme has)
    assert silent["valid_bleu_hier"] < 1e-6
    assert silent["valid_inform"] < perfect["valid_inform"]
    assert silent["valid_success"] < perfect["valid_success"]
    assert silent["valid_score"] == pytest.approx(
        0.5 * (silent["valid_inform"] + silent["valid_success"]), abs=1e-6
    )
    # rows come from ranks in any order
    assert score.score(gold[::-1]) == perfect


def test_ranks_decode_disjoint_shares_of_the_whole_split(project):
    torch.manual_seed(0)
    shards = project / "data" / "shards" / "multiwoz"
    valid = open_split(shards, "generate", Split.VALID)
    model = registry.build("hier", read_manifest(shards).data_sizes(), **TINY_HIER).eval()
    score = scorer(project)
    whole = score.decode(model, 0, 1, on_cpu(4))
    assert [i for i, _, _ in whole] == [example_id(valid[i]) for i in range(len(valid))]
    shares = [score.decode(model, rank, 2, on_cpu(4)) for rank in (0, 1)]
    assert sorted(shares[0] + shares[1]) == sorted(whole)
    assert not {row[0] for row in shares[0]} & {row[0] for row in shares[1]}
    assert 0.0 <= score.score(whole)["valid_score"] <= 300.0
    # the loaded split and dialogues stay behind when a job ships to Ray workers
    shipped = pickle.loads(pickle.dumps(score))
    assert "_data" not in shipped.__dict__ and "_dialogues" not in shipped.__dict__
    assert shipped.decode(model, 0, 1, on_cpu(4)) == whole


def test_the_score_decodes_under_the_runs_precision(project, monkeypatch):
    """A run trained in bf16 is scored under bf16 autocast, one in fp32 without (the
    score decoded without autocast whatever the run's precision)."""
    import pipeline.decode

    torch.manual_seed(0)
    shards = project / "data" / "shards" / "multiwoz"
    model = registry.build("hier", read_manifest(shards).data_sizes(), **TINY_HIER).eval()
    seen: list[torch.dtype | None] = []
    original = pipeline.decode.generate

    def spy(model, batch, config):
        cast = torch.is_autocast_enabled("cpu")
        seen.append(torch.get_autocast_dtype("cpu") if cast else None)
        return original(model, batch, config)

    monkeypatch.setattr(pipeline.decode, "generate", spy)
    score = scorer(project)
    for precision, dtype in ((Precision.BF16, torch.bfloat16), (Precision.FP32, None)):
        seen.clear()
        score.decode(model, 0, 1, on_cpu(64, precision))
        assert seen and set(seen) == {dtype}


@pytest.mark.slow
def test_a_run_selected_on_the_score_records_it(project, tmp_path):
    from pipeline.train.job import validation_score
    from pipeline.train.training import train_plan

    root = tmp_path / "p"
    shutil.copytree(project / "data", root / "data")
    params = checked(
        {
            "corpora": ["multiwoz"],
            "tokenize": TOKENIZE,
            "train": {
                "defaults": {
                    "epochs": 2,
                    "batch_size": 8,
                    "max_batches_per_epoch": 2,
                    "patience": None,
                    "select_by": "multiwoz_score",
                },
                "models": {"hier": {"model": TINY_HIER}},
                "runs": {"hier-multiwoz": {"model": "hier", "corpus": "multiwoz"}},
            },
            "tracking": {"enabled": False},
        }
    )
    plan = plan_training(RunRequest.of(params, "hier-multiwoz"), root)
    # the job scores the plan's validation split against its raw dialogues
    assert validation_score(plan) == scorer(root)
    seed = train_plan(plan, show_progress=False)
    assert seed.metrics["best_step"] in (2.0, 4.0) and seed.metrics["steps"] == 4.0
    assert 0.0 <= seed.metrics["best_valid_score"] <= 300.0
    exported = SavedModel.read(plan.model_file)
    assert exported.metrics["best_valid_score"] == seed.metrics["best_valid_score"]


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_a_search_on_the_score_records_its_best_trials_score(
    project, tmp_path, capsys, on_ray_head
):
    from pipeline.train.tuning import tune_run

    root = tmp_path / "p"
    shutil.copytree(project / "data", root / "data")
    heads = {"kind": "int", "low": 1, "high": 2}
    params = checked(
        {
            "corpora": ["multiwoz"],
            "tokenize": TOKENIZE,
            "train": {
                "defaults": {"batch_size": 8, "max_batches_per_epoch": 2},
                "models": {"hier": {"select_by": "multiwoz_score", "model": TINY_HIER}},
                "scale": {"num_workers": 0},
            },
            "tune": {
                "trials": 2,
                "epochs_per_trial": 2,
                "runs": {"hier-multiwoz": {"model": "hier", "corpus": "multiwoz"}},
                "spaces": {"hier": {"model": {"n_heads": heads}, "per_head": {"d_model": heads}}},
            },
            "tracking": {"enabled": False},
        }
    )
    best = tune_run(RunRequest.of(params, "hier-multiwoz", search=True), root)
    trial = re.compile(r"tune hier-multiwoz: trial \d/2 \w+ (finished|stopped early by ASHA) ")
    lines = [line for line in capsys.readouterr().err.splitlines() if trial.match(line)]
    scores = [float(line.split("valid score ")[1].split()[0]) for line in lines]
    assert len(scores) == 2 and best.valid_score == pytest.approx(max(scores), abs=5e-3)
    # the record holds the trial's widths: the sampled size per head times its heads
    assert best.config["d_model"] % best.config["n_heads"] == 0 and "per_head" not in best.config


# --------------------------------------------------------------------------- ranking (mrr)


class _Oracle(torch.nn.Module):
    """Scores each candidate by its label times ``sign``: +1 ranks the true response
    first; -1 ranks it last among the example's real candidates."""

    def __init__(self, sign: float) -> None:
        super().__init__()
        self.sign = sign

    def score(self, batch):
        return self.sign * batch.labels.float()


def test_the_ranking_score_is_the_mrr_and_recalls_of_the_ranks() -> None:
    """Hand-computed: ranks 1, 2, 5, 20 have MRR (1 + 1/2 + 1/5 + 1/20) / 4 = 0.4375,
    R@1 1/4, R@10 3/4; the order the ranks come in (from several ranks) does not count."""
    score = RankingValidationScore(shards="never-opened")
    ranked = [("d#3", 20), ("a#1", 1), ("b#2", 2), ("c#1", 5)]
    got = score.score(ranked)
    assert got == {
        "valid_score": pytest.approx(0.4375),
        "valid_mrr": pytest.approx(0.4375),
        "valid_recall_at_1": pytest.approx(0.25),
        "valid_recall_at_10": pytest.approx(0.75),
    }
    assert score.score(ranked[::-1]) == got


def test_the_ranking_score_ranks_the_valid_splits_candidates_in_shares(tokenized_tiny) -> None:
    """On the tiny project's select valid split (10 candidates an example, as its test
    split): the true response scored highest ranks 1 for every example; scored lowest, it
    ranks after every other real candidate; two ranks score disjoint halves of the whole."""
    shards = tokenized_tiny / "data" / "shards" / "chitchat"
    valid = open_split(shards, "select", Split.VALID)
    score = RankingValidationScore(shards=str(shards))
    best = score.decode(_Oracle(1.0), 0, 1, on_cpu(4))
    assert [i for i, _ in best] == [example_id(valid[i]) for i in range(len(valid))]
    assert {r for _, r in best} == {1} and score.score(best)["valid_score"] == 1.0
    worst = dict(score.decode(_Oracle(-1.0), 0, 1, on_cpu(4)))
    n_real = {example_id(e): len(e.candidate_ids) for e in (valid[i] for i in range(len(valid)))}
    assert worst == n_real and set(worst.values()) == {10}
    assert score.score(list(worst.items()))["valid_mrr"] == pytest.approx(0.1)
    shares = [score.decode(_Oracle(-1.0), rank, 2, on_cpu(4)) for rank in (0, 1)]
    assert sorted(shares[0] + shares[1]) == sorted(worst.items())
    assert not {i for i, _ in shares[0]} & {i for i, _ in shares[1]}
    # the loaded split stays behind when a job ships to Ray workers
    shipped = pickle.loads(pickle.dumps(score))
    assert "_data" not in shipped.__dict__
    assert dict(shipped.decode(_Oracle(-1.0), 0, 1, on_cpu(4))) == worst


@pytest.mark.slow
def test_a_ranker_selected_on_the_mrr_keeps_its_best_validation(tokenized_tiny, tmp_path):
    """A tiny ranker trained with ``select_by: mrr``: its exported weights score the
    recorded ``best_valid_score`` on the validation split again, and no worse than its
    final weights."""
    from pipeline.models.saved import load_model
    from pipeline.train.checkpoint import TrainingState
    from pipeline.train.job import validation_score
    from pipeline.train.training import train_plan

    root = tmp_path / "p"
    shutil.copytree(tokenized_tiny / "data" / "shards", root / "data" / "shards")
    raw = yaml.safe_load((tokenized_tiny / "params.yaml").read_text())
    raw["train"]["models"]["transformer_ranker"]["select_by"] = "mrr"
    raw["train"]["runs"] = {
        "transformer_ranker-chitchat": {"model": "transformer_ranker", "corpus": "chitchat"}
    }
    raw["tracking"] = {"enabled": False}
    plan = plan_training(RunRequest.of(checked(raw), "transformer_ranker-chitchat"), root)
    score = validation_score(plan)
    assert score == RankingValidationScore(shards=str(plan.shards))
    seed = train_plan(plan, show_progress=False)
    best = seed.metrics["best_valid_score"]
    assert seed.metrics["best_step"] in (2.0, 4.0) and 0.0 < best <= 1.0
    evaluation = ExecutionPolicy.for_evaluation(Precision.AUTO, CPU).evaluation(
        plan.knobs.validation_batch_size, plan.knobs.validation_limit
    )
    kept = load_model(plan.model_file).eval()
    assert score.score(score.decode(kept, 0, 1, evaluation))["valid_score"] == best
    kept.load_state_dict(TrainingState.read(root / seed.run_checkpoint).model)
    assert score.score(score.decode(kept, 0, 1, evaluation))["valid_score"] <= best


class _CountingOracle(_Oracle):
    """``_Oracle(1.0)`` that records the number of examples of every batch it scores."""

    def __init__(self) -> None:
        super().__init__(1.0)
        self.sizes: list[int] = []

    def score(self, batch):
        self.sizes.append(len(batch.labels))
        return super().score(batch)


def _scoring_rank(rank: int, folder: Path, shards: str, size: int) -> None:
    """One rank of a 2-process gloo group scoring the validation split at ``size`` global
    examples a batch, the ranks agreeing on it; its batch sizes and ranked ids go to
    ``<folder>/rank<r>.pt``."""
    with gloo_group(rank, 2, folder) as ranks:
        evaluation = ExecutionPolicy(device=CPU, world_size=2).evaluation(size, ranks=ranks)
        model = _CountingOracle()
        ranked = RankingValidationScore(shards=shards).decode(model, rank, 2, evaluation)
        torch.save({"sizes": model.sizes, "ids": [i for i, _ in ranked]}, folder / f"rank{rank}.pt")


@pytest.mark.slow
def test_each_of_two_ranks_decodes_its_devices_share_of_a_global_batch(
    tokenized_tiny, tmp_path
) -> None:
    """Two gloo processes score the validation split at 4 examples a (global) batch: each
    device decodes batches of 2 (its share), never the whole global batch, and together
    they rank every example once."""
    shards = tokenized_tiny / "data" / "shards" / "chitchat"
    n = len(open_split(shards, "select", Split.VALID))
    run_ranks(_scoring_rank, (tmp_path, str(shards), 4))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:
        assert got["sizes"] and max(got["sizes"]) == 2
    assert sum(sum(got["sizes"]) for got in ranks) == n
    ids = ranks[0]["ids"] + ranks[1]["ids"]
    assert len(ids) == len(set(ids)) == n
