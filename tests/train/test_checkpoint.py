"""Checkpoint files: atomic writes, weights-only loads, clear errors."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import DataError
from pipeline.train import checkpoint as ckpt
from pipeline.train.checkpoint import Progress, load_checkpoint, save_checkpoint


def test_roundtrip_with_progress_and_tensors(tmp_path):
    progress = Progress(step=7, epoch=1, batch_in_epoch=3, best_loss=2.5, bad_evals=1)
    path = save_checkpoint(
        {"progress": progress.to_dict(), "w": torch.arange(3.0)}, tmp_path / "c.pt"
    )
    state = load_checkpoint(path)
    assert Progress.from_dict(state["progress"]) == progress
    assert torch.equal(state["w"], torch.arange(3.0))


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    path = save_checkpoint({"step": 1}, tmp_path / "c.pt")
    real_save = torch.save

    def torn_save(obj, f):
        real_save(obj, f)
        f.truncate(10)  # half-written ...
        raise OSError("disk full")  # ... then the write fails

    monkeypatch.setattr(ckpt.torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"step": 2}, path)
    assert load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


class Payload:
    """Any class: unpickling it could run code, so weights-only loading refuses it."""


def test_loading_refuses_pickled_code_and_foreign_files(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"format": 1, "x": Payload()}, evil)
    with pytest.raises(DataError, match="not a readable checkpoint"):
        load_checkpoint(evil)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(1)}, other)
    with pytest.raises(DataError, match="not a hiertx checkpoint"):
        load_checkpoint(other)
    (tmp_path / "torn.pt").write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(DataError, match=r"torn\.pt: not a readable checkpoint"):
        load_checkpoint(tmp_path / "torn.pt")
    with pytest.raises(DataError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "missing.pt")
