"""The compiled step meets PTB's batches without compiling again: the paper profile's
``gpt-ptb`` and ``hgpt-ptb`` (their recipe's configs at tiny widths) compiled by the
execution policy over an epoch of PTB's batch geometry, its short last batch and the next
epoch's first, count one graph each (dynamo's counters).

PTB's training text is 42,068 sentences: 4,207 documents of 10 (the last of 8), 131
batches of 32 and one of 15. Its first batch is (32, 10, 32): with dynamo's duck sizing
the 32 documents and the 32-token sentences became one size, and the next batch's
48-token sentences compiled again inside the host-sync check's window (Inductor's
constant folding reads ``.item()``): the policy turns duck sizing off. Inductor's C++
code generator (CPU) also specialises on sizes above 4096 (documents x tokens, documents
x sentences x tokens: ``need_use_acc_helper``): PTB's short batch, the longest documents
of the epoch's last length-sorted window, is above both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from pipeline.artifacts import DataSizes
from pipeline.config import CompileMode, RunParams
from pipeline.data.batch import LMBatch
from pipeline.data.special import EOS_ID, SPECIAL_TOKENS
from pipeline.execution import ExecutionOverrides, ExecutionPolicy
from pipeline.models import registry
from pipeline.plan import RunRequest, load_checked
from pipeline.train.steps import LossModule
from tests.batches import lm_batch_from_sentences

REPO = Path(__file__).resolve().parents[2]
SENTENCES = 10  # tokenize.corpora.ptb.lm.sentences_per_document
# (documents, longest sentence with <eos>) of each batch: an epoch's first batches, the
# short one (the longest documents of the epoch's last length-sorted window: 83 tokens is
# PTB's longest sentence), the next epoch's first
PTB_EPOCH = [(32, 32), (32, 48), (32, 40), (32, 64), (32, 56), (15, 83), (32, 32)]
VOCAB = 64  # the vocabulary's size is not a shape that varies: PTB's 10,000 only costs time
TINY = {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1, "d_sentence": 16,
        "sentence_heads": 2, "sentence_d_ff": 32, "decoder_layers": 1}  # fmt: skip


def ptb_model(name: str) -> torch.nn.Module:
    """The paper profile's ``<name>-ptb`` model config (its recipe's dropouts, AR/TAR), at
    tiny widths."""
    request = RunRequest.of(load_checked(REPO / "profiles" / "paper.yaml"), f"{name}-ptb")
    fields = registry.spec(name).config_cls.model_fields
    overrides = {**request.knobs.model, **{k: v for k, v in TINY.items() if k in fields}}
    torch.manual_seed(0)
    return registry.build(name, DataSizes(vocab_size=VOCAB), **overrides).train()


def ptb_batch(documents: int, longest: int, seed: int) -> LMBatch:
    """``documents`` of :data:`SENTENCES` random sentences, the longest ``longest`` tokens."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for d in range(documents):
        lengths = torch.randint(2, longest + 1, (SENTENCES,), generator=g).tolist()
        if d == 0:
            lengths[0] = longest
        words = [torch.randint(len(SPECIAL_TOKENS), VOCAB, (n - 1,), generator=g) for n in lengths]
        docs.append([[*w.tolist(), EOS_ID] for w in words])
    return lm_batch_from_sentences(docs)


def compiled_graphs(name: str, backend: str) -> int:
    """Graphs compiled by training ``name`` one step on each batch of :data:`PTB_EPOCH`
    as the loop does (its policy's compile, padding and step settings)."""
    model = ptb_model(name)
    params, overrides = RunParams(compile=CompileMode.ON), ExecutionOverrides(backend)
    policy = ExecutionPolicy.for_training(
        params, torch.device("cpu"), model=model, overrides=overrides
    )
    step = LossModule(model)
    assert policy.compile_module(step)
    torch._dynamo.reset()
    counters.clear()
    batches = [ptb_batch(*shape, seed=i) for i, shape in enumerate(PTB_EPOCH)]
    for batch in policy.training_batches(batches):
        with policy.step():
            step(batch).loss.backward()
    return counters["stats"]["unique_graphs"]


def test_ptb_batches_compile_one_graph() -> None:
    """Dynamo's part (``eager`` backend: traced, no code generated), where duck sizing
    compiled twice; the Inductor tests below take HGPT too."""
    assert compiled_graphs("gpt", "eager") == 1


def test_cuda_graphs_see_a_few_bucketed_shapes_over_a_ptb_epoch() -> None:
    """``compile: reduce-overhead`` pads every batch to bucketed lengths at the loader's
    edge: over 40 PTB-like batches (the longest sentence 24-83 tokens, documents of
    170-620 tokens), 16 shapes against 39 unpadded (CUDA graphs record one each), each
    padded by at most a quarter (or to a multiple of 8), the tokens unchanged."""
    policy = ExecutionPolicy.for_training(
        RunParams(compile=CompileMode.REDUCE_OVERHEAD), torch.device("cpu")
    )
    g = torch.Generator().manual_seed(0)
    longest = torch.randint(24, 84, (40,), generator=g).tolist()
    batches = [ptb_batch(32 if i < 39 else 15, n, seed=i) for i, n in enumerate(longest)]
    shapes = set()
    for batch, padded in zip(batches, policy.training_batches(batches), strict=True):
        shapes.add((*padded.sentences.shape, padded.flat_ids.shape[1]))
        longest = batch.sentences.shape[2]
        assert padded.sentences.shape[2] <= max(longest + 7, 1.25 * longest)
        assert torch.equal(padded.flat_ids[:, : batch.flat_ids.shape[1]], batch.flat_ids)
    plain = {(*b.sentences.shape, b.flat_ids.shape[1]) for b in batches}
    assert len(shapes) <= 16 < len(plain)


@pytest.mark.slow  # Inductor generates and compiles C++: about a minute a model
@pytest.mark.parametrize("name", ["gpt", "hgpt"])
def test_ptb_batches_compile_one_inductor_graph(name: str) -> None:
    """With Inductor (CPU), as the loop compiles on a GPU: its own specialisations too."""
    assert compiled_graphs(name, "inductor") == 1
