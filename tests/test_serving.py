"""The pyfunc's text -> batch -> answer path (fast, without MLflow), its signature and input
example, and logging and loading it without MLflow's type-hint warning."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from pipeline.artifacts import SavedModel
from pipeline.config import GenerateParams, LMParams, SelectParams, VocabParams
from pipeline.data.batch import History
from pipeline.data.corpora import read_corpus
from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.encoding import encode_dialogues, vocab_texts, wrap_ids
from pipeline.data.examples import build_generate, build_lm, build_select
from pipeline.data.loader import collate
from pipeline.data.special import BOS_ID, EOS_ID, SPEAKER_OTHER, SPEAKER_SELF, SPECIAL_TOKENS
from pipeline.data.vocab import Vocab, build_vocab
from pipeline.decode import DecodeConfig
from pipeline.models import registry
from pipeline.serving import (
    HiertxModel,
    RequestError,
    ServingSpec,
    generate_batch,
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
    h = generate_batch([["hi there", "how are you", "fine thanks"], ["hi"]], vocab, spec).history
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
    with pytest.raises(RequestError, match=r"^row 1: no candidates; valid: 1 or more strings"):
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


# --------------------------------------------------------------------------- served as trained

# A history longer than the limits, and candidates and sentences longer than their cuts;
# a candidate cut to 1 or 2 tokens keeps no word; no limits at all. (The task names none:
# it does not change how texts become batches.)
LIMITS = [
    ServingSpec("", max_history=150, max_utterances=10, max_candidate=30, max_sentence=50),
    ServingSpec("", max_history=23, max_utterances=3, max_candidate=5, max_sentence=4),
    ServingSpec("", max_history=None, max_utterances=None, max_candidate=2, max_sentence=2),
    ServingSpec("", max_history=9, max_utterances=None, max_candidate=1, max_sentence=None),
]
LONG = "how are you doing today , my good old friend , and how is the weather over there ?"
MADE = ("hi there", "", LONG, "i said <pad> to him", "fine", "thanks")  # typed "<pad>": a word


@pytest.fixture(scope="module")
def corpus() -> tuple[Vocab, list[Dialogue]]:
    """Real chitchat dialogues and one made up: an empty turn, a long one, "<pad>" typed."""
    real = list(itertools.islice(read_corpus("chitchat"), 10))
    made = Dialogue("made", tuple(Turn("ab"[t % 2], x) for t, x in enumerate(MADE)))
    dialogues = [*real, made]
    return build_vocab(vocab_texts(dialogues), VocabParams(size=300)), dialogues


def history_params(spec: ServingSpec) -> GenerateParams:
    return GenerateParams(max_history=spec.max_history, max_utterances=spec.max_utterances)


def assert_same_batch(served: Any, loaded: Any, unknown: tuple[str, ...] = ()) -> None:
    """Every tensor of the two batches equal (shape, dtype, values), nested ``History``
    included, but the fields a request cannot know (``unknown``) and the ids."""
    for field in dataclasses.fields(loaded):
        if field.name in (*unknown, "dialogue_id"):
            continue
        a, b = getattr(served, field.name), getattr(loaded, field.name)
        if isinstance(b, History):
            assert_same_batch(a, b)
        elif b is None:
            assert a is None, field.name
        else:
            assert a.dtype == b.dtype and a.shape == b.shape, (field.name, a.shape, b.shape)
            assert torch.equal(a, b), field.name


@pytest.mark.parametrize("spec", LIMITS)
def test_served_generate_batches_are_the_loaders(corpus, spec):
    """Every response turn: the history texts before it, served, give the batch that
    tokenize's examples give through the loader's collate (the response to write aside)."""
    vocab, dialogues = corpus
    encoded = encode_dialogues(dialogues, vocab)
    examples = list(build_generate(encoded, history_params(spec)))
    by_id = {d.id: d for d in dialogues}
    histories = [[t.text for t in by_id[e.dialogue_id].turns[: e.turn]] for e in examples]
    served = generate_batch(histories, vocab, spec)
    assert_same_batch(served, collate(examples), unknown=("target_ids", "target_mask"))
    assert served.target_ids.tolist() == [[BOS_ID]] * len(examples)  # where decoding starts
    if spec.max_history is not None:  # the limits cut: some history was longer
        uncut = [sum(len(vocab.encode(t)) + 2 for t in h) for h in histories]
        assert max(uncut) > spec.max_history


@pytest.mark.parametrize("spec", LIMITS[:2])
def test_served_select_batches_are_the_loaders_sampled_candidates(corpus, spec):
    """Every example of a test split whose negatives tokenize drew from other dialogues
    (candidates of 1 or 2 tokens are not distinct enough to draw from): the same
    history and candidate texts, served, give its batch."""
    vocab, dialogues = corpus
    encoded = encode_dialogues(dialogues, vocab)
    params = SelectParams(n_candidates_eval=6, max_candidate=spec.max_candidate)
    examples = list(build_select(encoded, params, history_params(spec), "test", seed=13))
    # Each candidate's text: the response whose wrapped ids it is.
    text_of = {
        wrap_ids(u, spec.max_candidate).tobytes(): t.text
        for d, e in zip(dialogues, encoded, strict=True)
        for t, u in zip(d.turns, e.utterances, strict=True)
    }
    by_id = {d.id: d for d in dialogues}
    histories = [[t.text for t in by_id[e.dialogue_id].turns[: e.turn]] for e in examples]
    candidates = [[text_of[c.tobytes()] for c in e.candidate_ids] for e in examples]
    served = select_batch(histories, candidates, vocab, spec)
    assert_same_batch(served, collate(examples), unknown=("labels",))
    assert max(len(vocab.encode(c)) for row in candidates for c in row) > spec.max_candidate


def own_candidates(dialogues: list[Dialogue]) -> list[Dialogue]:
    """DSTC7-shaped dialogues: each one's turns but the last, answered by its own
    candidates: the last turn, other dialogues' turns, a long one and one with "<pad>"."""
    texts = [t.text for d in dialogues for t in d.turns if t.text.strip()]
    shaped = []
    for i, d in enumerate(dialogues):
        context = d.turns[:-1] or d.turns
        candidates = [d.turns[-1].text, *texts[3 * i : 3 * i + 3], LONG, MADE[3]]
        own = [{"id": str(k), "text": c} for k, c in enumerate(candidates) if c.strip()]
        shaped.append(Dialogue(f"{d.id}+", context, {"candidates": own, "correct_ids": ["0"]}))
    return shaped


