"""A language-model split read as one text (``pipeline/data/streams.py``): training segments
that score every token once an epoch, context seen but never scored, the same segments
for the same (seed, epoch) (a resumed run), evaluation windows for streamed validation,
and the stored documents untouched where the options are off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import EvaluateParams, LMParams, RunParams, TokenizeParams
from pipeline.data.loader import BatchLoader, ExampleDataset, open_split
from pipeline.data.records import LMExample
from pipeline.data.shards import read_manifest
from pipeline.data.streams import (
    LMFeed,
    SegmentRule,
    StreamExamples,
    TextStream,
    segment_bounds,
    stream_key,
    window_bounds,
)
from pipeline.data.tokenize import tokenize_corpus
from pipeline.eval.language import LMEvaluator
from pipeline.execution import ExecutionPolicy
from pipeline.models import registry
from pipeline.names import Task
from pipeline.plan import RunPlan, RunRequest, checked, plan_training
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.job import ConfiguredModel, ShardBatches, ShardData, shard_data
from pipeline.train.loop import TrainJob, train_local

LM = {"tasks": ["lm"], "max_dialogues": 30, "vocab": {"size": 200}}
RULE = SegmentRule(target=12, context=7, jitter=2.0, short_fraction=0.2, minimum=3)
STREAM_VALIDATION = {"protocol": "stream", "context_tokens": 9, "stride_tokens": 4}


def tokenized(root: Path, **lm: object) -> Path:
    settings = {**LM, "lm": {"sentences_per_document": 3, **lm}}
    tokenize_corpus("chitchat", None, root, TokenizeParams(corpora={"chitchat": settings}))
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("streams")
    stream = {"target_tokens": 12, "context_tokens": 7, "target_sentences": 2}
    return {
        "documents": tokenized(base / "documents"),
        "stream": tokenized(
            base / "stream", layout="stream", stream=stream, validation=STREAM_VALIDATION
        ),
    }


def feed(folder: Path, unit: str = "tokens") -> LMFeed:
    """A language model of ``unit`` reading ``folder`` as the params it was tokenized with
    say."""
    return LMFeed(unit, read_manifest(folder).params.corpus.lm)  # type: ignore[arg-type,union-attr]


def scored_text(examples: list[LMExample]) -> list[int]:
    """The scored tokens of ``examples`` (each after its context), in order."""
    out: list[int] = []
    for e in examples:
        flat = np.concatenate(list(e.sentences)).tolist()
        assert e.context is not None and 0 <= e.context < len(flat)
        out += flat[e.context :]
    return out


def test_segments_cover_every_unit_once_in_order_after_their_context() -> None:
    for epoch in range(4):
        bounds = segment_bounds(500, RULE, seed=3, epoch=epoch)
        first, begin, end = bounds.T
        assert begin[0] == 0 and end[-1] == 500 and (begin[1:] == end[:-1]).all()
        assert (end > begin).all() and (end[1:-1] - begin[1:-1] >= RULE.minimum).all()
        assert (first == np.maximum(begin - RULE.context, 0)).all()
        assert 1 <= end[0] <= RULE.target  # the drawn offset
    assert segment_bounds(0, RULE, 0, 0).shape == (0, 3)


def test_segments_are_a_function_of_seed_and_epoch() -> None:
    once = segment_bounds(2000, RULE, seed=3, epoch=5)
    assert np.array_equal(once, segment_bounds(2000, RULE, seed=3, epoch=5))
    assert not np.array_equal(once, segment_bounds(2000, RULE, seed=3, epoch=6))
    assert not np.array_equal(once, segment_bounds(2000, RULE, seed=4, epoch=5))
    # the reference's lengths: near the target, a share of them (here 20%) half as long
    rule = SegmentRule(target=40, context=0, jitter=2.0, short_fraction=0.2)
    lengths = np.diff(segment_bounds(20_000, rule, 3, 5)[1:-1, 1:], axis=1).ravel()
    halves = np.abs(lengths - 20) <= 8
    assert 0.15 < halves.mean() < 0.25 and (np.abs(lengths[~halves] - 40) <= 8).all()
    assert abs(lengths[~halves].std() - 2.0) < 0.3


def test_windows_score_each_unit_once_by_hand() -> None:
    assert window_bounds(10, context=3, stride=4).tolist() == [[0, 0, 4], [1, 4, 8], [5, 8, 10]]
    with pytest.raises(ValueError, match="stride >= 1"):
        window_bounds(10, 3, 0)


def test_a_window_is_one_document_its_context_unscored() -> None:
    documents = [[np.array([5, 6, 3]), np.array([7, 3])], [np.array([8, 9, 3])]]
    stream = TextStream.of_documents(documents)
    assert stream.tokens.tolist() == [5, 6, 3, 7, 3, 8, 9, 3] and stream.starts.tolist() == [
        0,
        3,
        5,
        8,
    ]
    tokens = stream.example(np.array([1, 4, 7]), "tokens")
    assert [s.tolist() for s in tokens.sentences] == [[6, 3, 7, 3, 8, 9]] and tokens.context == 3
    sentences = stream.example(np.array([0, 1, 3]), "sentences")
    assert [s.tolist() for s in sentences.sentences] == [[5, 6, 3], [7, 3], [8, 9, 3]]
    assert sentences.context == 3 and sentences.turn == 1


def test_the_table_is_read_as_its_documents_in_order(folders: dict[str, Path]) -> None:
    table = open_split(folders["documents"], Task.LM, "train").table
    documents = [table[i].sentences for i in range(len(table))]
    assert np.array_equal(
        TextStream.of_table(table).tokens, TextStream.of_documents(documents).tokens
    )


@pytest.mark.parametrize("unit", ["tokens", "sentences"])
def test_an_epoch_scores_every_training_token_exactly_once(
    folders: dict[str, Path], unit: str
) -> None:
    dataset = open_split(folders["stream"], Task.LM, "train", feed(folders["stream"], unit))
    text = TextStream.of_table(dataset.table).tokens.tolist()
    loader = BatchLoader(dataset, 4, seed=2)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = loader.batches()
        # every segment once in the epoch's batches; in text order they score the text
        order = sorted(i for batch in batches for i in batch)
        assert order == list(range(len(dataset)))
        assert scored_text([dataset[i] for i in order]) == text
        scored = sum(
            int(loader.collate([dataset[i] for i in b]).scored_mask().sum()) for b in batches
        )
        assert scored == len(text)
    if unit == "sentences":  # whole sentences: each segment's rows are sentences
        assert all(s[-1] == 3 for i in range(len(dataset)) for s in dataset[i].sentences)


def test_same_seed_and_epoch_give_the_same_batches_and_resume_exactly(
    folders: dict[str, Path],
) -> None:
    def epoch_batches(epoch: int, seed: int = 5, start: int = 0) -> list:
        # a fresh dataset and loader each time: what a resumed process builds
        loader = BatchLoader(
            open_split(folders["stream"], Task.LM, "train", feed(folders["stream"])), 3, seed=seed
        )
        data = ShardBatches(loader)
        data.set_epoch(epoch)
        return [(b.flat_ids.tolist(), b.context_tokens.tolist()) for b in data.iter_from(start)]

    once = epoch_batches(1)
    assert once == epoch_batches(1) and once[4:] == epoch_batches(1, start=4)
    assert once != epoch_batches(2) and once != epoch_batches(1, seed=6)


def test_off_the_splits_are_the_stored_documents(folders: dict[str, Path]) -> None:
    for name, split in (("documents", "train"), ("documents", "valid"), ("stream", "test")):
        dataset = open_split(folders[name], Task.LM, split, feed(folders[name]))
        assert dataset.stream is None and len(dataset) == len(dataset.table)
        assert dataset[0].context is None
    # without a feed (every reader but a language model's training) nothing changes
    assert open_split(folders["stream"], Task.LM, "train").stream is None


def test_streamed_validation_is_the_evaluate_stage_s_protocol_on_the_valid_split(
    folders: dict[str, Path],
) -> None:
    root = folders["stream"]
    torch.manual_seed(0)
    config = registry.make_config("gpt", open_split(root, Task.LM, "train").manifest.data_sizes(),
                                  d_model=16, n_heads=2, n_layers=1, d_ff=32)  # fmt: skip
    model = registry.build_from_config("gpt", config).eval()
    data = ShardData(str(root), Task.LM, batch_size=4, eval_batch_size=5, seed=0, feed=feed(root))
    valid = data(0, 1)[1]
    valid.set_epoch(0)
    nll = n = 0.0
    with torch.no_grad():
        for batch in valid.iter_from(0):  # what the training loop sums
            out = model.loss(batch)
            nll, n = nll + float(out.nll_sum), n + float(out.n_tokens)
    documents = ExampleDataset(root, Task.LM, "valid")
    settings = EvaluateParams(batch_size=7, lm=STREAM_VALIDATION)
    test = LMEvaluator(settings, ExecutionPolicy(torch.device("cpu")))(
        model, documents, None, 0
    ).metrics
    assert n == documents.manifest.target_tokens["lm"]["valid"]
    assert nll / n == pytest.approx(test["test_loss"], rel=1e-5)


def test_stream_examples_validate_their_unit() -> None:
    with pytest.raises(ValueError, match="tokens or sentences"):
        StreamExamples(TextStream.of_documents([]), "words")  # type: ignore[arg-type]


def gpt_plan(root: Path, **lm: object) -> RunPlan:
    """The plan of run ``gpt-chitchat`` on the shards under ``root``, its params'
    ``tokenize.corpora.chitchat.lm`` set to ``lm``."""
    settings = {**LM, "lm": {"sentences_per_document": 3, **lm}}
    params = checked(
        {"corpora": ["chitchat"], "tokenize": {"corpora": {"chitchat": settings}},
         "train": {"runs": {"gpt-chitchat": {"model": "gpt", "corpus": "chitchat"}}},
         "evaluate": {"corpora": {"chitchat": {"lm": settings["lm"].get("validation", {})}}}}
    )  # fmt: skip
    return plan_training(RunRequest.of(params, "gpt-chitchat"), root)


@pytest.fixture
def documents_project(folders: dict[str, Path], tmp_path: Path) -> Path:
    """A project whose chitchat shards were tokenized with the documents settings."""
    (tmp_path / "data" / "shards").mkdir(parents=True)
    (tmp_path / "data" / "shards" / "chitchat").symlink_to(folders["documents"].resolve())
    return tmp_path


def test_another_feeding_is_another_run(documents_project: Path) -> None:
    """The shards are the same documents either way: the run's data identity says how
    they are read, so a stream run never resumes a documents run's checkpoint."""
    documents = gpt_plan(documents_project).data
    stream = {"layout": "stream", "validation": STREAM_VALIDATION}
    streamed = gpt_plan(documents_project, **stream)
    assert stream_key(streamed.corpus_params.lm) != "" == stream_key(LMParams())
    assert streamed.data == documents + stream_key(streamed.corpus_params.lm)
    assert "+stream:" in streamed.data and "+valid:" in streamed.data


