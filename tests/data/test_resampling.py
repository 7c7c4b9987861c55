"""Per-epoch draws of training select examples (``pipeline/data/resample.py``): fresh
negatives every epoch, the HRT authors' context augmentation, resume-exact batches, and
nothing changed with the options off or on the evaluation splits."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from pipeline.config import RunParams, SelectParams, TokenizeParams, parse_params
from pipeline.data.loader import BatchLoader, ExampleDataset, collate, open_split
from pipeline.data.records import Rows, SelectExample
from pipeline.data.resample import draws_key
from pipeline.data.shards import read_manifest
from pipeline.data.special import EOS_ID, SPEAKER_OTHER, SPEAKER_SELF
from pipeline.data.tokenize import tokenize_corpus
from pipeline.names import Task
from pipeline.plan import RunPlan, RunRequest, plan_training
from pipeline.train.job import ConfiguredModel, ShardBatches, ShardData
from pipeline.train.loop import TrainJob, train_local
from tests.data.equality import examples_equal

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
N_TRAIN = 4
MAX_CANDIDATE = 30
CHITCHAT = {
    "tasks": ["select"],
    "max_dialogues": 25,
    "vocab": {"size": 300},
    "generate": {"max_history": 60, "max_utterances": 5},
    "select": {"n_candidates_train": N_TRAIN, "n_candidates_eval": 12},
}
MIN_UTTERANCES = 2
RUN = "hrt_last-chitchat"


def tokenized(root: Path, corpus: str, settings: dict, raw: Path | None = None) -> Path:
    params = TokenizeParams.model_validate({"corpora": {corpus: settings}})
    tokenize_corpus(corpus, raw, root, params)
    return root


def with_select(settings: dict, **select: object) -> dict:
    return {**settings, "select": {**settings["select"], **select}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """chitchat tokenized with the draws off, on, and on with augmentation."""
    base = tmp_path_factory.mktemp("resampling")
    return {
        "off": tokenized(base / "off", "chitchat", CHITCHAT),
        "on": tokenized(base / "on", "chitchat", with_select(CHITCHAT, resample_negatives=True)),
        "augment": tokenized(
            base / "augment",
            "chitchat",
            with_select(CHITCHAT, resample_negatives=True, augment_min_utterances=MIN_UTTERANCES),
        ),
    }


def planned(folder: Path, projects: Path) -> RunPlan:
    """The train stage's plan of an ``hrt_last`` run on the tokenized ``folder`` (as the
    chitchat shards of a project of its own): the same params for every folder."""
    root = projects / folder.name
    (root / "data" / "shards").mkdir(parents=True)
    (root / "data" / "shards" / "chitchat").symlink_to(folder.resolve())
    params = parse_params(
        {
            "tokenize": {"corpora": {"chitchat": CHITCHAT}},
            "train": {"runs": {RUN: {"model": "hrt_last", "corpus": "chitchat"}}},
        }
    )
    return plan_training(RunRequest.of(params, RUN), root)


def text(a: np.ndarray) -> tuple[int, ...]:
    return tuple(np.asarray(a).tolist())


def at_epoch(dataset: ExampleDataset, epoch: int, seed: int = 5) -> list[SelectExample]:
    dataset.set_epoch(epoch, seed)
    return [dataset[i] for i in range(len(dataset))]  # type: ignore[misc]


def negatives(e: SelectExample) -> list[tuple[int, ...]]:
    return [text(c) for c, y in zip(e.candidate_ids, e.labels, strict=True) if not y]


def flat(value: object) -> list:
    """A batch's tensors and values, nested dataclasses (its ``History``) opened."""
    if dataclasses.is_dataclass(value):
        return [x for f in dataclasses.fields(value) for x in flat(getattr(value, f.name))]
    return [value]


def batches_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        all(
            torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            for x, y in zip(flat(p), flat(q), strict=True)
        )
        for p, q in zip(a, b, strict=True)
    )


