"""Ray Train: DDP on 2 CPU workers (gloo) takes the same steps as one worker with the same
global batch; a 1-worker Ray run equals the in-process run; a rerun resumes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.config import RunParams, ScaleParams
from pipeline.train.distributed import fit, has_checkpoint, ray_cluster, storage_path
from pipeline.train.loop import TrainJob
from tests.train.helpers import PoolFactory, ToyFactory

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(num_cpus=2):
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
    return result.load()["model"]


def test_storage_path_is_absolute(tmp_path, monkeypatch):
    monkeypatch.delenv("HIERTX_STORAGE_PATH", raising=False)
    assert storage_path(ScaleParams(), "rel") == str(Path("rel/runs/ray").resolve())
    assert (
        storage_path(ScaleParams(storage_path="s3://bucket/runs"), tmp_path) == "s3://bucket/runs"
    )


def test_two_workers_match_one_and_ray_matches_local(tmp_path, cluster):
    job = _job(tmp_path, "local")
    in_process, on_ray = ScaleParams(num_workers=0), ScaleParams(num_workers=1)
    assert not has_checkpoint("local", in_process, str(tmp_path))
    assert not has_checkpoint("ray1", on_ray, str(tmp_path))
    local = fit(job, ScaleParams(num_workers=0), str(tmp_path))
    one = fit(replace(job, name="ray1"), ScaleParams(num_workers=1), str(tmp_path))
    # what the train stage asks before it picks the MLflow run (a resume goes on in its run)
    assert has_checkpoint("local", in_process, str(tmp_path))
    assert has_checkpoint("ray1", on_ray, str(tmp_path))
    assert not has_checkpoint("ray1", in_process, str(tmp_path))
    two = fit(replace(job, name="ray2"), ScaleParams(num_workers=2), str(tmp_path))
    assert local.metrics["steps"] == one.metrics["steps"] == two.metrics["steps"] == 6
    assert one.metrics == local.metrics
    for k, v in _weights(local).items():
        assert torch.equal(v, _weights(one)[k]), k
        assert torch.allclose(v, _weights(two)[k], atol=1e-5, rtol=1e-4), k
    assert two.metrics["best_valid_loss"] == pytest.approx(
        local.metrics["best_valid_loss"], rel=1e-5
    )
    assert len(two.load()["rng"]) == 2  # every rank's RNG state is kept
    # the same name resumes from the final checkpoint: nothing more to do, same result
    again = fit(replace(job, name="ray1"), ScaleParams(num_workers=1), str(tmp_path))
    assert again.metrics == one.metrics and again.checkpoint != one.checkpoint
