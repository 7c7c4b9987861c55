"""The language models' evaluation protocols: per document, and streamed over the test text
in a sliding window (of tokens for a flat model, of sentences for a hierarchical one)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import Tensor

from pipeline.config import parse_params
from pipeline.config.evaluate import EvaluateParams, LMProtocol
from pipeline.data.batch import LMBatch
from pipeline.data.loader import collate_lm
from pipeline.data.records import LMExample
from pipeline.data.special import EOS_ID
from pipeline.errors import ConfigError
from pipeline.eval.language import STREAM_KEYS, LMEvaluator, stream_windows
from pipeline.execution import ExecutionPolicy
from pipeline.models import registry
from pipeline.models.base import LanguageModel
from pipeline.models.stack import scatter_rows
from tests.models.test_hgpt import SMALL as HGPT_SMALL

# Three documents; the stream is their tokens in order: 5 6 E | 7 E 8 9 E | 10 11 E 12 E.
E = EOS_ID
DOCS = [[[5, 6, E]], [[7, E], [8, 9, E]], [[10, 11, E], [12, E]]]

ON_CPU = ExecutionPolicy(torch.device("cpu"))  # the evaluators' policy


class Documents:
    """A test split as the evaluator reads it: LM examples by index, in file order."""

    task = "lm"
    table = SimpleNamespace(root=Path("test-split"))

    def __init__(self, documents: list[list[list[int]]]) -> None:
        self.examples = [
            LMExample(f"doc{i}", 0, [np.array(s, dtype=np.int64) for s in d])
            for i, d in enumerate(documents)
        ]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> LMExample:
        return self.examples[index]

    def collate(self, examples: list[LMExample]) -> LMBatch:
        return collate_lm(examples)


class ContextLM(LanguageModel):
    """Scores each token with the number of real tokens before it in its row (its context
    within the window) and records that context: the evaluator's choices, made visible."""

    def __init__(self, unit: str = "tokens") -> None:
        super().__init__()
        self.stream_unit = unit  # type: ignore[misc]
        self.seen: list[tuple[tuple[int, ...], int]] = []  # (context, token)

    def token_nll(self, batch: LMBatch) -> Tensor:
        rows = []
        for ids, mask in zip(batch.flat_ids, batch.flat_mask, strict=True):
            flat = ids[mask].tolist()
            self.seen += [(tuple(flat[:j]), t) for j, t in enumerate(flat)]
            rows.append(torch.arange(len(flat), dtype=torch.float))
        return scatter_rows(batch.sentence_mask, torch.cat(rows))


def evaluate(model: LanguageModel, documents: list, batch_size: int = 2, **lm) -> tuple:
    settings = EvaluateParams(batch_size=batch_size, lm=lm)
    result = LMEvaluator(settings, ON_CPU)(model, Documents(documents), None, 0)
    return result.metrics, result.examples


def test_token_windows_by_hand() -> None:
    documents = [[np.array(s) for s in d] for d in DOCS]
    windows = list(stream_windows(documents, "tokens", context=3, stride=4))
    # stream 5 6 E 7 E 8 9 E 10 11 E 12 E: scored [0, 4), [4, 8), [8, 12), [12, 13)
    assert [np.concatenate(w.sentences).tolist() for w in windows] == [
        [5, 6, E, 7],
        [6, E, 7, E, 8, 9, E],
        [8, 9, E, 10, 11, E, 12],
        [11, E, 12, E],
    ]
    assert [w.owners.tolist() for w in windows] == [[0, 0, 0, 1], [1, 1, 1, 1], [2, 2, 2, 2], [2]]


def test_sentence_windows_by_hand() -> None:
    documents = [[np.array(s) for s in d] for d in DOCS]
    windows = list(stream_windows(documents, "sentences", context=1, stride=2))
    # sentences: [5 6 E] [7 E] [8 9 E] [10 11 E] [12 E], two scored a window after one
    assert [[s.tolist() for s in w.sentences] for w in windows] == [
        [[5, 6, E], [7, E]],
        [[7, E], [8, 9, E], [10, 11, E]],
        [[10, 11, E], [12, E]],
    ]
    assert [w.owners.tolist() for w in windows] == [[0, 0, 0, 1, 1], [1, 1, 1, 2, 2, 2], [2, 2]]
    with pytest.raises(ValueError, match="tokens or sentences"):
        next(stream_windows(documents, "words", 1, 1))


