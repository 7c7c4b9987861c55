"""RNG state capture: a restored state replays the same draws, through a weights-only file."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import torch

from pipeline.train.checkpoint import TrainingState
from pipeline.train.seed import rng_state, seed_everything, set_rng_state
from tests.train.helpers import toy_state


def _draws() -> tuple:
    return (random.random(), random.gauss(0, 1), float(np.random.rand()), torch.rand(3).tolist())


def test_restored_state_replays_every_generator(tmp_path):
    seed_everything(3)
    _draws()
    state = replace(toy_state(), rng=[rng_state()])  # a checkpoint holds every rank's
    path = state.write(tmp_path / "rng.pt")
    expected = [_draws() for _ in range(3)]
    seed_everything(99)  # move every generator elsewhere
    set_rng_state(TrainingState.read(path).rng[0])
    assert [_draws() for _ in range(3)] == expected


def test_seeds_differ_per_value():
    seed_everything(1)
    a = _draws()
    seed_everything(2)
    assert _draws() != a
    seed_everything(1)
    assert _draws() == a
