"""The training loop in local mode: learning, early stopping, resume (past a torn checkpoint),
checkpoints, divergence, train metrics and progress."""

from __future__ import annotations

import io
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline import progress
from pipeline.config import RunParams
from pipeline.data.batch import GenerateBatch
from pipeline.errors import DataError, TrainingDiverged
from pipeline.models.base import LossOutput
from pipeline.names import Task
from pipeline.train import loop
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.context import PREVIOUS_FILE
from pipeline.train.loop import TrainJob, train_local
from pipeline.train.optim import make_optimizer, make_scheduler
from pipeline.train.seed import seed_everything
from pipeline.train.steps import TrainWindow
from tests.train.helpers import (
    VOCAB,
    DivergingFactory,
    PoolFactory,
    ToyConfig,
    ToyFactory,
    ToyModel,
)

REPO = Path(__file__).resolve().parents[2]


def make_job(tmp: Path | str, name: str = "run", sink=None, **params) -> TrainJob:
    base = {"epochs": 3, "batch_size": 4, "log_every": 1, "patience": None, "seed": 7}
    return TrainJob(
        name=name,
        model_name="toy",
        model=ToyFactory(dropout=params.pop("dropout", 0.0)),
        data=PoolFactory(n_train=params.pop("n_train", 32), valid_from_train=True),
        params=RunParams.model_validate({**base, **params, "optimizer": {"lr": 0.05}}),
        run_dir=str(tmp),
        sink=sink,
        show_progress=False,
    )


@dataclass
class ListSink:
    """Collects metrics; ``fail_at`` raises after that step (an in-process 'kill')."""

    log: list
    fail_at: int | None = None
    recording = True

    def __call__(self):
        return self

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.log.append((step, dict(metrics)))
        if self.fail_at is not None and step >= self.fail_at and "train_loss" in metrics:
            raise KeyboardInterrupt(f"killed at step {step}")


def test_loss_goes_down_and_checkpoint_holds_everything(tmp_path):
    sink = ListSink([])
    metrics = train_local(make_job(tmp_path, sink=sink, epochs=4))
    evals = [m["valid_loss"] for _, m in sink.log if "valid_loss" in m]
    train = [m["train_loss"] for _, m in sink.log if "train_loss" in m]
    assert len(evals) == 4 and metrics["steps"] == 32
    assert sum(train[-8:]) < sum(train[:8]) * 0.8
    assert evals[-1] < evals[0]
    assert metrics["best_valid_ppl"] == pytest.approx(math.exp(min(evals)))
    state = TrainingState.read(tmp_path / "run" / CHECKPOINT_FILE)
    assert state.position.finished and state.position.stop_reason == "epochs"
    assert state.model_config["d_model"] == 8 and state.model_name == "toy"
    assert state.task == "generate" and state.seed == 7 and len(state.rng) == 1
    assert state.optimizer["state"] and state.scheduler and state.best_model is not None
    assert state.metrics["valid_loss"] == evals[-1]
    # the checkpoint is loadable without unpickling code
    raw = torch.load(tmp_path / "run" / CHECKPOINT_FILE, weights_only=True)
    assert raw["progress"]["step"] == 32
    assert set(raw) >= {"model", "optimizer", "scheduler", "rng", "best_model", "model_config"}