def test_streamed_tokens_are_each_scored_once_with_their_window_context() -> None:
    model = ContextLM()
    metrics, got = evaluate(model, DOCS, protocol="stream", context_tokens=3, stride_tokens=4)
    stream = [t for d in DOCS for s in d for t in s]
    expected = []  # (context, token) of every scored token, by hand from the definition
    for start in range(0, len(stream), 4):
        begin = max(0, start - 3)
        for j in range(start, min(start + 4, len(stream))):
            expected.append((tuple(stream[begin:j]), stream[j]))
    assert len(expected) == len(stream) and set(expected) <= set(model.seen)
    # per document, the NLL (here: the context length) of its own scored tokens: windows
    # [0, 4) from 0 (contexts 0 1 2 | 3), [4, 8) from 1 (3 4 5 6), [8, 12) from 5
    # (3 4 5 6), [12, 13) from 9 (3)
    assert got.nll_sum == [0 + 1 + 2, 3 + (3 + 4 + 5 + 6), (3 + 4 + 5 + 6) + 3]
    owners = [i for i, d in enumerate(DOCS) for s in d for _ in s]
    contexts = [len(c) for c, _ in expected]
    pairs = list(zip(contexts, owners, strict=True))
    assert got.nll_sum == [sum(c for c, o in pairs if o == i) for i in range(3)]
    assert got.n_tokens == [3, 5, 5] and got.ids == ["doc0#0", "doc1#0", "doc2#0"]
    assert metrics["test_loss"] == pytest.approx(sum(got.nll_sum) / 13)
    assert metrics[STREAM_KEYS["tokens"][0]] == 3 and metrics[STREAM_KEYS["tokens"][1]] == 4


def test_streamed_sentences_carry_the_previous_sentences_of_the_window() -> None:
    model = ContextLM("sentences")
    metrics, got = evaluate(
        model, DOCS, batch_size=1, protocol="stream", context_sentences=1, stride_sentences=2
    )
    # sentence 2 (8 9 E) is scored in the window [7 E] [8 9 E] [10 11 E]: after 7 E
    assert ((7, E), 8) in model.seen and ((7, E, 8, 9), E) in model.seen
    # sentence 3 (10 11 E) in the same window, after both; sentence 4 after sentence 3 only
    assert ((7, E, 8, 9, E, 10, 11), E) in model.seen and ((10, 11, E), 12) in model.seen
    # windows [5 6 E][7 E] (contexts 0 1 2 | 3 4), [7 E][8 9 E][10 11 E] (2 3 4 | 5 6 7),
    # [10 11 E][12 E] (3 4)
    assert got.nll_sum == [0 + 1 + 2, (3 + 4) + (2 + 3 + 4), (5 + 6 + 7) + (3 + 4)]
    assert got.n_tokens == [3, 5, 5]
    assert set(STREAM_KEYS["sentences"]) <= metrics.keys()
    assert not set(STREAM_KEYS["tokens"]) & metrics.keys()


def test_unit_sentences_gives_a_flat_model_the_hierarchical_windows() -> None:
    """``evaluate.lm.unit: sentences``: GPT reads exactly the windows HGPT reads (equal
    context), and the metrics say so."""
    lm = {"protocol": "stream", "context_sentences": 1, "stride_sentences": 2}
    flat, hierarchical = ContextLM(), ContextLM("sentences")
    metrics, got = evaluate(flat, DOCS, batch_size=1, unit="sentences", **lm)
    _, reference = evaluate(hierarchical, DOCS, batch_size=1, **lm)
    assert flat.seen == hierarchical.seen and got.nll_sum == reference.nll_sum
    assert set(STREAM_KEYS["sentences"]) <= metrics.keys()
    assert not set(STREAM_KEYS["tokens"]) & metrics.keys()
    _, by_tokens = evaluate(ContextLM(), DOCS, batch_size=1, **lm)  # unit: model
    assert by_tokens.nll_sum != got.nll_sum


def test_per_document_protocol_is_today_s() -> None:
    model = ContextLM()
    metrics, got = evaluate(model, DOCS)
    assert got.nll_sum == [0 + 1 + 2, sum(range(5)), sum(range(5))]  # each from its start
    assert set(metrics) == {"n_examples", "test_loss", "test_ppl"}


def test_quick_runs_stream_the_documents_the_per_document_protocol_scores() -> None:
    _, got = evaluate(ContextLM(), DOCS, batch_size=1, protocol="stream")
    settings = EvaluateParams(batch_size=1, max_batches=2, lm={"protocol": "stream"})
    quick = LMEvaluator(settings, ON_CPU)(ContextLM(), Documents(DOCS), None, 0)
    assert quick.examples.ids == got.ids[:2] and quick.examples.n_tokens == [3, 5]