def test_a_stage_reads_its_splits_as_its_params_say_not_as_the_shards_were_built(
    documents_project: Path,
) -> None:
    """A stage called with ``--params FILE`` feeds its model as that file says, as ``dvc
    repro`` with it would (there the tokenize stage reruns and its manifest agrees): the
    shards were built with the documents settings, the params ask for stream training and
    streamed validation, and that is what the run trains on, selects on and is named by."""
    assert read_manifest(documents_project / "data/shards/chitchat").params.corpus.lm == LMParams(
        sentences_per_document=3
    )  # type: ignore[union-attr]
    plan = gpt_plan(documents_project, layout="stream", validation=STREAM_VALIDATION)
    train, valid = shard_data(plan)(0, 1)
    assert train.loader.dataset.stream is not None and train.loader.dataset.stream.by_epoch
    windows = valid.loader.dataset.stream
    assert windows is not None and not windows.by_epoch  # the evaluate protocol's windows
    assert "+valid:" in plan.data
    plain_train, plain_valid = shard_data(gpt_plan(documents_project))(0, 1)
    assert plain_train.loader.dataset.stream is None is plain_valid.loader.dataset.stream


class _KillAt:
    """A metric sink that stops the run after training step ``at`` (an in-process kill)."""

    recording = True

    def __init__(self, at: int | None) -> None:
        self.at = at

    def __call__(self) -> _KillAt:
        return self

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.at is not None and step >= self.at and "train_loss" in metrics:
            raise KeyboardInterrupt(f"killed at step {step}")


