"""Checkpoint files (``TrainingState``): atomic writes, weights-only loads, a format that
is checked when read, and clear errors that name the file."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline.artifacts import SavedModel, files
from pipeline.errors import DataError
from pipeline.names import Task
from pipeline.train.checkpoint import Progress, TrainingState
from tests.train.helpers import toy_state


def assert_same_state(got: TrainingState, want: TrainingState) -> None:
    """Every field of ``got`` equals ``want``'s (tensors elementwise, nested states too)."""
    for name in want.__dataclass_fields__:
        assert_same(getattr(got, name), getattr(want, name), name)


def assert_same(got: object, want: object, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_roundtrip_with_progress_and_tensors(tmp_path):
    progress = Progress(step=7, epoch=1, batch_in_epoch=3, best_loss=2.5, bad_evals=1)
    state = toy_state(progress)
    path = state.write(tmp_path / "c.pt")
    back = TrainingState.read(path)
    assert back.position == progress
    assert_same_state(back, state)
    assert back.optimizer["state"], "the optimizer's moments are kept"
    # a plain dict of tensors and plain values, versioned: loads without unpickling code
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == TrainingState.FORMAT and raw["progress"]["step"] == 7


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    path = toy_state(Progress(step=1)).write(tmp_path / "c.pt")
    real_save = torch.save

    def torn_save(obj, f):
        real_save(obj, f)
        f.truncate(10)  # half-written ...
        raise OSError("disk full")  # ... then the write fails

    monkeypatch.setattr(files.torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        toy_state(Progress(step=2)).write(path)
    monkeypatch.undo()
    assert TrainingState.read(path).position.step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


class Payload:
    """Any class: unpickling it could run code, so weights-only loading refuses it."""


def test_loading_refuses_pickled_code_and_foreign_files(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({**toy_state().to_dict(), "metrics": Payload()}, evil)
    with pytest.raises(DataError, match=r"evil\.pt: unreadable \(") as caught:
        TrainingState.read(evil)
    # torch's advice for such a file (weights_only=False) would run its code: never given
    assert "weights_only" not in str(caught.value)
    assert "training checkpoint" in str(caught.value)

    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(1)}, other)
    with pytest.raises(DataError, match=r"other\.pt: format None, expected 3: a training"):
        TrainingState.read(other)
    listed = tmp_path / "list.pt"
    torch.save([torch.ones(1)], listed)
    with pytest.raises(DataError, match=r"list\.pt: not a hiertx file"):
        TrainingState.read(listed)
    (tmp_path / "torn.pt").write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(DataError, match=r"torn\.pt: unreadable \(\w+: truncated, corrupt"):
        TrainingState.read(tmp_path / "torn.pt")
    with pytest.raises(DataError, match=r"missing\.pt: missing: a training checkpoint"):
        TrainingState.read(tmp_path / "missing.pt")


def test_another_format_or_a_missing_or_renamed_field_fails_naming_the_file(tmp_path):
    content = toy_state().to_dict()
    path = tmp_path / "old.pt"
    # the dict checkpoints before TrainingState (format 1): the same keys, unchecked
    torch.save({**content, "format": 1}, path)
    with pytest.raises(DataError, match=r"old\.pt: format 1, expected 3: a training checkpoint"):
        TrainingState.read(path)
    missing = {k: v for k, v in content.items() if k != "rng"}
    with pytest.raises(DataError, match=r"c\.pt: fields missing \['rng'\], unknown \[\]") as err:
        TrainingState.from_dict(missing, tmp_path / "c.pt")
    assert err.value.path == str(tmp_path / "c.pt")
    renamed = {**missing, "rng": content["rng"], "best_weights": content["best_model"]}
    del renamed["best_model"]
    with pytest.raises(
        DataError, match=r"fields missing \['best_model'\], unknown \['best_weights'\]"
    ):
        TrainingState.from_dict(renamed, path)
    # an exported model is a record of another kind: not a checkpoint either
    exported = toy_state().exported({}, "run").write(tmp_path / "model.pt")
    with pytest.raises(DataError, match=r"model\.pt: format 2, expected 3: a training"):
        TrainingState.read(exported)
    with pytest.raises(DataError, match=r"c\.pt: format 3, expected 2: an exported model"):
        SavedModel.read(toy_state().write(tmp_path / "c.pt"))


def test_the_export_holds_the_best_weights_or_the_last_when_none_was_kept(tmp_path):
    state = toy_state()
    assert not torch.equal(state.model["out.weight"], state.best_model["out.weight"])
    saved = state.exported({"best_valid_loss": 3.0}, "train-toy-abc")
    assert (saved.model_name, saved.task, saved.run_name) == ("toy", Task.GENERATE, "train-toy-abc")
    assert saved.model_config == state.model_config and saved.metrics == {"best_valid_loss": 3.0}
    assert_same(saved.weights, state.best_model, "weights")
    back = SavedModel.read(saved.write(tmp_path / "model.pt"))
    assert_same(back.weights, state.best_model, "weights")
    assert back.task == "generate" and back.run_name == "train-toy-abc"
    last = replace(state, best_model=None).exported({}, "r")
    assert_same(last.weights, state.model, "weights")
