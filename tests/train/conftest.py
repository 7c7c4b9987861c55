"""A tiny tokenized chitchat corpus for the train/tune stage tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import parse_params
from pipeline.data.tokenize import tokenize_corpus

TOKENIZE = {
    "corpora": {
        "chitchat": {
            "tasks": ["generate", "lm"],
            "max_dialogues": 30,
            "vocab": {"size": 300},
            "split": {"valid": 0.2, "test": 0.1},
            "generate": {"max_history": 40, "max_utterances": 4, "max_response": 12},
        }
    }
}

TINY_TRANSFORMER = {
    "d_model": 16,
    "n_encoder_layers": 1,
    "n_decoder_layers": 1,
    "n_heads": 2,
    "d_head": 8,
    "d_ff": 32,
}


def tokenized(root: Path, tokenize: dict | None = None) -> Path:
    """``root`` holding ``data/shards/chitchat`` tokenized as ``tokenize`` says (default
    :data:`TOKENIZE`: about 400 train examples)."""
    tokenize_corpus(
        "chitchat",
        None,
        root / "data" / "shards" / "chitchat",
        parse_params({"tokenize": tokenize or TOKENIZE}),
    )
    return root


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Path:
    """A project folder holding ``data/shards/chitchat`` (about 400 train examples)."""
    return tokenized(tmp_path_factory.mktemp("project"))


def stage_params(**sections) -> dict:
    """params.yaml content for a tiny run of ``transformer`` on chitchat."""
    raw = {
        "tokenize": TOKENIZE,
        "train": {
            "defaults": {
                "epochs": 2,
                "batch_size": 16,
                "max_batches_per_epoch": 3,
                "patience": None,
                "log_every": 1,
                "optimizer": {"lr": 0.003},
            },
            "models": {"transformer": {"model": TINY_TRANSFORMER}},
            "runs": {"transformer-chitchat": {"model": "transformer", "corpus": "chitchat"}},
        },
        "tracking": {"sample_generations": 2},
    }
    for name, value in sections.items():
        raw[name] = {**raw.get(name, {}), **value}
    return raw