@pytest.mark.parametrize("name", ["gpt", "hgpt"])
def test_one_window_over_one_document_is_the_per_document_score(name: str) -> None:
    sizes = {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_layers": 2, "dropout": 0.0}
    torch.manual_seed(0)
    model = registry.build(name, 40, **(sizes if name == "gpt" else HGPT_SMALL)).eval()
    document = [[5, 6, 7, E], [8, 9, E], [10, 11, 12, 13, E]]
    _, alone = evaluate(model, [document])
    wide = {"context_tokens": 100, "stride_tokens": 100, "context_sentences": 9}
    _, streamed = evaluate(model, [document], protocol="stream", **wide, stride_sentences=9)
    assert streamed.nll_sum == pytest.approx(alone.nll_sum, rel=1e-6)
    # with a short context the same tokens are scored, with less before them
    shorter = {"context_tokens": 2, "stride_tokens": 2, "context_sentences": 0}
    _, short = evaluate(model, [document], protocol="stream", **shorter)
    assert short.n_tokens == alone.n_tokens and short.nll_sum != pytest.approx(alone.nll_sum)


def test_streamed_perplexity_of_a_real_model_batches_like_one_window_at_a_time() -> None:
    torch.manual_seed(0)
    model = registry.build("gpt", 40, d_model=16, n_heads=2, d_ff=32, n_layers=1).eval()
    lm = {"protocol": "stream", "context_tokens": 4, "stride_tokens": 3}
    one, _ = evaluate(model, DOCS, batch_size=1, **lm)
    many, _ = evaluate(model, DOCS, batch_size=3, **lm)  # padded windows in one batch
    assert many["test_loss"] == pytest.approx(one["test_loss"], rel=1e-6)
    assert math.isfinite(one["test_ppl"])


def test_protocol_params_are_validated_and_set_per_corpus() -> None:
    assert EvaluateParams().lm.protocol is LMProtocol.DOCUMENT
    with pytest.raises(ConfigError, match=r"evaluate\.lm\.protocol"):
        parse_params({"evaluate": {"lm": {"protocol": "sliding"}}})
    with pytest.raises(ConfigError, match=r"evaluate\.lm\.stride_tokens"):
        parse_params({"evaluate": {"lm": {"stride_tokens": 0}}})
    params = EvaluateParams(corpora={"ptb": {"lm": {"protocol": "stream"}}})
    assert params.for_corpus("ptb").lm.protocol is LMProtocol.STREAM
    assert params.for_corpus("chitchat").lm.protocol is LMProtocol.DOCUMENT


def test_streaming_advances_the_progress_bar_by_document_batches() -> None:
    class Bar:
        def __init__(self) -> None:
            self.done: list[int] = []

        def advance(self, n: int = 1) -> None:
            self.done.append(n)

    bar = Bar()
    settings = EvaluateParams(batch_size=2, lm={"protocol": "stream", "stride_tokens": 1})
    LMEvaluator(settings, ON_CPU)(ContextLM(), Documents(DOCS), bar, 0)  # type: ignore[arg-type]
    assert sum(bar.done) == 2 and min(bar.done) >= 0  # two batches of documents, in order
    assert bar.done.index(1) < len(bar.done) - 1  # the first one before the stream ends


@dataclass(frozen=True)
class _CountingPolicy(ExecutionPolicy):
    """A CPU policy that counts the batches it moves (``evaluation_batches``)."""

    moved: list = field(default_factory=list)

    def evaluation_batches(self, pairs):
        for item, batch in super().evaluation_batches(pairs):
            self.moved.append(batch)
            yield item, batch


@pytest.mark.parametrize("protocol", ["document", "stream"])
def test_every_test_batch_reaches_the_device_through_the_policy(protocol: str) -> None:
    """Both protocols move every batch they score through ``policy.evaluation_batches``
    (the one path to the device: pinned and one ahead on CUDA), none on its own."""
    policy = _CountingPolicy(torch.device("cpu"))
    settings = EvaluateParams(batch_size=1, lm={"protocol": protocol})
    scored: list = []

    class Spy(ContextLM):
        def token_nll(self, batch: LMBatch) -> Tensor:
            scored.append(batch)
            return super().token_nll(batch)

    LMEvaluator(settings, policy)(Spy(), Documents(DOCS), None, 0)
    assert scored and len(policy.moved) == len(scored)
    assert all(any(b is m for m in policy.moved) for b in scored)
