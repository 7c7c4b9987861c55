"""The pyfunc's text -> batch -> answer path (fast, without MLflow), its signature and input
example, and logging and loading it without MLflow's type-hint warning."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from pipeline.artifacts import SavedModel
from pipeline.data.special import BOS_ID, EOS_ID, SPEAKER_OTHER, SPEAKER_SELF, SPECIAL_TOKENS
from pipeline.data.vocab import Vocab
from pipeline.decode import DecodeConfig
from pipeline.models import registry
from pipeline.serving import (
    HiertxModel,
    RequestError,
    ServingSpec,
    encode_histories,
    input_example,
    lm_batch,
    model_signature,
    select_batch,
)

WORDS = [
    "hi",
    "there",
    "how",
    "are",
    "you",
    "fine",
    "thanks",
    "what",
    "about",
    "the",
    "weather",
    "today",
    "is",
    "nice",
]


REPO = Path(__file__).resolve().parents[1]
TINY = {
    "transformer": dict(
        d_model=16, n_encoder_layers=1, n_decoder_layers=1, n_heads=2, d_head=8, d_ff=32
    ),
    "dual_lstm": dict(d_embed=8, d_hidden=8),
    "gpt": dict(d_model=16, n_heads=2, n_layers=1, d_ff=32),
}


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return Vocab([*SPECIAL_TOKENS, *WORDS])


def export(model: torch.nn.Module, name: str, task: str, path: Path) -> Path:
    """``model`` exported as the train stage exports it."""
    config = model.config.model_dump(mode="json")
    return SavedModel(name, config, task, model.state_dict()).write(path)


def tiny_checkpoint(folder: str | Path) -> tuple[Path, Path]:
    """A tiny (untrained) transformer, exported, and its vocabulary."""
    folder = Path(folder)
    vocab = Vocab([*SPECIAL_TOKENS, *WORDS])
    model = registry.build("transformer", len(vocab), **TINY["transformer"])
    vocab.save(folder / "vocab.json")
    return export(model, "transformer", "generate", folder / "model.pt"), folder / "vocab.json"


def _uri(folder: Path) -> str:
    return f"sqlite:///{folder / 'mlflow.db'}"


def _served(tmp_path, vocab, name, task, **config) -> HiertxModel:
    torch.manual_seed(0)
    model = registry.build(name, len(vocab), **config)
    ckpt = export(model, name, task, tmp_path / "model.pt")
    vocab.save(tmp_path / "vocab.json")
    spec = tmp_path / "serving.json"
    spec.write_text(json.dumps({"task": task, "max_history": 12, "max_utterances": 3}))
    served = HiertxModel()
    served.load(ckpt, tmp_path / "vocab.json", spec)
    return served


def test_histories_keep_the_most_recent_tokens_and_alternate_speakers(vocab):
    spec = ServingSpec("generate", max_history=9, max_utterances=3)
    h = encode_histories([["hi there", "how are you", "fine thanks"], ["hi"]], vocab, spec)
    # 4 utterances of 4 tokens > 9: only the last two are kept (oldest dropped whole)
    first = h.input_ids[0][h.input_mask[0]].tolist()
    assert first == [
        BOS_ID,
        *vocab.encode("how are you"),
        EOS_ID,
        BOS_ID,
        *vocab.encode("fine thanks"),
        EOS_ID,
    ]
    assert h.utt_index[0][h.input_mask[0]].tolist() == [0] * 5 + [1] * 4
    assert h.utt_pos[0][:5].tolist() == [0, 1, 2, 3, 4]
    # the response speaker is "self": the last utterance is the other party's
    assert h.speaker[0][h.input_mask[0]].tolist() == [SPEAKER_SELF] * 5 + [SPEAKER_OTHER] * 4
    assert h.input_mask[1].sum() == 3 and not h.input_mask[1][3:].any()


def test_a_spec_takes_the_corpus_tokenize_limits():
    from pipeline.config import CorpusParams
    from pipeline.names import Task

    corpus = CorpusParams.model_validate(
        {
            "generate": {"max_history": None, "max_utterances": 4, "max_response": 12},
            "select": {"max_candidate": 9},
            "lm": {"max_sentence": 16},
        }
    )
    spec = ServingSpec.of(Task.SELECT, corpus)
    assert spec == ServingSpec(
        "select",
        max_history=None,
        max_utterances=4,
        max_response=12,
        max_candidate=9,
        max_sentence=16,
    )


def test_lm_pyfunc_returns_per_document_perplexity(tmp_path, vocab):
    served = _served(tmp_path, vocab, "gpt", "lm", d_model=16, n_heads=2, n_layers=1, d_ff=32)
    docs = [["hi there", "how are you today"], ["the weather is nice"]]
    ppl = served.predict(None, pd.DataFrame({"document": docs}))
    for doc, value in zip(docs, ppl, strict=True):
        batch = lm_batch([doc], served.vocab, served.spec)
        with torch.no_grad():
            out = served.model.loss(batch)
        assert value == pytest.approx(math.exp(float(out.nll_sum / out.n_tokens)), rel=1e-5)
    assert 1.0 < ppl[0] < 10 * len(vocab)


def test_select_pyfunc_scores_each_candidate_independently_of_padding(tmp_path, vocab):
    served = _served(tmp_path, vocab, "dual_lstm", "select", d_embed=8, d_hidden=8)
    rows = [
        {
            "history": ["hi there", "how are you"],
            "candidates": ["fine thanks", "the weather", "hi"],
        },
        {"history": ["what about today"], "candidates": ["nice"]},
    ]
    scores = served.predict(None, rows)
    assert [len(s) for s in scores] == [3, 1]
    alone = served.predict(None, rows[1:])
    assert alone[0] == pytest.approx(scores[1], abs=1e-5)
    batch = select_batch([rows[0]["history"]], [rows[0]["candidates"]], served.vocab, served.spec)
    with torch.no_grad():
        assert scores[0] == pytest.approx(served.model.score(batch)[0].tolist(), abs=1e-5)
    with pytest.raises(RequestError, match=r"^row 1: column 'candidates' is empty"):
        served.predict(None, [rows[0], {"history": ["hi"], "candidates": []}])


def test_generate_pyfunc_needs_a_history_column(tmp_path, vocab):
    served = _served(
        tmp_path,
        vocab,
        "transformer",
        "generate",
        d_model=16,
        n_encoder_layers=1,
        n_decoder_layers=1,
        n_heads=2,
        d_head=8,
        d_ff=32,
    )
    answers = served.predict(None, [{"history": ["hi there", "how are you"]}], {"max_length": 5})
    assert len(answers) == 1 and len(answers[0].split()) <= 5
    with pytest.raises(RequestError, match=r"^row 0: missing column 'history' .*given: 'text'$"):
        served.predict(None, [{"text": "hi"}])
    with pytest.raises(RequestError, match=r"^row 0: column 'history' is str 'hi'; valid: a list"):
        served.predict(None, [{"history": "hi"}])  # not read as the utterances "h", "i"
    with pytest.raises(RequestError, match=r"^params.strategy: 'bogus' is not valid; valid values"):
        served.predict(None, [{"history": ["hi"]}], {"strategy": "bogus"})
    with pytest.raises(RequestError, match=r"^params: unknown param 'beam'; valid params: strat"):
        served.predict(None, [{"history": ["hi"]}], {"beam": 3})  # MLflow's server drops it


@pytest.mark.parametrize(
    ("name", "task", "config", "columns", "output"),
    [
        ("transformer", "generate", TINY["transformer"], ["history"], {"type": "string"}),
        (
            "dual_lstm",
            "select",
            TINY["dual_lstm"],
            ["history", "candidates"],
            {"type": "array", "items": {"type": "double"}},
        ),
        ("gpt", "lm", TINY["gpt"], ["document"], {"type": "double"}),
    ],
)
def test_signature_and_input_example_say_what_each_task_takes(
    tmp_path, vocab, name, task, config, columns, output
):
    spec = ServingSpec(task, max_response=7)
    signature = model_signature(spec)
    texts = {"type": "array", "items": {"type": "string"}, "required": True}
    saved = signature.to_dict()  # what the MLmodel file (and the model's page) shows
    assert json.loads(saved["inputs"]) == [{**texts, "name": c} for c in columns]
    assert json.loads(saved["outputs"]) == [{**output, "required": True}]
    if task == "generate":  # every decoding knob, with the corpus' response length
        params = {p.name: p.default for p in signature.params.params}
        assert set(params) == set(DecodeConfig.model_fields)
        assert params["max_length"] == 7 and params["strategy"] == "greedy"
    else:
        assert signature.params is None
    example = input_example(spec)
    assert list(example.columns) == columns
    # the example is a valid request: the pyfunc answers it
    answers = _served(tmp_path, vocab, name, task, **config).predict(None, example)
    assert len(answers) == 1


@pytest.mark.slow
def test_logging_and_loading_the_pyfunc_warns_nothing_about_type_hints(tmp_path):
    """MLflow warned "Add type hints to the `predict` method" (with colour escapes) when
    ``pipeline.serving`` was imported (every train/tune stage) and when a logged model was
    loaded (``chat``/``rank``). Both run here in fresh processes, as the stages do."""
    log = f"""
