"""Parameter averaging (``pipeline.train.averaging``): the uniform and EMA averages against
hand-computed ones, and in the loop: the learning rate and schedule while averaging, the
averaged weights evaluated, kept and exported, and an exact resume mid-averaging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.config.train import AveragingParams
from pipeline.train import averaging
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.loop import train_local
from tests.train.helpers import VOCAB, PoolFactory, ToyConfig, ToyModel
from tests.train.test_loop import ListSink, make_job

REPO = Path(__file__).resolve().parents[2]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight  # tied: one parameter, two state_dict keys
        self.register_buffer("steps", torch.zeros(()))


def _walk(model: nn.Module, values: list[float], average: averaging.WeightAverage) -> None:
    """Set every weight to each of ``values`` in turn, averaging after each."""
    for value in values:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
        average.update()


def test_uniform_is_the_mean_of_the_weights_after_each_step() -> None:
    model = _Tied()
    average = averaging.WeightAverage(AveragingParams(kind="uniform", epochs=2), 5, model)
    assert average.enabled and not average.active
    assert not average.due(2) and average.due(3) and average.due(4)
    average.begin()  # from the weights as they are: weight 0 once a step is averaged
    _walk(model, [1.0, 2.0, 6.0, 3.0], average)
    assert average.count == 4
    assert torch.allclose(average.average[0], torch.full((2, 2), 3.0), atol=1e-6)
    assert not average.due(4)  # begun


def test_ema_follows_its_recursion_from_the_weights_it_began_with() -> None:
    model = _Tied()
    with torch.no_grad():
        model.a.weight.fill_(10.0)
    average = averaging.WeightAverage(AveragingParams(kind="ema", ema_decay=0.75), 3, model)
    average.begin()
    _walk(model, [2.0, 4.0], average)
    expected = 0.75 * (0.75 * 10.0 + 0.25 * 2.0) + 0.25 * 4.0  # 7.25
    assert torch.allclose(average.average[0], torch.full((2, 2), expected), atol=1e-6)


def test_the_average_is_swapped_in_for_a_block_and_the_live_weights_come_back() -> None:
    model = _Tied()
    average = averaging.WeightAverage(AveragingParams(kind="uniform"), 2, model)
    live = model.a.weight.detach().clone()
    with average.applied():  # not begun: nothing to swap
        assert torch.equal(model.a.weight, live)
    assert average.state(model) is None
    average.begin()
    _walk(model, [1.0, 3.0], average)
    now = model.a.weight.detach().clone()
    with average.applied():
        assert torch.equal(model.a.weight, torch.full((2, 2), 2.0))
    assert torch.equal(model.a.weight, now)  # bit for bit
    state = average.state(model)
    assert set(state) == {"a.weight", "b.weight", "steps"}  # the tied key too: exportable
    assert torch.equal(state["b.weight"], torch.full((2, 2), 2.0))
    again = averaging.WeightAverage(AveragingParams(kind="uniform"), 2, model)
    again.load(state, average.count)
    assert again.count == 2 and torch.equal(again.average[0], average.average[0])


_AVERAGED = {
    "epochs": 4,
    "averaging": {"kind": "uniform", "epochs": 2, "lr_factor": 0.5},
    "schedule": {"kind": "linear_warmup", "warmup_steps": 12},  # over before averaging
}


def test_the_loop_averages_the_last_epochs_and_keeps_and_exports_the_average(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, torch.Tensor]] = []
    update = averaging.WeightAverage.update

    def recorded(self) -> None:
        update(self)
        seen.append({n: p.detach().clone() for n, p in zip(self.names, self.weights, strict=True)})

    monkeypatch.setattr(averaging.WeightAverage, "update", recorded)
    sink = ListSink([])
    train_local(make_job(tmp_path, sink=sink, **_AVERAGED))  # 8 steps an epoch
    state = TrainingState.read(tmp_path / "run" / CHECKPOINT_FILE)
    assert state.average_count == len(seen) == 16  # epochs 3 and 4
    for name, value in state.average.items():
        if name in seen[0]:
            mean = torch.stack([s[name] for s in seen]).mean(0)
            assert torch.allclose(value, mean, atol=1e-6), name
    # the learning rate: warm-up, lr until averaging, then half of it, constant
    rates = [m["lr"] for _, m in sink.log if "lr" in m]
    assert rates[:16] == pytest.approx([0.05 * min(1, (s + 1) / 12) for s in range(16)])
    assert rates[16:] == pytest.approx([0.05 * 0.5] * 16)
    # validation evaluates the average: the last logged loss is the average's
    model = ToyModel(ToyConfig(vocab_size=VOCAB, d_model=8))
    model.load_state_dict(state.average)
    model.eval()
    _, valid = PoolFactory(valid_from_train=True)(0, 1)
    with torch.no_grad():
        outs = [model.loss(batch) for batch in valid.iter_from(0)]
    loss = sum(o.nll_sum.item() for o in outs) / sum(o.n_tokens.item() for o in outs)
    assert state.metrics["valid_loss"] == pytest.approx(loss, rel=1e-6)
    # the average improved on the live weights' best: it is what the run keeps and exports
    assert state.position.best_step == 32
    assert all(torch.equal(state.best_model[k], v) for k, v in state.average.items())
    exported = state.exported({}, "run").weights
    assert all(torch.equal(exported[k], v) for k, v in state.average.items())
    assert not all(torch.equal(state.model[k], v) for k, v in state.average.items())


def _same(a: TrainingState, b: TrainingState) -> None:
    for field in ("model", "average", "best_model"):
        x, y = getattr(a, field), getattr(b, field)
        assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x), field
    assert a.average_count == b.average_count and a.position == b.position
    assert a.metrics == b.metrics


@pytest.mark.parametrize("kind", ["uniform", "ema"])
def test_a_run_interrupted_mid_averaging_resumes_to_the_same_weights(
    tmp_path: Path, kind: str
) -> None:
    params = {**_AVERAGED, "averaging": {**_AVERAGED["averaging"], "kind": kind},
              "dropout": 0.3, "checkpoint_every": 3, "eval_every": 5}  # fmt: skip
    full = train_local(make_job(tmp_path / "a", **params))
    with pytest.raises(KeyboardInterrupt):  # after step 22, mid-epoch 3 (averaging)
        train_local(make_job(tmp_path / "b", sink=ListSink([], fail_at=22), **params))
    saved = TrainingState.read(tmp_path / "b" / "run" / CHECKPOINT_FILE)
    assert saved.position.step == 21 and saved.average_count == 5
    assert train_local(make_job(tmp_path / "b", **params)) == full
    _same(*(TrainingState.read(tmp_path / r / "run" / CHECKPOINT_FILE) for r in "ab"))


_KILLED = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from tests.train.test_loop import ListSink, make_job
    from tests.train.test_averaging import _AVERAGED
    from pipeline.train.loop import train_local

    class Killer(ListSink):
        def log_metrics(self, metrics, step):
            if step == int(sys.argv[2]) and "train_loss" in metrics:
                os.kill(os.getpid(), signal.SIGKILL)

    sink = Killer([]) if sys.argv[2] != "0" else None
    params = {**_AVERAGED, "dropout": 0.3, "checkpoint_every": 5}
    print(train_local(make_job(Path(sys.argv[1]), sink=sink, **params)))
    """
)