def changed(a: list[SelectExample], b: list[SelectExample]) -> list[bool]:
    """Per example, whether its negatives differ (as sets of texts)."""
    return [set(negatives(x)) != set(negatives(y)) for x, y in zip(a, b, strict=True)]


# --------------------------------------------------------------------------- params


def test_augmentation_needs_the_draws_and_defaults_are_off() -> None:
    assert not SelectParams().resample_negatives and SelectParams().augment_min_utterances is None
    with pytest.raises(ValidationError, match="resample_negatives"):
        SelectParams(augment_min_utterances=2)
    with pytest.raises(ValidationError):
        SelectParams(resample_negatives=True, augment_min_utterances=0)


# --------------------------------------------------------------------------- off


def test_off_the_examples_and_batches_are_the_stored_ones(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    dataset = open_split(folders["off"], Task.SELECT, "train")
    assert dataset.draws is None
    loader = BatchLoader(dataset, 5, seed=5)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        stored = [collate([dataset.table[i] for i in rows]) for rows in loader.batches()]
        assert batches_equal(list(loader), stored)
    # The option changes nothing tokenize writes for sampled candidates: only the loader.
    for path in sorted((folders["off"] / "select").glob("*.arrow")):
        assert path.read_bytes() == (folders["on"] / "select" / path.name).read_bytes()
    # Run names of folders without the draws are what they were; with them they differ.
    assert draws_key(read_manifest(folders["off"])) == ""
    plans = {name: planned(folder, tmp_path) for name, folder in folders.items()}
    assert plans["off"].data == read_manifest(folders["off"]).fingerprint()
    assert plans["on"].data != plans["off"].data and plans["on"].name != plans["off"].name
    assert plans["augment"].data != plans["on"].data
    assert plans["augment"].name != plans["on"].name


def test_validation_and_test_candidates_stay_fixed(folders: dict[str, Path]) -> None:
    for split in ("valid", "test"):
        for name in ("on", "augment"):
            drawn = open_split(folders[name], Task.SELECT, split)
            stored = open_split(folders["off"], Task.SELECT, split)
            assert drawn.draws is None
            for epoch in (0, 3):
                got, want = at_epoch(drawn, epoch), at_epoch(stored, 0)
                assert all(examples_equal(a, b) for a, b in zip(got, want, strict=True))
    generate = tokenized(
        folders["on"].parent / "generate", "chitchat", {**with_select(CHITCHAT,
        resample_negatives=True), "tasks": ["generate"]},
    )  # fmt: skip
    assert open_split(generate, Task.GENERATE, "train").draws is None


# --------------------------------------------------------------------------- negatives


def test_each_epoch_draws_other_negatives(folders: dict[str, Path]) -> None:
    dataset = open_split(folders["on"], Task.SELECT, "train")
    assert dataset.draws is not None
    first, second = at_epoch(dataset, 0), at_epoch(dataset, 1)
    assert np.mean(changed(first, second)) > 0.9
    stored = [dataset.table[i] for i in range(len(dataset))]
    assert np.mean(changed(first, stored)) > 0.9  # not tokenize's fixed draws either
    assert np.mean(changed(first, at_epoch(dataset, 0, seed=6))) > 0.9  # the run's seed counts
    positions = {int(np.flatnonzero(e.labels)[0]) for e in first}
    assert positions == set(range(N_TRAIN))  # the positive is not always in one place


def test_positive_kept_negatives_distinct_and_from_other_dialogues(
    folders: dict[str, Path],
) -> None:
    dataset = open_split(folders["on"], Task.SELECT, "train")
    stored = [dataset.table[i] for i in range(len(dataset))]
    truth = [text(e.candidate_ids[int(np.flatnonzero(e.labels)[0])]) for e in stored]
    own: dict[str, set[int]] = defaultdict(set)  # pool row i is row i's response
    for i, e in enumerate(stored):
        own[e.dialogue_id].add(i)
    for epoch in range(4):
        for i, e in enumerate(at_epoch(dataset, epoch)):
            assert len(e.candidate_ids) == N_TRAIN and e.labels.dtype == np.int8
            assert e.labels.sum() == 1
            assert text(e.candidate_ids[int(np.flatnonzero(e.labels)[0])]) == truth[i]
            wrong = negatives(e)
            assert len(set(wrong)) == N_TRAIN - 1 and truth[i] not in wrong
            assert isinstance(e.candidate_ids, Rows)
            rows = e.candidate_ids.index[e.labels == 0].tolist()
            assert not set(rows) & own[e.dialogue_id]  # never its own dialogue's responses
            assert same_context(e, stored[i])  # untouched without augmentation


CONTEXT = ("dialogue_id", "turn", "input_ids", "utt_index", "utt_pos", "speaker")


def same_context(a: SelectExample, b: SelectExample) -> bool:
    return all(
        text(getattr(a, f)) == text(getattr(b, f)) if f not in ("dialogue_id", "turn")
        else getattr(a, f) == getattr(b, f)
        for f in CONTEXT
    )  # fmt: skip


# --------------------------------------------------------------------------- resume


def test_same_seed_and_epoch_give_the_same_batches_and_resume_exactly(
    folders: dict[str, Path],
) -> None:
    def epoch_batches(root: Path, epoch: int, seed: int = 5, start: int = 0) -> list:
        # A fresh dataset and loader each time: what a resumed process builds.
        loader = BatchLoader(open_split(root, Task.SELECT, "train"), 6, seed=seed)
        data = ShardBatches(loader)  # how the training loop reads them
        data.set_epoch(epoch)
        return list(data.iter_from(start))

    for name in ("on", "augment"):
        once = epoch_batches(folders[name], 1)
        assert batches_equal(once, epoch_batches(folders[name], 1))
        assert batches_equal(once[3:], epoch_batches(folders[name], 1, start=3))  # resumed
        loader = BatchLoader(open_split(folders[name], Task.SELECT, "train"), 6, seed=5)
        loader.set_epoch(1)
        assert batches_equal(once, list(loader))  # the loader's own iteration agrees
        assert not batches_equal(once, epoch_batches(folders[name], 2))


def test_worker_processes_draw_the_same(folders: dict[str, Path]) -> None:
    dataset = open_split(folders["augment"], Task.SELECT, "train")
    inline = BatchLoader(dataset, 16, seed=2)
    workers = BatchLoader(dataset, 16, seed=2, num_workers=1)
    for loader in (inline, workers):
        loader.set_epoch(4)
    assert batches_equal(list(inline), list(workers))


# --------------------------------------------------------------------------- augmentation


def test_augmented_contexts_are_prefixes_answered_by_the_next_utterance(
    folders: dict[str, Path],
) -> None:
    """The authors' rule (MiuLab/DSTC7 track1 ``DSTC7Dataset.__getitem__``): the first L
    utterances, L uniform in [min(m, n), n]; for L < n utterance L is the positive."""
    dataset = open_split(folders["augment"], Task.SELECT, "train")
    cut = whole = 0
    lengths: dict[int, set[int]] = defaultdict(set)
    for epoch in range(3):
        for i, e in enumerate(at_epoch(dataset, epoch)):
            s = dataset.table[i]
            n, kept = int(s.utt_index[-1]) + 1, int(e.utt_index[-1]) + 1
            assert kept >= min(MIN_UTTERANCES, n) >= 1
            assert e.labels.sum() == 1 and len(e.candidate_ids) == N_TRAIN
            positive = text(e.candidate_ids[int(np.flatnonzero(e.labels)[0])])
            assert positive not in negatives(e) and len(set(negatives(e))) == N_TRAIN - 1
            lengths[i].add(kept)
            if kept == n:
                whole += 1
                assert same_context(e, s)
                continue
            cut += 1
            size = len(e.input_ids)
            assert text(e.input_ids) == text(s.input_ids[:size])  # a prefix
            assert text(e.utt_index) == text(s.utt_index[:size])
            assert text(e.utt_pos) == text(s.utt_pos[:size])
            nxt = s.input_ids[s.utt_index == kept]  # utterance L, <bos> .. <eos>
            want = np.array(nxt[:MAX_CANDIDATE])
            want[-1] = EOS_ID
            assert positive == text(want)
            assert e.turn == s.turn - (n - kept)
            responder = s.speaker[size]  # the new positive's speaker is "self"
            expect = np.where(s.speaker[:size] == responder, SPEAKER_SELF, SPEAKER_OTHER)
            assert text(e.speaker) == text(expect)
    assert cut > 50 and whole > 50
    assert any(len(v) > 1 for v in lengths.values())  # L varies over epochs


# --------------------------------------------------------------------------- DSTC7


def test_dstc7_keeps_every_candidate_and_draws_its_subset_per_epoch(tmp_path: Path) -> None:
    settings = {"tasks": ["select"], "select": {"n_candidates_train": 5}}
    off = tokenized(tmp_path / "off", "dstc7", settings, FIXTURES / "dstc7")
    on = tokenized(tmp_path / "on", "dstc7", with_select(settings, resample_negatives=True),
                   FIXTURES / "dstc7")  # fmt: skip
    stored_off = open_split(off, Task.SELECT, "train")
    assert {len(stored_off[i].candidate_ids) for i in range(len(stored_off))} == {5}
    dataset = open_split(on, Task.SELECT, "train")
    full = [dataset.table[i] for i in range(len(dataset))]
    assert all(len(e.candidate_ids) > 5 for e in full)  # the shards keep all of them
    draws = {i: set() for i in range(len(dataset))}
    for epoch in range(4):
        for i, e in enumerate(at_epoch(dataset, epoch)):
            pairs = zip(full[i].candidate_ids, full[i].labels, strict=True)
            mine = {text(c): int(y) for c, y in pairs}
            got = [text(c) for c in e.candidate_ids]
            assert len(got) == 5 and all(c in mine for c in got)  # its own candidates only
            assert [mine[c] for c in got] == e.labels.tolist()
            assert e.labels.sum() == sum(mine.values())  # every correct one kept
            draws[i].add(frozenset(got))
    assert all(len(d) > 1 for i, d in draws.items() if len(full[i].candidate_ids) > 6)
    valid_on = at_epoch(open_split(on, Task.SELECT, "valid"), 2)
    valid_off = at_epoch(open_split(off, Task.SELECT, "valid"), 0)
    assert all(examples_equal(a, b) for a, b in zip(valid_on, valid_off, strict=True))


# --------------------------------------------------------------------------- training


def test_hrt_trains_with_per_epoch_draws(folders: dict[str, Path], tmp_path: Path) -> None:
    root = folders["augment"]
    params = RunParams.model_validate(
        {"epochs": 2, "batch_size": 8, "max_batches_per_epoch": 3, "patience": None,
         "log_every": 1, "seed": 1, "optimizer": {"lr": 0.003}}
    )  # fmt: skip
    tiny = {"d_model": 16, "d_embed": 16, "d_ff": 32, "n_heads": 2, "n_layers": 1}
    sizes = read_manifest(root).data_sizes()
    model = ConfiguredModel(sizes)("hrt_last", params.model_copy(update={"model": tiny}))
    data = ShardData(str(root), Task.SELECT, batch_size=8, eval_batch_size=8, seed=1)
    job = TrainJob("hrt", "hrt_last", model, data, params, str(tmp_path), show_progress=False)
    metrics = train_local(job)
    assert metrics["steps"] == 6 and math.isfinite(metrics["best_valid_loss"])
