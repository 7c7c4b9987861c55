"""Seeding and RNG state capture, so a resumed run draws the same random numbers.

States are returned as tensors and plain ints only, so a checkpoint holding them loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import Tensor

from pipeline.machine import has_gpu


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every GPU) global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, object]:
    """The state of every global generator the training loop touches."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, object] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": int(version),
            "state": torch.tensor(mt, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }
    if has_gpu():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, object]) -> None:
    """Restore generators from :func:`rng_state` (CUDA only if saved and present)."""
    torch.set_rng_state(_cpu_bytes(state["torch"]))
    py = state["python"]
    assert isinstance(py, dict)
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    assert isinstance(npy, dict)
    np.random.set_state(
        (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached"],
        )
    )
    cuda = state.get("cuda")
    if cuda is not None and has_gpu():
        torch.cuda.set_rng_state_all([_cpu_bytes(s) for s in cuda])  # type: ignore[union-attr]


def _cpu_bytes(value: object) -> Tensor:
    assert isinstance(value, Tensor)
    return value.to("cpu", torch.uint8)
