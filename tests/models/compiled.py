"""The check every compiled language model passes: one graph, and the loss and gradients
of the compiled training step equal the eager ones."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch import nn

from pipeline.data.batch import LMBatch


def assert_compiles_like_eager(model: nn.Module, batch: LMBatch) -> None:
    """``model.loss`` (in training mode) traces without a graph break, and compiled with
    ``aot_eager`` (dropout off, so both paths compute one function) gives the eager loss,
    NLL, token count and gradients."""
    model.train()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.loss)(batch)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    model.eval()
    compiled = torch.compile(model.loss, backend="aot_eager", fullgraph=True)(batch)
    compiled.loss.backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager = model.loss(batch)
    eager.loss.backward()
    torch.testing.assert_close(compiled.loss, eager.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled.nll_sum, eager.nll_sum, atol=1e-4, rtol=1e-5)
    for got, p in zip(compiled_grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, atol=1e-5, rtol=1e-4)
    assert torch.equal(compiled.n_tokens, eager.n_tokens)


def assert_static_path_matches_trimmed(
    model: nn.Module, module: ModuleType, padded: LMBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.token_nll`` of a batch with extra padding: the static-shape path (forced on
    through ``module.static_shapes``, as under compile or off the CPU) equals the trimmed
    one, and is zero on the padding."""
    trimmed = model.token_nll(padded)
    monkeypatch.setattr(module, "static_shapes", lambda like: True)
    static = model.token_nll(padded)
    torch.testing.assert_close(static, trimmed, atol=1e-5, rtol=1e-5)
    assert torch.all(static[~padded.sentence_mask] == 0)