@pytest.mark.slow
def test_sigkilled_mid_averaging_resumes_to_the_same_weights(tmp_path: Path) -> None:
    def run(folder: Path, kill_at: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        argv = [sys.executable, "-c", _KILLED, str(folder), str(kill_at)]
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    full = run(tmp_path / "a", 0)
    assert full.returncode == 0, full.stderr
    killed = run(tmp_path / "b", 28)  # epoch 4, after step 25's checkpoint (averaging since 16)
    assert killed.returncode == -signal.SIGKILL
    saved = TrainingState.read(tmp_path / "b" / "run" / CHECKPOINT_FILE)
    assert saved.position.step == 25 and saved.average_count == 9
    resumed = run(tmp_path / "b", 0)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[-1] == full.stdout.splitlines()[-1]
    _same(*(TrainingState.read(tmp_path / r / "run" / CHECKPOINT_FILE) for r in "ab"))


def test_averaging_off_changes_nothing(tmp_path: Path) -> None:
    """The default (kind none) writes no average, steps the schedule at every step."""
    sink = ListSink([])
    job = make_job(tmp_path, sink=sink, epochs=2, schedule={"kind": "linear_warmup",
                                                             "warmup_steps": 12})  # fmt: skip
    train_local(job)
    state = TrainingState.read(tmp_path / "run" / CHECKPOINT_FILE)
    assert state.average is None and state.average_count == 0
    rates = [m["lr"] for _, m in sink.log if "lr" in m]
    assert rates == pytest.approx([0.05 * min(s + 1, 12) / 12 for s in range(16)])
