"""A plan's data factory by tokens (``job.ShardData`` with ``batch_tokens``): the ranks in
step within the budget, and a run that trains by tokens to a cosine schedule over its
planned steps."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pipeline.config import parse_params
from pipeline.names import Task
from pipeline.plan import RunRequest, plan_training
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.job import ShardData, train_job
from pipeline.train.loop import train_local
from tests.train.conftest import TOKENIZE
from tests.train.test_loop import ListSink


def test_ranks_take_equal_numbers_of_token_batches_within_their_budget(project: Path) -> None:
    data = ShardData(str(project / "data" / "shards" / "chitchat"), Task.LM, 8, 8, seed=5,
                     batch_tokens=1200)  # fmt: skip
    ranks = [data(r, 2)[0] for r in range(2)]
    counts = ranks[0].loader.dataset.token_counts()
    for epoch in (0, 1):
        plans = []
        for train in ranks:
            train.set_epoch(epoch)
            plans.append(train.loader.batches())
        assert len(plans[0]) == len(plans[1]) == len(ranks[0]) > 1
        for batch in plans[0] + plans[1]:  # each rank's half of the global budget
            assert len(batch) * counts[batch].max() <= 600 or len(batch) == 1
    with pytest.raises(ValueError, match="batch_tokens 1 is < 2 workers"):
        ShardData(data.root, Task.LM, 8, 8, seed=5, batch_tokens=1)(0, 2)


def test_a_run_by_tokens_decays_its_cosine_over_the_planned_steps(project: Path) -> None:
    knobs = {"epochs": 3, "batch_tokens": 1500, "log_every": 1, "patience": None,
             "schedule": {"kind": "cosine", "warmup_steps": 2, "min_lr": 1e-4},
             "optimizer": {"lr": 1e-3}, "model": {"d_model": 16, "n_heads": 2, "n_layers": 1,
                                                   "d_ff": 32}}  # fmt: skip
    runs = {"gpt-chitchat": {"model": "gpt", "corpus": "chitchat"}}
    raw = {"tokenize": TOKENIZE, "train": {"defaults": knobs, "runs": runs}}
    plan = plan_training(RunRequest.of(parse_params(raw), "gpt-chitchat"), project)
    sink = ListSink([])
    job = train_job(plan, sink, show_progress=False)
    metrics = train_local(job)
    train, _ = job.data(0, 1)
    per_epoch = len(train)  # the first epoch's count stands for each
    rates = [m["lr"] for _, m in sink.log if "lr" in m]
    assert len(rates) == metrics["steps"]
    assert rates[1] == pytest.approx(1e-3)  # warm-up ends at step 2
    planned = 3 * per_epoch
    assert len(rates) >= planned  # the later epochs drew as many batches, or more
    assert rates[planned - 1 :] == pytest.approx([1e-4] * (len(rates) - planned + 1))
    assert all(a >= b for a, b in itertools.pairwise(rates[1:]))
    state = TrainingState.read(Path(job.run_dir) / job.name / CHECKPOINT_FILE)
    assert state.position.finished
