"""Ray Train: DDP on 2 CPU workers (gloo) takes the same steps as one worker with the same
global batch; a 1-worker Ray run equals the in-process run; a rerun resumes, from the
checkpoint before the newest when that one is torn; a worker's own error (a diverged run,
no intact checkpoint) reaches the stage as itself."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline import cluster as cluster_module
from pipeline.cluster import free_port, ray_cluster, storage_path, use_gpu
from pipeline.config import PlacementParams, RunParams
from pipeline.errors import DataError, TrainingDiverged
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.distributed import fit, project_error, resume_step
from pipeline.train.loop import TrainJob
from tests.train.helpers import DivergingFactory, PoolFactory, ToyFactory


@pytest.fixture
def cluster(on_ray_head: None) -> Iterator[None]:
    """The session's Ray instance (2 CPUs, ``tests/conftest.py``), joined for the test."""
    with ray_cluster():
        yield


def _job(tmp: Path, name: str) -> TrainJob:
    params = RunParams(
        epochs=2, batch_size=4, max_steps=6, eval_every=3, patience=None, seed=5, log_every=1
    )
    return TrainJob(
        name=name,
        model_name="toy",
        model=ToyFactory(d_model=8),
        data=PoolFactory(n_train=16, n_valid=8, global_batch=4, valid_from_train=True),
        params=params.model_copy(
            update={"optimizer": params.optimizer.model_copy(update={"lr": 0.05})}
        ),
        run_dir=str(tmp),
        show_progress=False,
    )


def _weights(result) -> dict[str, torch.Tensor]:
    return result.state.model


def test_storage_path_is_absolute(tmp_path, monkeypatch):
    monkeypatch.delenv("HIERTX_STORAGE_PATH", raising=False)
    assert storage_path(PlacementParams(), "rel") == str(Path("rel/runs/ray").resolve())
    assert (
        storage_path(PlacementParams(storage_path="s3://bucket/runs"), tmp_path)
        == "s3://bucket/runs"
    )
    monkeypatch.setenv("HIERTX_STORAGE_PATH", "elsewhere")
    assert storage_path(PlacementParams(), tmp_path) == str(Path("elsewhere").resolve())
    assert storage_path(PlacementParams(storage_path=str(tmp_path / "p")), "x") == str(
        tmp_path / "p"
    )


def test_a_free_port_is_none_of_rays_default_ports(monkeypatch):
    drawn = iter([52365, 8265, 6379, 40123])  # what the OS hands out, in turn

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def bind(self, address):
            self.port = next(drawn)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(cluster_module.socket, "socket", Socket)
    assert free_port() == 40123


def test_workers_take_a_gpu_as_params_say_else_when_there_is_one():
    assert use_gpu(PlacementParams(use_gpu=True)) is True
    assert use_gpu(PlacementParams(use_gpu=False)) is False
    assert use_gpu(PlacementParams()) is torch.cuda.is_available()


def test_a_workers_own_error_is_found_inside_what_ray_raises():
    diverged = TrainingDiverged("train x diverged at step 3: the training loss is not finite")
    worker = RuntimeError("rank 0 failed")
    worker.__cause__ = diverged
    group = RuntimeError("training failed")
    group.worker_failures = {0: worker}  # Ray Train's WorkerGroupError
    group.__context__ = group  # a cycle is walked once
    assert project_error(group) is diverged
    unreadable = DataError("/runs/x", "no intact checkpoint to resume from")
    several = RuntimeError("errors")
    several.errors = [ValueError("other"), unreadable]  # an exception group's
    assert project_error(several) is unreadable
    bug = RuntimeError("a bug")
    bug.__cause__ = ValueError("inner")
    assert project_error(bug) is None


