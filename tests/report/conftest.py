"""Hand-made evaluate/train outputs in the contract's format, and a tiny tokenized chitchat."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.artifacts import (
    PER_EXAMPLE_FILE,
    ExampleResult,
    Layout,
    MlflowRef,
    write_examples,
    write_metrics,
)
from pipeline.config import parse_params
from pipeline.data.tokenize import tokenize_corpus
from pipeline.models import registry
from tests.trained import write_trained

TOKENIZE = {
    "corpora": {
        "chitchat": {
            "tasks": ["generate", "select", "lm"],
            "max_dialogues": 30,
            "vocab": {"size": 300},
            "split": {"valid": 0.2, "test": 0.2},
            "generate": {"max_history": 40, "max_utterances": 4, "max_response": 12},
            "select": {"n_candidates_eval": 10, "max_candidate": 12},
        }
    }
}

# Tiny configs: the report rebuilds each model to count its parameters.
TINY = {
    "transformer": {
        "d_model": 16,
        "n_encoder_layers": 1,
        "n_decoder_layers": 1,
        "n_heads": 2,
        "d_head": 8,
        "d_ff": 32,
    },
    "unet": {"d_model": 16, "n_layers": 4, "n_decoder_layers": 1, "n_heads": 2, "d_head": 8},
    "transformer_ranker": {"d_embed": 16, "d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1},
    "hrt_last": {"d_embed": 16, "d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1},
    "gpt": {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32},
    "congruent_gpt": {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32},
    "hier": {
        "d_model": 16,
        "d_ff": 32,
        "n_heads": 2,
        "n_utterance_layers": 1,
        "n_context_layers": 1,
        "n_decoder_layers": 1,
    },
}
VOCAB = 50


@pytest.fixture(scope="session")
def shards_project(tmp_path_factory) -> Path:
    """A project folder holding a real (tiny) ``data/shards/chitchat``."""
    root = tmp_path_factory.mktemp("report-project")
    tokenize_corpus(
        "chitchat",
        None,
        root / "data" / "shards" / "chitchat",
        parse_params({"tokenize": TOKENIZE}),
    )
    return root


def write_run(
    root: Path,
    model: str,
    rows: list[dict],
    metrics: dict,
    corpus: str = "chitchat",
    train_metrics: dict | None = None,
    mlflow: MlflowRef | None = None,
    variant: str | None = None,
) -> str:
    """A run's train record and model, evaluation rows and metrics, written through the
    stage contract; ``rows`` are :class:`ExampleResult` fields."""
    net = registry.build(model, VOCAB, **TINY[model])
    key = write_trained(root, model, net, corpus, train_metrics, mlflow, variant)
    layout = Layout(root)
    write_metrics(layout.metrics(key), metrics)
    write_examples(layout.eval_out(key) / PER_EXAMPLE_FILE, [ExampleResult(**r) for r in rows])
    return key


def lm_rows(nll: list[list[float]], tokens: int = 10) -> list[dict]:
    """Rows of ``len(nll)`` seeds x ``len(nll[0])`` examples with the given nll sums."""
    return [
        {"seed": s, "id": f"d{i}#1", "nll_sum": v, "n_tokens": tokens, "history_tokens": 5 + i}
        for s, seed_values in enumerate(nll)
        for i, v in enumerate(seed_values)
    ]


def params_for(models: list[str], tuned: list[str] = (), **sections):
    """Checked params (as a stage reads them) training ``models`` (and tuning ``tuned``)
    on chitchat."""
    from pipeline.plan import checked

    raw = {
        "tokenize": TOKENIZE,
        "train": {"runs": {f"{m}-chitchat": {"model": m, "corpus": "chitchat"} for m in models}},
        "tune": {
            "runs": {f"{m}-chitchat": {"model": m, "corpus": "chitchat"} for m in tuned},
            "spaces": {
                m: {"model": {"dropout": {"kind": "float", "low": 0, "high": 0.5}}} for m in tuned
            },
        },
        **sections,
    }
    return checked(raw)
