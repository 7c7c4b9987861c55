"""In-process training (``train.scale.num_workers: 0``) under a storage URI: checkpoints go
to the bucket, two deep, and a run resumes from there exactly as from a local folder,
against a real S3 API (moto on 127.0.0.1, the ``s3`` fixture)."""

from __future__ import annotations

import io
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.config import PlacementParams
from pipeline.errors import ConfigError
from pipeline.train.checkpoint import CHECKPOINT_FILE, TrainingState
from pipeline.train.context import PREVIOUS_FILE
from pipeline.train.distributed import fit, resume_step
from pipeline.train.loop import train_local
from tests.s3_server import S3Server
from tests.train.test_loop import ListSink, make_job, run_killable

REPO = Path(__file__).resolve().parents[2]
_RESUMED = {"dropout": 0.3, "checkpoint_every": 3, "eval_every": 5, "epochs": 2}


def _state(s3: S3Server, bucket: str, key: str) -> TrainingState:
    return TrainingState.read(f"s3://{bucket}/{key}", opened=io.BytesIO(s3.get(bucket, key)))


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return TrainingState.read(folder / CHECKPOINT_FILE).model


def _no_local_uri_folder(*folders: Path) -> None:
    """Nothing written to a local folder named after the URI (``Path`` makes
    ``s3://b/x`` the relative folder ``s3:/b/x``)."""
    for folder in folders:
        assert not [p for p in folder.iterdir() if p.name.startswith("s3")], folder


def test_an_in_process_run_checkpoints_to_the_bucket_and_resumes_from_it(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    bucket = s3.new_bucket()
    storage = f"s3://{bucket}/ray"
    full = train_local(make_job(tmp_path / "local", **_RESUMED))

    killed = replace(make_job(tmp_path, sink=ListSink([], fail_at=8), **_RESUMED), run_dir=storage)
    with pytest.raises(KeyboardInterrupt):
        train_local(killed)
    assert s3.keys(bucket) == sorted([f"ray/run/{CHECKPOINT_FILE}", f"ray/run/{PREVIOUS_FILE}"])
    assert _state(s3, bucket, f"ray/run/{CHECKPOINT_FILE}").position.step == 6
    assert _state(s3, bucket, f"ray/run/{PREVIOUS_FILE}").position.step == 3
    assert resume_step("run", 0, storage) == 6
    _no_local_uri_folder(tmp_path, REPO)

    # a torn newest object: the one before resumes, as on a local disk
    newest = s3.get(bucket, f"ray/run/{CHECKPOINT_FILE}")
    s3.put(bucket, f"ray/run/{CHECKPOINT_FILE}", newest[: len(newest) // 2])
    passing = rf"passing over a checkpoint.*s3://{bucket}/ray/run/checkpoint\.pt: unreadable"
    with pytest.warns(UserWarning, match=passing):
        assert resume_step("run", 0, storage) == 3
    job = replace(make_job(tmp_path, **_RESUMED), run_dir=storage)
    with pytest.warns(UserWarning, match=passing):
        result = fit(job, 0, PlacementParams(), storage)
    assert result.checkpoint == f"{storage}/run/{CHECKPOINT_FILE}"
    assert result.metrics == full
    for k, v in _weights(tmp_path / "local" / "run").items():
        assert torch.equal(v, result.state.model[k]), k
    assert s3.keys(bucket) == sorted([f"ray/run/{CHECKPOINT_FILE}", f"ray/run/{PREVIOUS_FILE}"])
    _no_local_uri_folder(tmp_path, REPO)


def test_a_missing_bucket_is_refused_before_training_naming_the_setting(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIERTX_STORAGE_PATH", "s3://no-such-bucket/ray")
    job = replace(make_job(tmp_path), run_dir="s3://no-such-bucket/ray")
    with pytest.raises(ConfigError, match="s3://no-such-bucket does not exist") as caught:
        train_local(job)
    assert caught.value.key == "$HIERTX_STORAGE_PATH"


@pytest.mark.slow
def test_a_sigkilled_in_process_run_resumes_from_the_bucket_to_the_same_result(
    s3: S3Server, tmp_path: Path
) -> None:
    """A process killed (SIGKILL: no handler, no flush) after its checkpoints went to the
    bucket: a new process resumes from them and ends as the uninterrupted run does."""
    bucket = s3.new_bucket()
    storage = f"s3://{bucket}/ray"
    full = run_killable(tmp_path / "local", 0)
    assert full.returncode == 0, full.stderr
    # mid-epoch 2 (8 batches/epoch), after step 10's checkpoint
    killed = run_killable(storage, 12)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _state(s3, bucket, f"ray/run/{CHECKPOINT_FILE}").position.step == 10
    assert _state(s3, bucket, f"ray/run/{PREVIOUS_FILE}").position.step == 8
    resumed = run_killable(storage, 0)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[-1] == full.stdout.splitlines()[-1]
    final = _state(s3, bucket, f"ray/run/{CHECKPOINT_FILE}").model
    for k, v in _weights(tmp_path / "local" / "run").items():
        assert torch.equal(v, final[k]), k
    _no_local_uri_folder(REPO)
