"""``train.<...>.word_vectors``: checked before compute, loaded into a fresh run's token
embeddings before its first step, logged, and never read again on resume."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import pytest
import torch

from pipeline.config import Params
from pipeline.data.loader import load_vocab
from pipeline.errors import ConfigError
from pipeline.models.word_vectors import token_embeddings
from pipeline.plan import RunRequest, checked, plan_training
from pipeline.train import loop, training
from pipeline.train.training import train_plan
from tests.train.conftest import TINY_TRANSFORMER, stage_params

DIM = TINY_TRANSFORMER["d_model"]  # the transformer's token embedding size
KEY = "transformer-chitchat"


def write_vectors(path: Path, words: list[str], dim: int) -> dict[str, list[float]]:
    """A .vec file (header, then rows) of ``words`` plus two words of no vocabulary."""
    values = {
        w: [round((i + 1) * 0.01 * (-1) ** j + j * 0.1, 4) for j in range(dim)]
        for i, w in enumerate(words)
    }
    rows = [*values.items(), ("qqqx", [1.0] * dim), ("zzzy", [2.0] * dim)]
    lines = [f"{len(rows)} {dim}"] + [f"{w} {' '.join(map(str, v))} " for w, v in rows]
    path.write_text("\n".join(lines) + "\n")
    return values


@pytest.fixture
def own(project, tmp_path) -> Path:
    root = tmp_path / "project"
    shutil.copytree(project / "data" / "shards", root / "data" / "shards")
    return root


def vector_params(path: Path, **tracking) -> dict:
    raw = stage_params(tracking={"log_model": False, "sample_generations": 0, **tracking})
    raw["train"]["defaults"] |= {"epochs": 1, "max_batches_per_epoch": 2}
    raw["train"]["models"]["transformer"]["word_vectors"] = str(path)
    return raw


def train_run(params: Params, root: Path):
    """The train stage's training of the run's (only) seed."""
    return train_plan(plan_training(RunRequest.of(params, KEY), root), show_progress=False)


def test_a_missing_vectors_file_is_a_params_error_naming_the_key(tmp_path):
    raw = vector_params(tmp_path / "missing.vec")
    with pytest.raises(ConfigError) as caught:
        checked(raw)
    assert caught.value.key == "train.models.transformer.word_vectors"
    assert "no such file" in caught.value.reason and "missing.vec" in caught.value.reason

    raw = stage_params()
    raw["train"]["runs"]["transformer-chitchat"]["overrides"] = {"word_vectors": "nope.vec"}
    with pytest.raises(ConfigError) as caught:
        checked(raw)
    assert caught.value.key == "train.runs.transformer-chitchat.overrides.word_vectors"
    assert "relative to" in caught.value.reason

    (tmp_path / "there.vec").write_text("a 1\n")
    params = checked(vector_params(tmp_path / "there.vec"))
    assert RunRequest.of(params, KEY).knobs.word_vectors == str(tmp_path / "there.vec")
    assert RunRequest.of(checked(stage_params()), KEY).knobs.word_vectors is None


def test_the_plan_reads_a_relative_path_from_the_project_root(own, monkeypatch):
    write_vectors(own / "vectors.vec", ["hello"], DIM)
    monkeypatch.chdir(own)  # where stages run, and the check looks
    params = checked(vector_params(Path("vectors.vec")))
    monkeypatch.chdir(own.parent)
    plan = plan_training(RunRequest.of(params, KEY), own)
    assert plan.word_vectors == own.resolve() / "vectors.vec"
    # gone by the time the stage plans: the same error, naming the key
    (own / "vectors.vec").unlink()
    with pytest.raises(ConfigError, match="no such file") as caught:
        plan_training(RunRequest.of(params, KEY), own)
    assert caught.value.key == "train.models.transformer.word_vectors"


def test_another_vectors_file_at_the_same_path_is_another_run(own):
    path = own / "vectors.vec"
    write_vectors(path, ["hello", "there"], DIM)
    params = checked(vector_params(path))
    name = plan_training(RunRequest.of(params, KEY), own).name
    assert plan_training(RunRequest.of(params, KEY), own).name == name
    write_vectors(path, ["hello", "there", "again"], DIM)  # another size: read afresh
    assert plan_training(RunRequest.of(params, KEY), own).name != name
    without = plan_training(RunRequest.of(checked(stage_params()), KEY), own)
    assert without.word_vectors is None and without.name != name


def test_a_file_of_another_dimension_fails_before_training(own, monkeypatch):
    vocab = load_vocab(own / "data" / "shards" / "chitchat")
    write_vectors(own / "small.vec", list(vocab.tokens[5:9]), DIM // 2)
    monkeypatch.setattr(training, "fit", lambda *a: pytest.fail("trained"))
    params = checked(vector_params(own / "small.vec", enabled=False))
    with pytest.raises(ConfigError) as caught:
        train_run(params, own)
    assert caught.value.key == "train.models.transformer.model.d_model"
    assert f"have {DIM // 2} dimensions" in caught.value.reason
    assert f"has {DIM}" in caught.value.reason


def test_a_fresh_run_starts_from_the_vectors_and_a_resumed_one_does_not_reload(own, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{own / 'mlflow.db'}")
    vocab = load_vocab(own / "data" / "shards" / "chitchat")
    words = list(vocab.tokens[5:25])  # 20 words of the vocabulary
    values = write_vectors(own / "vectors.vec", words, DIM)
    ids = torch.tensor([vocab.id(w) for w in words])
    file_rows = torch.tensor([values[w] for w in words])

    reads, first = [], []
    real_read, real_step = training.read_word_vectors, loop._Run.train_step
    monkeypatch.setattr(
        training, "read_word_vectors", lambda *a, **k: reads.append(1) or real_read(*a, **k)
    )

    def spy_step(self, batch):
        if not first:  # the embeddings the first optimizer step starts from
            first.append(token_embeddings(self.raw)[0].weight.detach().cpu().clone())
        return real_step(self, batch)

    monkeypatch.setattr(loop._Run, "train_step", spy_step)
    params = checked(vector_params(own / "vectors.vec"))
    seed = train_run(params, own)
    assert len(reads) == 1 and len(first) == 1
    weight = first[0]
    # the file's rows times one positive factor, which brings them to the scale of the
    # rows as initialised (std d**-0.5)
    factor = weight[ids[0], 0] / file_rows[0, 0]
    assert factor > 0
    assert torch.allclose(weight[ids], file_rows * factor, atol=1e-6)
    assert weight[ids].pow(2).mean().sqrt().item() == pytest.approx(DIM**-0.5, rel=0.1)
    assert not weight[0].any()  # <pad>
    others = torch.ones(len(vocab), dtype=torch.bool)
    others[ids] = False
    others[0] = False
    assert weight[others].pow(2).mean().sqrt().item() == pytest.approx(DIM**-0.5, rel=0.1)

    # the coverage is in the run's params and metrics
    run = mlflow.tracking.MlflowClient(f"sqlite:///{own / 'mlflow.db'}").get_run(seed.mlflow.run_id)
    assert run.data.params["word_vectors.found"] == "20"
    assert run.data.params["word_vectors.types"] == str(len(vocab) - 1)
    assert run.data.params["word_vectors.file_words"] == "22"
    assert run.data.metrics["word_vectors_fraction"] == pytest.approx(20 / (len(vocab) - 1))
    assert run.data.params["train.word_vectors"] == str(own / "vectors.vec")

    # the same params again resume the finished run: the file is not read again
    again = train_run(params, own)
    assert again.run_name == seed.run_name and len(reads) == 1 and len(first) == 1

    # without the param the same run trains from random embeddings (another run)
    plain = checked(stage_params(train={"defaults": params.train.defaults.model_dump()}))
    first.clear()
    other = train_run(plain, own)
    assert other.run_name != seed.run_name and len(reads) == 1
    assert not torch.allclose(first[0][ids], file_rows * factor)