def _checkpoints(storage: Path, name: str) -> list[Path]:
    """The checkpoint files Ray Train keeps of run ``name``, newest first."""
    return sorted((storage / name).glob(f"checkpoint_*/{CHECKPOINT_FILE}"), reverse=True)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_two_workers_match_one_and_ray_matches_local(tmp_path, cluster):
    job = _job(tmp_path, "local")
    placement, storage = PlacementParams(), str(tmp_path)
    assert resume_step("local", 0, storage) is None
    assert resume_step("ray1", 1, storage) is None
    local = fit(job, 0, placement, storage)
    one = fit(replace(job, name="ray1"), 1, placement, storage)
    # what the train stage asks before it picks the MLflow run (a resume goes on in its run)
    assert resume_step("local", 0, storage) == 6
    assert resume_step("ray1", 1, storage) == 6
    assert resume_step("ray1", 0, storage) is None
    assert resume_step("local", 1, storage) is None
    two = fit(replace(job, name="ray2"), 2, placement, storage)
    assert local.metrics["steps"] == one.metrics["steps"] == two.metrics["steps"] == 6
    assert one.metrics == local.metrics
    for k, v in _weights(local).items():
        assert torch.equal(v, _weights(one)[k]), k
        assert torch.allclose(v, _weights(two)[k], atol=1e-5, rtol=1e-4), k
    assert two.metrics["best_valid_loss"] == pytest.approx(
        local.metrics["best_valid_loss"], rel=1e-5
    )
    assert len(two.state.rng) == 2  # every rank's RNG state is kept
    # the result's checkpoint is the state it holds, in the run's storage
    assert Path(one.checkpoint).is_relative_to(tmp_path / "ray1")
    assert TrainingState.read(one.checkpoint).position == one.state.position
    assert local.checkpoint == str(tmp_path / "local" / CHECKPOINT_FILE)
    # the same name resumes from the final checkpoint: nothing more to do, same result
    again = fit(replace(job, name="ray1"), 1, placement, storage)
    assert again.metrics == one.metrics and again.checkpoint != one.checkpoint


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_a_torn_ray_checkpoint_resumes_from_the_one_before_and_none_intact_fails(tmp_path, cluster):
    """One finished Ray run, torn twice: its newest checkpoint (the run resumes from the one
    before, to the same weights), then every checkpoint (the stage says how to start over).
    Two tests once, merged: each began with the same run."""
    job = replace(_job(tmp_path, "torn"), restart="rm -r <run> && dvc repro train@toy")
    placement, storage = PlacementParams(), str(tmp_path)
    whole = fit(job, 1, placement, storage)
    # kept two deep: the epoch's end (step 4) and the final one (step 6)
    newest, before = _checkpoints(tmp_path, "torn")
    assert TrainingState.read(before).position.step == 4
    assert TrainingState.read(newest).position.step == 6
    newest.write_bytes(newest.read_bytes()[:100])  # a copy cut short
    with pytest.warns(UserWarning, match="passing over a checkpoint"):
        assert resume_step("torn", 1, storage) == 4  # what the stage announces
    resumed = fit(job, 1, placement, storage)  # from step 4: two more steps
    assert resumed.metrics == whole.metrics
    for k, v in _weights(whole).items():
        assert torch.equal(v, _weights(resumed)[k]), k

    for path in _checkpoints(tmp_path, "torn"):
        path.write_bytes(b"torn")
    # what the stage asks first (to announce the step it resumes from) says so
    with (
        pytest.warns(UserWarning, match="passing over a checkpoint"),
        pytest.raises(DataError, match="start the run over: rm -r <run> && dvc repro"),
    ):
        resume_step("torn", 1, storage, job.restart)
    # and so does the training itself: the worker's own error, not Ray's wrapper of it
    with pytest.raises(DataError, match="start the run over: rm -r <run> && dvc repro") as err:
        fit(job, 1, placement, storage)
    assert "no intact checkpoint to resume from" in str(err.value)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_a_diverged_ray_run_fails_with_its_own_error(tmp_path, cluster):
    job = replace(_job(tmp_path, "nan"), model=DivergingFactory(at=2, what="loss"))
    with pytest.raises(TrainingDiverged, match="nan diverged at step 2: the training loss"):
        fit(job, 1, PlacementParams(), str(tmp_path))
