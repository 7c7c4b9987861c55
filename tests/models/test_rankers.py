"""Baseline rankers (Dual/Hier LSTM, Transformer(-Last)), ensembles and the NONE candidate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.eval.ranking import first_correct_ranks
from pipeline.models import registry
from pipeline.models.base import count_parameters
from pipeline.models.rankers import (
    DualLSTM,
    Ensemble,
    HierLSTM,
    WithNoneCandidate,
    append_none,
    none_labels,
)
from pipeline.models.selection import RankingLoss, lse_ranking_loss
from pipeline.models.utterances import split_utterances
from tests.batches import chitchat_select_batch
from tests.models.test_highway import VOCAB, pad_batch, random_select_batch, select_rows

LSTM_SMALL = dict(d_embed=12, d_hidden=10)
TRANSFORMER_SMALL = dict(d_embed=16, d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0)
NAMES = ["dual_lstm", "hier_lstm", "transformer_ranker", "transformer_last_ranker"]


def small(name: str) -> dict:
    return LSTM_SMALL if "lstm" in name else TRANSFORMER_SMALL


def build(name: str, **overrides):
    torch.manual_seed(0)
    return registry.build(name, VOCAB, **{**small(name), **overrides}).eval()


@pytest.fixture(scope="module")
def chitchat():
    return chitchat_select_batch(batch_size=6, n_candidates=4, vocab_size=300)


def test_registered_with_paper_sizes():
    assert set(NAMES) <= set(registry.names("select"))
    assert registry.make_config("dual_lstm", 100).d_hidden == 200
    assert registry.make_config("hier_lstm", 100).d_hidden == 128
    assert registry.make_config("transformer_ranker", 100).d_ff == 512
    assert registry.make_config("transformer_last_ranker", 100).last_utterance
    assert not registry.make_config("transformer_ranker", 100).last_utterance


@pytest.mark.parametrize("name", NAMES)
def test_padding_and_batch_composition_do_not_change_scores(name):
    model = build(name)
    batch = random_select_batch(batch_size=4)
    with torch.no_grad():
        scores = model.score(batch)
        assert scores.shape == (4, 3) and torch.isfinite(scores).all()
        assert torch.allclose(model.score(pad_batch(batch)), scores, atol=1e-5)
        for b in range(4):
            assert torch.allclose(model.score(select_rows(batch, [b]))[0], scores[b], atol=1e-5)
        assert torch.allclose(model.score(select_rows(batch, [2, 0])), scores[[2, 0]], atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_every_parameter(name):
    model = build(name).train()
    model.loss(random_select_batch(batch_size=4)).loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


def _run(lstm: torch.nn.LSTM, x: torch.Tensor) -> torch.Tensor:
    return lstm(x[None])[1][0][-1, 0]


def test_dual_lstm_is_bilinear_in_lstm_states():
    model = build("dual_lstm")
    assert isinstance(model, DualLSTM)
    batch = random_select_batch(batch_size=2)
    h = batch.history
    with torch.no_grad():
        model.bilinear.M.normal_()
        model.bilinear.b.fill_(0.7)
        scores = model.score(batch)
        for b in range(2):
            c = _run(model.lstm, model.embed(h.input_ids[b][h.input_mask[b]]))
            for n in range(3):
                ids = batch.candidate_ids[b, n][batch.candidate_mask[b, n]]
                r = _run(model.lstm, model.embed(ids))
                assert torch.allclose(scores[b, n], c @ model.bilinear.M @ r + 0.7, atol=1e-5)


def test_hier_lstm_runs_utterance_then_context_lstm():
    model = build("hier_lstm")
    assert isinstance(model, HierLSTM)
    batch = random_select_batch(batch_size=3)
    utt = split_utterances(batch.history)
    with torch.no_grad():
        scores = model.score(batch)
        for b in range(3):
            vectors = torch.stack(
                [
                    _run(model.lstm, model.embed(utt.ids[b, i][utt.mask[b, i]]))
                    for i in range(int(utt.count[b]))
                ]
            )
            c = _run(model.context_lstm, vectors)
            for n in range(3):
                ids = batch.candidate_ids[b, n][batch.candidate_mask[b, n]]
                r = _run(model.lstm, model.embed(ids))
                expected = c @ model.bilinear.M @ r + model.bilinear.b
                assert torch.allclose(scores[b, n], expected, atol=1e-5)


def _change_utterance(batch, which: str):
    """Replace the words of the first (``which="first"``) or last utterance of row 0."""
    h = batch.history
    real = h.input_mask[0]
    last = int(h.utt_index[0][real].max())
    target = 0 if which == "first" else last
    inside = real & (h.utt_index[0] == target) & (h.utt_pos[0] > 0)
    ids = h.input_ids.clone()
    ids[0][inside] = (ids[0][inside] + 7 - 5) % (VOCAB - 5) + 5
    return dataclasses.replace(batch, history=dataclasses.replace(h, input_ids=ids)), last


def test_transformer_last_sees_only_the_last_utterance():
    batch = random_select_batch(batch_size=4, seed=3)
    changed_first, n_last = _change_utterance(batch, "first")
    assert n_last > 0, "row 0 needs at least two utterances"
    changed_last, _ = _change_utterance(batch, "last")
    last_only, full = build("transformer_last_ranker"), build("transformer_ranker")
    with torch.no_grad():
        base = last_only.score(batch)
        assert torch.allclose(last_only.score(changed_first), base, atol=1e-6)
        assert not torch.allclose(last_only.score(changed_last)[0], base[0])
        assert not torch.allclose(full.score(changed_first)[0], full.score(batch)[0])


def test_lstm_knowledge_features():
    batch = random_select_batch(batch_size=2)
    ck = torch.rand(*batch.history.input_ids.shape, 3)
    xk = torch.rand(*batch.candidate_ids.shape, 3)
    with_k = dataclasses.replace(batch, context_knowledge=ck, candidate_knowledge=xk)
    for name in ("dual_lstm", "hier_lstm", "transformer_ranker"):
        model = build(name, knowledge_dim=3)
        with torch.no_grad():
            scores = model.score(with_k)
            assert not torch.allclose(
                model.score(dataclasses.replace(with_k, context_knowledge=0 * ck)), scores
            )
            assert torch.allclose(model.score(pad_batch(with_k)), scores, atol=1e-5)
        with pytest.raises(ValueError, match="no candidate_knowledge"):
            model.score(dataclasses.replace(with_k, candidate_knowledge=None))


# --------------------------------------------------------------------------- ensembles


def test_ensemble_sums_logits_and_trains_members():
    batch = random_select_batch(batch_size=3)
    members = [build("hier_lstm"), build("transformer_last_ranker")]
    ensemble = Ensemble(members)
    with torch.no_grad():
        expected = members[0].score(batch) + members[1].score(batch)
        assert torch.allclose(ensemble.score(batch), expected)
    assert count_parameters(ensemble) == sum(count_parameters(m) for m in members)
    ensemble.train().loss(batch).loss.backward()
    assert all(p.grad is not None for m in members for p in m.parameters())


def test_ensemble_rejects_bad_members():
    with pytest.raises(ValueError, match="at least one"):
        Ensemble([])
    with pytest.raises(TypeError, match=r"models\[1\]"):
        Ensemble([build("dual_lstm"), torch.nn.Linear(2, 2)])


# --------------------------------------------------------------------------- NONE (subtask 4)


def test_none_candidate_by_hand():
    logits = torch.tensor([[-1.0, -2.0], [3.0, -1.0], [-0.5, 0.5]])
    labels = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    assert append_none(logits).tolist() == [[-1.0, -2.0, 0.0], [3.0, -1.0, 0.0], [-0.5, 0.5, 0.0]]
    extended = none_labels(labels)
    assert extended.tolist() == [[0, 0, 1], [1, 0, 0], [1, 0, 0]]
    # NONE wins when nothing clears logit 0; ranks counted among N+1.
    assert first_correct_ranks(append_none(logits), extended).tolist() == [1, 1, 3]


def test_with_none_scores_and_losses():
    batch = random_select_batch(batch_size=4)
    labels = batch.labels.clone()
    labels[1] = 0  # an answerless example
    batch = dataclasses.replace(batch, labels=labels)
    inner = build("transformer_ranker")
    wrapped = WithNoneCandidate(inner)
    with torch.no_grad():
        logits = inner.score(batch)
        scores = wrapped.score(batch)
        assert scores.shape == (4, 4) and (scores[:, -1] == 0).all()
        assert torch.allclose(scores[:, :-1], logits)
        # BCE: the real candidates' loss (NONE's constant logit carries no gradient).
        assert torch.allclose(wrapped.loss(batch).loss, inner.loss(batch).loss)
        lse = WithNoneCandidate(inner, loss=RankingLoss.LSE, margin=0.2)
        expected = lse_ranking_loss(append_none(logits), none_labels(labels), 0.2).mean()
        assert torch.allclose(lse.loss(batch).loss, expected)
        # The answerless row ranks NONE against every candidate: it has a loss.
        assert lse_ranking_loss(append_none(logits), none_labels(labels), 0.2)[1] > 0


def test_with_none_follows_model_config():
    inner = build("dual_lstm", loss="lse", margin=0.4)
    wrapped = WithNoneCandidate(inner)
    assert (wrapped.loss_kind, wrapped.margin) == (RankingLoss.LSE, 0.4)


# --------------------------------------------------------------------------- overfitting


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_overfits_real_chitchat_batch(name, chitchat):
    batch, vocab = chitchat
    torch.manual_seed(0)
    overrides = (
        dict(d_embed=16, d_hidden=16) if "lstm" in name else {**TRANSFORMER_SMALL, "n_layers": 1}
    )
    model = registry.build(name, len(vocab), **overrides)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model.loss(batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2
    with torch.no_grad():
        assert (first_correct_ranks(model.eval().score(batch), batch.labels) == 1).all()