import warnings
warnings.simplefilter("always")
from pipeline import tracking
from pipeline.serving import ServingSpec, log_pyfunc
from tests.test_serving import tiny_checkpoint
ckpt, vocab = tiny_checkpoint({str(tmp_path)!r})
t = tracking.Tracker.start({_uri(tmp_path)!r}, {_uri(tmp_path)!r}, "e", "r")
spec = ServingSpec("generate")
print("VERSION", t.call(lambda client, run_id: log_pyfunc(
    client.tracking_uri, run_id, "m", checkpoint=ckpt, vocab=vocab, spec=spec)))
"""
    load = f"""
import warnings
warnings.simplefilter("always")
import mlflow
mlflow.set_tracking_uri({_uri(tmp_path)!r})
model = mlflow.pyfunc.load_model("models:/m/1")
print("ANSWER", model.predict([{{"history": ["hi there", "how are you"]}}]))
"""
    for code in (log, load):
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "VERSION 1" in done.stdout or "ANSWER" in done.stdout
        assert "type hint" not in done.stderr.lower(), done.stderr[-3000:]
        assert "\x1b[" not in done.stderr


# --------------------------------------------------------------------------- requirements


def test_pins_drop_the_local_version_label():
    from pipeline.serving import pin

    assert pin("torch", "2.13.0+cpu") == "torch==2.13.0"
    assert pin("torch", "2.4.1+cu121") == "torch==2.4.1"
    assert pin("mylib", "1.2.0rc1+g1a2b3c") == "mylib==1.2.0rc1"
    assert pin("numpy", "2.4.6") == "numpy==2.4.6"


def test_logged_requirements_are_public_pins_of_the_installed_versions():
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    from pipeline.serving import SERVED_DISTRIBUTIONS, pip_requirements

    pins = [Requirement(line) for line in pip_requirements()]
    assert [p.name for p in pins] == list(SERVED_DISTRIBUTIONS)
    for requirement in pins:
        (spec,) = requirement.specifier
        assert spec.operator == "=="
        assert Version(spec.version).local is None, requirement
        installed = Version(version(requirement.name))
        assert Version(spec.version) == Version(installed.public), requirement


PIP_INDEX = [sys.executable, "-m", "pip", "index", "versions", "--isolated"]
PIP_INDEX += ["--index-url", "https://pypi.org/simple"]


@pytest.mark.slow  # asks PyPI (network)
def test_every_pin_is_a_version_pypi_serves():
    """``pip index versions`` against PyPI alone (``--isolated``: not this machine's pip
    config, whose mirrors and find-links hold local builds) lists each pinned version; it
    reads the index only (``pip install --dry-run`` of torch downloads a 500 MB wheel)."""
    import re

    from packaging.requirements import Requirement

    from pipeline.serving import pip_requirements

    for line in pip_requirements():
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        done = subprocess.run(
            [*PIP_INDEX, requirement.name],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        listed = re.search(r"Available versions: (.*)", done.stdout)
        assert listed, done.stdout
        assert spec.version in listed.group(1).split(", "), (line, listed.group(1)[:200])


def test_the_readme_documents_every_decoding_param_and_strategy():
    """README, "Serving a model": a row per request param, the strategies as they are."""
    from pipeline.config import DecodeStrategy

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Serving a model", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert documented == set(DecodeConfig.model_fields)
    strategies = ", ".join(f"`{s.value}`" for s in DecodeStrategy)
    assert f"| `strategy` | `greedy` | {strategies} |" in section