class _Scripted(nn.Module):
    """Trains a real parameter; in eval mode reports a scripted validation loss."""

    task = Task.GENERATE

    def __init__(self, script: list[float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.script, self.evals = script, 0

    def loss(self, batch: GenerateBatch) -> LossOutput:
        n = batch.target_mask.sum()
        if self.training:
            loss = (self.w - 1.0).pow(2).sum()
            return LossOutput(loss, loss.detach() * n, n)
        value = self.script[min(self.evals, len(self.script) - 1)]
        self.evals += 1
        return LossOutput(torch.tensor(value), torch.tensor(value) * n, n)


@dataclass(frozen=True)
class _ScriptedFactory:
    script: tuple[float, ...]

    def __call__(self) -> nn.Module:
        return _Scripted(list(self.script))


def test_early_stopping_keeps_the_best_weights(tmp_path):
    # one valid batch per evaluation; evaluations every 2 steps
    job = replace(
        make_job(tmp_path, patience=2, eval_every=2, epochs=50),
        model=_ScriptedFactory((5.0, 4.0, 4.5, 4.0, 4.2, 1.0)),
        data=PoolFactory(n_train=32, n_valid=4),
    )
    metrics = train_local(job)
    # best at the 2nd evaluation (step 4); the 3rd and 4th (equal is no improvement) stop it
    assert metrics["best_valid_loss"] == 4.0 and metrics["best_step"] == 4
    assert metrics["steps"] == 8
    state = TrainingState.read(tmp_path / "run" / CHECKPOINT_FILE)
    assert state.position.stop_reason == "early_stopping"
    assert state.best_model["w"] != state.model["w"]


@dataclass
class _ScriptedScore:
    """A ``loop.ValidationScore`` whose evaluation ``i`` scores ``script[i]``."""

    script: tuple[float, ...]
    evals: int = 0

    def decode(self, model, rank, world_size, device) -> list[int]:
        self.evals += 1
        return [self.evals - 1]

    def score(self, outputs: list[int]) -> dict[str, float]:
        return {"valid_score": self.script[outputs[0]], "valid_part": 1.0}


def test_selecting_on_a_score_keeps_the_best_scored_weights_not_the_lowest_loss(tmp_path):
    job = replace(
        make_job(tmp_path, patience=2, eval_every=2, epochs=50, select_by="multiwoz_score"),
        model=_ScriptedFactory((5.0, 4.0, 3.0, 2.0, 1.0)),
        data=PoolFactory(n_train=32, n_valid=4),
        validation_score=_ScriptedScore((10.0, 30.0, 20.0, 30.0, 40.0)),
    )
    metrics = train_local(job)
    # the loss falls at every evaluation; the score peaks at the 2nd (step 4), and the 3rd
    # and 4th (equal is no improvement) use up the patience
    assert metrics["best_valid_score"] == 30.0 and metrics["best_step"] == 4
    assert metrics["best_valid_loss"] == 4.0  # the kept weights' loss, not the lowest (2.0)
    assert metrics["steps"] == 8
    state = TrainingState.read(tmp_path / "run" / CHECKPOINT_FILE)
    assert state.position.stop_reason == "early_stopping"
    assert state.position.best_score == 30.0
    assert state.best_model["w"] != state.model["w"]
    assert state.metrics["valid_score"] == 30.0 and state.metrics["valid_part"] == 1.0
    # the loss alone picks the last evaluation of the same script
    by_loss = replace(
        job, params=RunParams.model_validate({**job.params.model_dump(), "select_by": "valid_loss"})
    )
    assert train_local(replace(by_loss, run_dir=str(tmp_path / "loss")))["best_step"] > 4


def test_selecting_on_a_score_needs_one(tmp_path):
    with pytest.raises(ValueError, match="the job has no validation_score"):
        train_local(make_job(tmp_path, select_by="multiwoz_score"))


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return TrainingState.read(run_dir / CHECKPOINT_FILE).model


@pytest.mark.parametrize("fail_at", [2, 4, 8, 13])
def test_interrupted_run_resumes_to_the_same_result(tmp_path, fail_at):
    params = {"dropout": 0.3, "checkpoint_every": 3, "eval_every": 5, "epochs": 2}
    full = train_local(make_job(tmp_path / "a", **params))
    sink = ListSink([], fail_at=fail_at)
    with pytest.raises(KeyboardInterrupt):
        train_local(make_job(tmp_path / "b", sink=sink, **params))
    saved = tmp_path / "b" / "run" / CHECKPOINT_FILE
    previous = saved.with_name(PREVIOUS_FILE)
    assert saved.is_file() == (fail_at >= 3)  # the first checkpoint is at step 3
    assert previous.is_file() == (fail_at >= 6)  # the one before, from the second on
    if saved.is_file():
        before = TrainingState.read(saved).position
        assert fail_at - 3 < before.step <= fail_at and not before.finished
    if previous.is_file():
        assert TrainingState.read(previous).position.step == before.step - 3
    resumed = train_local(make_job(tmp_path / "b", **params))
    assert resumed == full
    for k, v in _final_weights(tmp_path / "a" / "run").items():
        assert torch.equal(v, _final_weights(tmp_path / "b" / "run")[k]), k


def _interrupted(tmp: Path, fail_at: int, **params) -> Path:
    """The run folder of a run killed after step ``fail_at`` (checkpoints every 3 steps)."""
    with pytest.raises(KeyboardInterrupt):
        train_local(make_job(tmp, sink=ListSink([], fail_at=fail_at), **params))
    return tmp / "run"


def _tear(path: Path) -> bytes:
    """Cut ``path`` short, as a full disk or a copy cut short leaves it; its new bytes."""
    torn = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(torn)
    return torn


_RESUMED = {"dropout": 0.3, "checkpoint_every": 3, "eval_every": 5, "epochs": 2}


def test_a_torn_newest_checkpoint_resumes_from_the_one_before(tmp_path):
    full = train_local(make_job(tmp_path / "a", **_RESUMED))
    run = _interrupted(tmp_path / "b", 8, **_RESUMED)
    assert TrainingState.read(run / CHECKPOINT_FILE).position.step == 6
    assert TrainingState.read(run / PREVIOUS_FILE).position.step == 3
    _tear(run / CHECKPOINT_FILE)
    sink = ListSink([])
    with pytest.warns(UserWarning, match=r"passing over a checkpoint.*checkpoint\.pt: unreadable"):
        resumed = train_local(make_job(tmp_path / "b", sink=sink, **_RESUMED))
    assert next(step for step, m in sink.log if "train_loss" in m) == 4  # after step 3's
    assert resumed == full
    for k, v in _final_weights(tmp_path / "a" / "run").items():
        assert torch.equal(v, _final_weights(run)[k]), k


def test_a_resumed_run_keeps_an_intact_checkpoint_before_its_newest(tmp_path):
    """Passing over a torn newest checkpoint, the run goes on two deep: the torn file is
    not kept as "the one before" in place of the intact checkpoint it resumed from."""
    run = _interrupted(tmp_path, 8, **_RESUMED)
    _tear(run / CHECKPOINT_FILE)
    # resumed from step 3, killed again right after its next checkpoint (step 6)
    with pytest.warns(UserWarning, match="passing over a checkpoint"):
        _interrupted(tmp_path, 7, **_RESUMED)
    assert TrainingState.read(run / CHECKPOINT_FILE).position.step == 6
    assert TrainingState.read(run / PREVIOUS_FILE).position.step == 3


def test_no_intact_checkpoint_fails_with_the_command_that_starts_the_run_over(tmp_path):
    run = _interrupted(tmp_path, 8, **_RESUMED)
    torn = {path: _tear(path) for path in (run / CHECKPOINT_FILE, run / PREVIOUS_FILE)}
    restart = f"rm -r {run} && dvc repro train@toy-chitchat"
    job = replace(make_job(tmp_path, **_RESUMED), restart=restart)
    with pytest.warns(UserWarning) as warned, pytest.raises(DataError) as caught:
        train_local(job)
    # pytest.warns records every warning the block raises (a library's first-use warning
    # too, whichever test comes first): only the checkpoints passed over are counted
    passed_over = [w for w in warned if "passing over a checkpoint" in str(w.message)]
    assert len(passed_over) == 2  # one per checkpoint passed over
    message = str(caught.value)
    assert caught.value.path == str(run)
    assert "no intact checkpoint to resume from" in message
    assert "checkpoint.pt: unreadable" in message and "checkpoint.prev.pt: unreadable" in message
    assert message.endswith(f"start the run over: {restart}")
    assert {path: path.read_bytes() for path in torn} == torn  # nothing trained, nothing written
    # without a stage's command, the message says to remove the run folder
    with pytest.warns(UserWarning), pytest.raises(DataError, match="start the run over") as bare:
        train_local(make_job(tmp_path, **_RESUMED))
    assert f"rm -r {run} " in str(bare.value)


# --------------------------------------------------------------------------- divergence


@pytest.mark.parametrize(
    ("what", "log_every", "seen_at", "reason"),
    [
        ("loss", 1, 5, "the training loss is not finite"),  # read at the logged step
        ("loss", 100, 6, "the training loss is not finite"),  # read at the checkpoint
        ("weight", 1, 6, "weight spare is not finite"),  # found when checkpointing
    ],
)
def test_a_diverging_run_stops_naming_the_step_and_keeps_its_last_finite_checkpoint(
    tmp_path, what, log_every, seen_at, reason
):
    job = replace(
        make_job(tmp_path, checkpoint_every=2, log_every=log_every, epochs=2),
        model=DivergingFactory(at=5, what=what),
    )
    with pytest.raises(TrainingDiverged) as caught:
        train_local(job)
    message = str(caught.value)
    assert message.startswith(f"run diverged at step {seen_at}: {reason}; ")
    assert "optimizer.lr (0.05)" in message and "clip_norm (1.0)" in message
    # the checkpoints are those before the divergence, every weight finite
    newest = TrainingState.read(tmp_path / "run" / CHECKPOINT_FILE)
    previous = TrainingState.read(tmp_path / "run" / PREVIOUS_FILE)
    assert (newest.position.step, previous.position.step) == (4, 2)
    for state in (newest, previous):
        assert all(torch.isfinite(v).all() for v in state.model.values())
        assert not state.position.finished


def test_a_non_finite_validation_loss_stops_the_run(tmp_path):
    job = replace(
        make_job(tmp_path, eval_every=2, checkpoint_every=2, epochs=50),
        model=_ScriptedFactory((5.0, math.nan)),
        data=PoolFactory(n_train=32, n_valid=4),
    )
    with pytest.raises(
        TrainingDiverged, match=r"^run diverged at step 4: the validation loss is nan"
    ):
        train_local(job)
    # the checkpoint of step 2 (after its finite evaluation) is the last
    assert TrainingState.read(tmp_path / "run" / CHECKPOINT_FILE).position.step == 2


_KILLED_RUN = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from tests.train.test_loop import ListSink, make_job
    from pipeline.signals import signal_number
    from pipeline.train.loop import train_local

    class Killer(ListSink):
        def log_metrics(self, metrics, step):
            if step == int(sys.argv[2]) and "train_loss" in metrics:
                os.kill(os.getpid(), int(sys.argv[3]))

    sink = Killer([]) if sys.argv[2] != "0" else None
    params = {"dropout": 0.3, "checkpoint_every": 5, "epochs": 2}
    try:
        print(train_local(make_job(sys.argv[1], sink=sink, **params)))
    except KeyboardInterrupt as stop:  # as the train stage ends on a stop signal
        sys.exit(128 + signal_number(stop))
    """
)


def run_killable(
    folder: Path | str, kill_at: int, sig: signal.Signals = signal.SIGKILL
) -> subprocess.CompletedProcess:
    """``_KILLED_RUN`` in a subprocess: the toy run under ``folder`` (a path or a storage
    URI), sent ``sig`` at step ``kill_at`` (0: trained to the end, its metrics printed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(folder), str(kill_at), str(int(sig))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_killed_or_stopped_subprocess_resumes_to_the_same_result(tmp_path):
    """At step 12 (mid-epoch 2 of 8 batches, two steps past the periodic checkpoint of step
    10), SIGKILL ends the run at once: it resumes from step 10. SIGTERM (a ``kill``, a Slurm
    cancel; Ctrl-C and SIGHUP alike) lets the step finish and checkpoints it, and the process
    ends 128 + 15: it resumes from step 12. Both end with the weights and metrics of the run
    never stopped."""
    full = run_killable(tmp_path / "full", 0)
    assert full.returncode == 0, full.stderr
    for sig, code, newest in ((signal.SIGKILL, -signal.SIGKILL, 10), (signal.SIGTERM, 143, 12)):
        run = tmp_path / sig.name / "run"
        stopped = run_killable(run.parent, 12, sig)
        assert stopped.returncode == code, stopped.stderr
        assert TrainingState.read(run / CHECKPOINT_FILE).position.step == newest
        assert TrainingState.read(run / PREVIOUS_FILE).position.step == (8 if newest == 10 else 10)
        resumed = run_killable(run.parent, 0)
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.splitlines()[-1] == full.stdout.splitlines()[-1]
        for k, v in _final_weights(tmp_path / "full" / "run").items():
            assert torch.equal(v, _final_weights(run)[k]), (sig.name, k)


def test_max_steps_and_max_batches_per_epoch(tmp_path):
    metrics = train_local(make_job(tmp_path, epochs=5, max_batches_per_epoch=3, max_steps=7))
    assert metrics["steps"] == 7 and metrics["epochs"] == 2
    state = TrainingState.read(tmp_path / "run" / CHECKPOINT_FILE)
    assert state.position.stop_reason == "max_steps"
    assert state.position.last_eval_step == 7  # the final weights were evaluated


# --------------------------------------------------------------------------- train metrics


class _ToyWithTerms(ToyModel):
    """The toy model with two logged loss terms."""

    def loss(self, batch: GenerateBatch) -> LossOutput:
        out = super().loss(batch)
        terms = {"half": out.loss.detach() / 2, "tokens": out.n_tokens.detach()}
        return replace(out, terms=terms)


@dataclass(frozen=True)
class _ToyWithTermsFactory:
    def __call__(self) -> nn.Module:
        return _ToyWithTerms(ToyConfig(vocab_size=VOCAB, d_model=8))


def _replay(job: TrainJob, steps: int) -> list[dict[str, float]]:
    """Each step's values, from a plain re-implementation of the loop's first ``steps``."""
    p = job.params
    seed_everything(p.seed)
    model = job.model()
    optimizer = make_optimizer(model, p.optimizer)
    scheduler = make_scheduler(optimizer, p.schedule)
    train, _ = job.data(0, 1)
    train.set_epoch(0)
    records = []
    for _, batch in zip(range(steps), train.iter_from(0), strict=False):
        out = model.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        record = {
            "loss": float(out.loss.detach()),
            "nll": float(out.nll_sum),
            "tokens": float(out.n_tokens),
            "half": float(out.terms["half"]),
            "examples": float(batch.batch_size),
            "lr": optimizer.param_groups[0]["lr"],
        }
        if p.clip_norm is not None:
            record["grad_norm"] = float(nn.utils.clip_grad_norm_(model.parameters(), p.clip_norm))
        records.append(record)
        optimizer.step()
        scheduler.step()
    return records


@pytest.mark.parametrize("clip_norm", [0.5, None])
def test_logged_train_metrics_are_the_window_aggregates(tmp_path, clip_norm):
    sink = ListSink([])
    job = replace(
        make_job(
            tmp_path,
            sink=sink,
            epochs=1,
            log_every=3,
            clip_norm=clip_norm,
            schedule={"kind": "linear_warmup", "warmup_steps": 4},
        ),
        model=_ToyWithTermsFactory(),
    )
    train_local(job)
    logged = [(step, m) for step, m in sink.log if "train_loss" in m]
    assert [step for step, _ in logged] == [3, 6]  # 8 batches, the last two never logged
    records = _replay(job, 6)
    for (step, metrics), window in zip(logged, (records[:3], records[3:6]), strict=True):
        total = {k: sum(r[k] for r in window) for k in window[0]}
        nll = total["nll"] / total["tokens"]
        expected = {
            "train_loss": total["loss"] / 3,
            "train_nll": nll,
            "train_ppl": math.exp(nll),
            "lr": window[-1]["lr"],
            "train_half": total["half"] / 3,
            "train_tokens": total["tokens"] / 3,
        }
        if clip_norm is not None:
            expected["grad_norm"] = window[-1]["grad_norm"]
        rates = {"examples_per_s", "tokens_per_s"}
        assert set(metrics) == set(expected) | rates, step
        assert {k: metrics[k] for k in expected} == expected, step
        ratio = metrics["tokens_per_s"] / metrics["examples_per_s"]
        assert ratio == pytest.approx(total["tokens"] / total["examples"])


class _SyncSpy:
    """Records every read of a tensor's value into Python (each one a host sync on a GPU)."""

    READS = ("__float__", "__int__", "__bool__", "__index__", "item", "tolist", "numpy")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[str] = []
        for name in self.READS:
            monkeypatch.setattr(torch.Tensor, name, self._spy(name, getattr(torch.Tensor, name)))

    def _spy(self, name, original):
        def spy(tensor, *args, **kwargs):
            self.reads.append(name)
            return original(tensor, *args, **kwargs)

        return spy


def test_window_reads_the_device_only_when_it_flushes(monkeypatch):
    w = torch.ones((), requires_grad=True)
    outs = []
    for k in (1.0, 2.0, 3.0):
        loss = w * k
        outs.append(LossOutput(loss, loss * 10, torch.tensor(5), {"kl": loss / 2}))
    norms = [torch.tensor(0.25 * k) for k in range(3)]
    window = TrainWindow()
    spy = _SyncSpy(monkeypatch)
    for _ in range(100):  # the sums keep their size however long the window
        for out, norm in zip(outs, norms, strict=True):
            window.add(out, norm, 0.1, 2)
    assert spy.reads == []
    assert window.sums is not None and window.sums.shape == (4,)
    assert window.sums.dtype == torch.float64 and window.sums.grad_fn is None
    metrics = window.flush(Task.GENERATE)
    assert spy.reads
    assert metrics["train_loss"] == 2.0 and metrics["train_nll"] == 4.0
    assert metrics["train_kl"] == 1.0 and metrics["grad_norm"] == 0.5 and metrics["lr"] == 0.1
    assert metrics["train_ppl"] == pytest.approx(math.exp(4.0))
    assert window.sums is None and window.steps == 0  # a fresh window


# --------------------------------------------------------------------------- progress


class _FakeClock:
    """``pipeline.progress.now``: seconds move only when the test says so."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _seconds_per_step(monkeypatch: pytest.MonkeyPatch, clock: _FakeClock, seconds: float):
    """Every training step takes ``seconds`` of ``clock``."""
    original = loop._Run.train_step

    def step(run, batch):
        original(run, batch)
        clock.t += seconds

    monkeypatch.setattr(loop._Run, "train_step", step)


def test_progress_in_a_log_is_a_line_every_few_seconds_and_per_validation(
    tmp_path, monkeypatch, capsys
):
    clock = _FakeClock()
    monkeypatch.setattr(progress, "now", clock)
    _seconds_per_step(monkeypatch, clock, 3.0)  # 24 steps of 3 s: a line every 7 steps
    job = replace(make_job(tmp_path, epochs=3), show_progress=True, label="train toy")
    train_local(job)
    lines = capsys.readouterr().err.splitlines()  # pytest's stderr is no terminal
    assert all(line.startswith("train toy: ") for line in lines), lines
    assert lines[0] == "train toy: step 0/24 (0%)"
    periodic = [line for line in lines if "ETA" in line]
    assert [line.split(",")[0] for line in periodic] == [
        "train toy: step 7/24 (29%)",
        "train toy: step 14/24 (58%)",
        "train toy: step 21/24 (88%)",
    ]
    # the loss read back at log_every, the rate of this process and what remains at it
    assert re.fullmatch(
        r"train toy: step 7/24 \(29%\), epoch 1/3, loss \d\.\d+, 3 s/step, ETA 51s", periodic[0]
    )
    valid = [line for line in lines if "valid loss" in line]
    assert len(valid) == 3  # one per evaluation (every epoch's end)
    assert re.fullmatch(r"train toy: step 8, valid loss \d\.\d+ \(best\)", valid[0])
    assert lines[-1].startswith("train toy: finished step 24/24 (100%), epoch 3/3, loss ")
    assert lines[-1].endswith(" in 1m12s")
    assert len(lines) == 1 + 3 + 3 + 1


def test_progress_on_a_terminal_is_a_bar(tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys, "stderr", screen)
    train_local(replace(make_job(tmp_path, epochs=1), show_progress=True, label="train toy"))
    drawn = screen.getvalue()
    assert "━" in drawn and "train toy" in drawn and "8/8" in drawn  # bar, label, steps
    assert "\x1b[" in drawn  # drawn in place with cursor moves, then erased
    assert "train toy: step 8, valid loss" in drawn  # the validation, above the bar


def test_no_progress_prints_nothing(tmp_path, capsys):
    train_local(make_job(tmp_path, epochs=1))  # show_progress=False
    assert capsys.readouterr() == ("", "")


def test_progress_reads_the_device_only_when_it_logs(tmp_path, monkeypatch, capsys):
    """Progress lines use the loss read at ``log_every``: no step between reads it."""
    clock = _FakeClock()
    monkeypatch.setattr(progress, "now", clock)
    _seconds_per_step(monkeypatch, clock, 30.0)  # a progress line after every step
    # Adam reads its step counter, a CPU tensor (no device to wait for): not counted
    item = torch.Tensor.item
    monkeypatch.setattr(sys.modules["torch.optim.adam"], "_get_value", lambda x: item(x))
    spy = _SyncSpy(monkeypatch)
    reads: dict[int, int] = {}
    step, advance = loop._Run.train_step, progress.Reporter.advance

    def counted_step(run, batch):
        before = len(spy.reads)
        step(run, batch)
        reads[run.progress.step] = len(spy.reads) - before

    def counted_advance(reporter, n=1):
        before = len(spy.reads)
        advance(reporter, n)
        assert len(spy.reads) == before, "a progress update read a tensor"

    monkeypatch.setattr(loop._Run, "train_step", counted_step)
    monkeypatch.setattr(progress.Reporter, "advance", counted_advance)
    job = replace(make_job(tmp_path, epochs=1, log_every=4), show_progress=True)
    train_local(job)
    assert sorted(reads) == list(range(1, 9))
    assert [s for s, n in reads.items() if n] == [4, 8]  # the log_every flushes only
    assert len([line for line in capsys.readouterr().err.splitlines() if "ETA" in line]) == 7


@pytest.mark.parametrize("select_by", ["valid_loss", "mrr"])
def test_the_selector_keeps_an_evaluation_better_by_more_than_min_delta(select_by: str) -> None:
    """Loss: lower by more than ``min_delta`` improves; a score: higher by more. The kept
    evaluation's loss is recorded either way, its score only where the run selects on one."""
    from pipeline.train.checkpoint import Progress

    params = RunParams.model_validate({"select_by": select_by, "min_delta": 0.5})
    selector = loop.Selector.of(params)
    progress = Progress(step=7)
    first = selector.best(progress)
    assert first == (-math.inf if selector.reads_score else math.inf)
    assert selector.improves(3.0, first)
    selector.keep(progress, loss=2.0, value=3.0)
    assert (progress.best_step, progress.best_loss, progress.bad_evals) == (7, 2.0, 0)
    best = selector.best(progress)
    assert best == 3.0 if selector.reads_score else best == 2.0
    better, equal = (best + 0.6, best + 0.5) if selector.reads_score else (best - 0.6, best - 0.5)
    assert selector.improves(better, best) and not selector.improves(equal, best)
    expected = {"best_valid_loss": 2.0}
    if selector.reads_score:
        expected["best_valid_score"] = 3.0
    assert selector.best_metrics(progress) == expected
    assert selector.shown(2.0, 3.0) == (
        "valid loss 2, valid_score 3" if selector.reads_score else "valid loss 2"
    )