@pytest.mark.parametrize("spec", LIMITS)
def test_served_select_batches_are_the_loaders_own_candidates(corpus, spec):
    """A corpus's own candidates (DSTC7), kept whole off the training split: the same
    history and candidate texts, served, give the loader's batch, a candidate cut to 1
    or 2 tokens included (``<bos> <eos>``, as training cut it)."""
    vocab, dialogues = corpus
    shaped = own_candidates(dialogues)
    params = SelectParams(max_candidate=spec.max_candidate)
    encoded = encode_dialogues(shaped, vocab)
    examples = list(build_select(encoded, params, history_params(spec), "test", seed=13))
    histories = [[t.text for t in d.turns] for d in shaped]
    candidates = [[c["text"] for c in d.meta["candidates"]] for d in shaped]
    served = select_batch(histories, candidates, vocab, spec)
    assert_same_batch(served, collate(examples), unknown=("labels",))


@pytest.mark.parametrize("spec", LIMITS)
def test_served_lm_batches_are_the_loaders(corpus, spec):
    """Every document tokenize built (non-empty turns, a few per document): the texts of
    the turns it spans, an empty one among them, served, give the loader's batch."""
    vocab, dialogues = corpus
    encoded = encode_dialogues(dialogues, vocab)
    params = LMParams(sentences_per_document=3, max_sentence=spec.max_sentence)
    examples = list(build_lm(encoded, params))
    documents = []
    for e in examples:
        d = next(d for d in encoded if d.id == e.dialogue_id)
        spoken = [t for t, u in enumerate(d.utterances) if len(u) and t >= e.turn]
        last = spoken[len(e.sentences) - 1]
        turns = next(x for x in dialogues if x.id == e.dialogue_id).turns
        documents.append([t.text for t in turns[e.turn : last + 1]])
    assert [""] in [[s for s in doc if not s] for doc in documents]  # an empty turn spanned
    served = lm_batch(documents, vocab, spec)
    assert_same_batch(served, collate(examples))


def test_requests_that_cannot_be_scored_are_refused_in_one_line(tmp_path, vocab):
    """An empty candidate, as ``rank`` refuses it; a document without a word."""
    spec = ServingSpec("select")
    for candidates, index in ((["fine thanks", ""], 1), (["  "], 0)):
        with pytest.raises(RequestError) as refused:
            select_batch([["hi"], ["hi there"]], [["nice"], candidates], vocab, spec)
        assert str(refused.value) == (
            f"row 1: candidates[{index}] is empty ({candidates[index]!r}): an empty candidate "
            "cannot be scored; give it words or leave it out"
        )
    served = _served(tmp_path, vocab, "gpt", "lm", **TINY["gpt"])
    with pytest.raises(RequestError, match=r"^row 1: column 'document' has no words \(every"):
        served.predict(None, [{"document": ["hi"]}, {"document": ["", " "]}])
    # an empty sentence is left out, as tokenize leaves out an empty turn
    with_empty = served.predict(None, [{"document": ["hi there", "", "how are you"]}])
    assert with_empty == served.predict(None, [{"document": ["hi there", "how are you"]}])


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
