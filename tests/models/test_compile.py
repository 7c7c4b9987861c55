"""The training hot path under ``torch.compile``: every registered model's ``loss(batch)``
on a real, padded batch compiles into one graph (no graph break, so no host read inside
the step), except the models whose class says it cannot (``supports_compile = False``:
the recurrent ones, ``models/recurrent.py``, and HRT, ``models/highway.py``), and where a
model takes another path when compiled (the HT-Encoder's ``attention_layout: auto``,
Transformer-Last's last utterance) the compiled loss and gradients equal the eager ones.

Compiled on CPU with the ``eager`` or ``aot_eager`` backend (dynamo, and autograd, traced;
no code generated): what is checked is the graph, not the kernels.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.models import registry
from tests.models.test_contract import NAMES, chitchat, multiwoz, setup, shards  # noqa: F401

# Models the training loop's ``compile: auto`` leaves eager (their docstrings say why).
NOT_COMPILED = {
    *("s2sa", "hred", "vhred", "vhcr", "dual_lstm", "hier_lstm"),  # nn.GRU, nn.LSTM
    *("hrt_last", "hrt_all"),  # one recurrence step per utterance, counted from the batch
    *("ensemble", "with_none"),  # by default of HRT models (hrt_last, hrt_all)
}
# Models whose compiled step takes another path than the eager one; the first of each
# family is also traced through autograd (``aot_eager``: slower).
OTHER_PATH = ["hier", "hier_cls", "hier_joint", "hier_pp", "mat", "set", "set_pp"]
OTHER_PATH += ["transformer_last_ranker"]
THROUGH_AUTOGRAD = {"hier", "transformer_last_ranker"}


def break_reasons(explained) -> str:
    lines = []
    for brk in explained.break_reasons:
        frame = brk.user_stack[-1] if brk.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame else "?"
        lines.append(f"{where}: {brk.reason.splitlines()[0]}")
    return "\n".join(lines)


def test_exactly_the_recurrent_and_hrt_models_say_they_do_not_compile():
    from pipeline.artifacts import DataSizes
    from tests.models.test_contract import tiny

    sizes = DataSizes(vocab_size=50, n_acts=5)
    models = {name: registry.build(name, sizes, **tiny(name)) for name in NAMES}
    says_no = {n for n, m in models.items() if not getattr(m, "supports_compile", True)}
    assert says_no == NOT_COMPILED


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_training_step_has_no_graph_break(name: str, shards):  # noqa: F811
    """``explain`` counts the graph breaks of ``loss`` in training mode; a model that says
    it does not compile must indeed break (else it should say it compiles)."""
    model, dataset, examples = setup(name, shards)
    batch = dataset.collate(examples)
    model.train()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.loss)(batch)
    if name in NOT_COMPILED:
        assert explained.graph_break_count > 0, f"{name} compiles whole: let it say so"
        return
    assert explained.graph_break_count == 0, f"{name}:\n{break_reasons(explained)}"


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHER_PATH)
def test_compiled_loss_and_gradients_equal_eager(name: str, shards):  # noqa: F811
    """Compiled with dynamic shapes, as the loop does: the loss and the gradients equal
    the eager ones on two batches of different lengths, and the second batch reuses the
    first one's graph (no size read from the data is specialised on)."""
    model, dataset, examples = setup(name, shards, n=24)
    model.train()
    torch._dynamo.reset()
    backend = "aot_eager" if name in THROUGH_AUTOGRAD else "eager"
    compiled = torch.compile(model.loss, backend=backend, dynamic=True)
    by_length = sorted(examples, key=lambda example: len(example.input_ids))
    batches = [dataset.collate(by_length[:3]), dataset.collate(by_length[-3:])]
    assert batches[0].history.input_ids.shape[1] != batches[1].history.input_ids.shape[1]
    for i, batch in enumerate(batches):
        model.zero_grad()
        eager = model.loss(batch).loss
        eager.backward()
        expected = grads(model)
        model.zero_grad()
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss = compiled(batch).loss
        loss.backward()
        torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
        got = grads(model)
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
def test_the_flex_layout_compiles_whole_in_training_and_evaluation():
    """``attention_layout: flex`` traced: in training (on a CPU its dense mask, FlexAttention
    having no CPU backward) and in evaluation (the block mask built and FlexAttention's
    kernel called inside the graph, as on CUDA)."""
    from tests.batches import random_generate_batch

    sizes = {"d_model": 32, "d_ff": 48, "n_heads": 2, "dropout": 0.0, "n_decoder_layers": 1}
    model = registry.build("hier", 40, attention_layout="flex", **sizes)
    batch = random_generate_batch(4, 40, max_utterances=4, max_utt_len=6, seed=1)
    for training in (True, False):
        torch._dynamo.reset()
        with torch.set_grad_enabled(training):
            explained = torch._dynamo.explain(model.train(training).loss)(batch)
        assert explained.graph_break_count == 0, break_reasons(explained)
        called = any("flex_attention" in graph.code for graph in explained.graphs)
        assert called == (not training)