def test_a_run_killed_mid_epoch_resumes_to_the_uninterrupted_weights(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    root = folders["stream"]
    knobs = RunParams.model_validate(
        {"epochs": 2, "batch_size": 3, "max_batches_per_epoch": 4, "patience": None,
         "checkpoint_every": 2, "log_every": 1, "seed": 1, "optimizer": {"lr": 0.003}}
    )  # fmt: skip
    sizes = read_manifest(root).data_sizes()
    tiny = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.3}
    model = ConfiguredModel(sizes)("gpt", knobs.model_copy(update={"model": tiny}))
    data = ShardData(str(root), Task.LM, batch_size=3, eval_batch_size=4, seed=1, feed=feed(root))

    def job(folder: str, at: int | None = None) -> TrainJob:
        return TrainJob(
            "gpt", "gpt", model, data, knobs, str(tmp_path / folder), _KillAt(at), False
        )

    full = train_local(job("a"))
    with pytest.raises(KeyboardInterrupt):
        train_local(job("b", at=3))  # resumed from step 2's checkpoint, mid-epoch
    assert train_local(job("b")) == full
    weights = [TrainingState.read(tmp_path / f / "gpt" / CHECKPOINT_FILE).model for f in "ab"]
    assert all(torch.equal(v, weights[1][k]) for k, v in weights[0].items())
