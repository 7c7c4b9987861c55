"""Highway attention, the utterance split and the Highway Recurrent Transformer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import Tensor

from pipeline.data.batch import History, SelectBatch
from pipeline.data.special import BOS_ID, EOS_ID, SPEAKER_OTHER, SPEAKER_SELF
from pipeline.errors import ConfigError
from pipeline.eval.ranking import first_correct_ranks
from pipeline.models import registry
from pipeline.models.base import count_parameters
from pipeline.models.highway import HighwayRecurrentTransformer
from pipeline.models.selection import (
    HighwayAttention,
    HighwayFormula,
    RankingLoss,
    lse_ranking_loss,
    masked_max,
    ranking_loss,
)
from tests.batches import chitchat_select_batch, make_history, random_generate_batch

SMALL = dict(d_embed=16, d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0)
VOCAB = 40


# --------------------------------------------------------------------------- helpers


def random_select_batch(batch_size: int = 4, n_candidates: int = 3, seed: int = 0) -> SelectBatch:
    """Random histories with varied utterance counts/lengths and candidates of varied
    lengths, so rows carry different amounts of padding."""
    gen = random_generate_batch(batch_size, VOCAB, max_utterances=4, max_utt_len=7, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    length = 8
    ids = torch.zeros(batch_size, n_candidates, length, dtype=torch.long)
    for b in range(batch_size):
        for n in range(n_candidates):
            k = int(torch.randint(1, length - 1, (1,), generator=g))
            ids[b, n, : k + 2] = torch.tensor(
                [BOS_ID, *torch.randint(5, VOCAB, (k,), generator=g).tolist(), EOS_ID]
            )
    labels = torch.zeros(batch_size, n_candidates)
    labels[torch.arange(batch_size), torch.randint(0, n_candidates, (batch_size,), generator=g)] = 1
    return SelectBatch(gen.history, ids, ids != 0, labels, gen.dialogue_id)


def _trim(batch: SelectBatch) -> SelectBatch:
    """Drop all-padding columns (a sub-batch gets the shapes it would have on its own)."""
    h = batch.history
    hl = int(h.input_mask.sum(-1).max())
    cl = int(batch.candidate_mask.sum(-1).max())
    history = History(*(getattr(h, f.name)[:, :hl] for f in dataclasses.fields(h)))
    return dataclasses.replace(
        batch,
        history=history,
        candidate_ids=batch.candidate_ids[..., :cl],
        candidate_mask=batch.candidate_mask[..., :cl],
        context_knowledge=None
        if batch.context_knowledge is None
        else batch.context_knowledge[:, :hl],
        candidate_knowledge=None
        if batch.candidate_knowledge is None
        else batch.candidate_knowledge[:, :, :cl],
    )


def select_rows(batch: SelectBatch, rows: list[int]) -> SelectBatch:
    index = torch.tensor(rows)
    h = batch.history
    history = History(*(getattr(h, f.name)[index] for f in dataclasses.fields(h)))
    return _trim(
        dataclasses.replace(
            batch,
            history=history,
            candidate_ids=batch.candidate_ids[index],
            candidate_mask=batch.candidate_mask[index],
            labels=batch.labels[index],
            dialogue_id=tuple(batch.dialogue_id[i] for i in rows),
            context_knowledge=None
            if batch.context_knowledge is None
            else batch.context_knowledge[index],
            candidate_knowledge=None
            if batch.candidate_knowledge is None
            else batch.candidate_knowledge[index],
        )
    )


def pad_batch(batch: SelectBatch, extra_history: int = 5, extra_candidate: int = 3) -> SelectBatch:
    """Append padding columns (zeros, masks False) to the history and the candidates."""

    def pad(x: Tensor, extra: int, dim: int) -> Tensor:
        shape = list(x.shape)
        shape[dim] = extra
        return torch.cat([x, x.new_zeros(shape)], dim)

    h = batch.history
    history = History(*(pad(getattr(h, f.name), extra_history, 1) for f in dataclasses.fields(h)))
    return dataclasses.replace(
        batch,
        history=history,
        candidate_ids=pad(batch.candidate_ids, extra_candidate, 2),
        candidate_mask=pad(batch.candidate_mask, extra_candidate, 2),
        context_knowledge=None
        if batch.context_knowledge is None
        else pad(batch.context_knowledge, extra_history, 1),
        candidate_knowledge=None
        if batch.candidate_knowledge is None
        else pad(batch.candidate_knowledge, extra_candidate, 2),
    )


def build(name: str, **overrides) -> HighwayRecurrentTransformer:
    torch.manual_seed(0)
    model = registry.build(name, VOCAB, **{**SMALL, **overrides})
    return model.eval()  # type: ignore[return-value]


@pytest.fixture(scope="module")
def chitchat():
    return chitchat_select_batch(batch_size=6, n_candidates=4, vocab_size=300)


# --------------------------------------------------------------------------- highway attention


def naive_highway(hw: HighwayAttention, query: Tensor, keys: Tensor, key_mask: Tensor) -> Tensor:
    """The formula, one query position, head and key at a time."""
    mha = hw.mha
    wq, bq = mha.q_proj.weight, mha.q_proj.bias
    wk, bk = mha.k_proj.weight, mha.k_proj.bias
    wv, bv = mha.v_proj.weight, mha.v_proj.bias
    h, dh = mha.n_heads, mha.d_head
    out = torch.zeros(query.shape[0], query.shape[1], h * dh, dtype=torch.float64)
    for b in range(query.shape[0]):
        for a in range(query.shape[1]):
            x = query[b, a]
            q = wq @ (x + hw.b_self) + bq
            k_self = wk @ (x + hw.b_self) + bk
            v_self = wv @ x + bv
            for head in range(h):
                s = slice(head * dh, (head + 1) * dh)
                s_self = float(q[s] @ k_self[s]) / math.sqrt(dh)
                terms = []
                for p in range(keys.shape[1]):
                    if key_mask[b, p]:
                        k = wk @ (keys[b, p] + hw.b_co) + bk
                        v = wv @ keys[b, p] + bv
                        terms.append((float(q[s] @ k[s]) / math.sqrt(dh), v[s]))
                norm = sum(math.exp(sp) for sp, _ in terms) + math.exp(s_self)
                acc = sum((math.exp(sp) / norm) * v.double() for sp, v in terms)
                self_weight = math.exp(s_self) if hw.formula == HighwayFormula.SOFTMAX else s_self
                acc = acc + (self_weight / norm) * v_self[s].double()
                out[b, a, s] = acc
    return mha.out_proj(out.float())


def make_highway(
    formula: HighwayFormula = HighwayFormula.SOFTMAX, heads: int = 2
) -> HighwayAttention:
    torch.manual_seed(1)
    hw = HighwayAttention(8, heads, formula=formula).eval()
    with torch.no_grad():
        hw.b_co.normal_()
        hw.b_self.normal_()
    return hw


@pytest.mark.parametrize("formula", list(HighwayFormula))
def test_highway_equals_naive_loop(formula):
    hw = make_highway(formula)
    query, keys = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    key_mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    with torch.no_grad():
        expected = naive_highway(hw, query, keys, key_mask)
        assert torch.allclose(hw(query, keys, key_mask), expected, atol=1e-5)


def test_weights_sum_to_one_and_skip_padding():
    hw = make_highway()
    query, keys = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    key_mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    w_keys, w_self, _, _ = hw.weights(query, keys, key_mask)
    assert torch.allclose(w_keys.sum(-1) + w_self, torch.ones_like(w_self))
    assert (w_self > 0).all()
    assert (w_keys[1, :, :, 2:] == 0).all()
    # The paper's eq. 3 only changes the self weight.
    eq3 = make_highway(HighwayFormula.PAPER_EQ3)
    w_keys_eq3, w_self_eq3, _, _ = eq3.weights(query, keys, key_mask)
    assert torch.allclose(w_keys_eq3, w_keys)
    assert not torch.allclose(w_self_eq3, w_self)


def test_no_keys_means_self_only():
    hw = make_highway()
    query, keys = torch.randn(1, 3, 8), torch.randn(1, 2, 8)
    w_keys, w_self, _, self_values = hw.weights(query, keys, torch.zeros(1, 2, dtype=torch.bool))
    assert torch.allclose(w_self, torch.ones_like(w_self)) and (w_keys == 0).all()
    out = hw(query, keys, torch.zeros(1, 2, dtype=torch.bool))
    merged = self_values.transpose(1, 2).reshape(1, 3, 8)
    assert torch.allclose(out, hw.mha.out_proj(merged), atol=1e-6)


def test_very_negative_self_logit_reduces_to_plain_attention():
    """Push s_self to -inf through b_self: highway attention becomes the plain
    ``MultiHeadAttention`` with the same projections. (W_Q is zeroed so that b_self only
    moves the self key: then q_h is the constant bias c_h and b_self can be solved for
    c_h . W_K,h b_self = -t in every head at once.)"""
    hw = make_highway()
    query, keys = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    key_mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    mha = hw.mha
    with torch.no_grad():
        mha.q_proj.weight.zero_()
        mha.q_proj.bias.normal_()
        hw.b_co.zero_()
        dh = mha.d_head
        rows = torch.stack(
            [
                mha.k_proj.weight[h * dh : (h + 1) * dh].T @ mha.q_proj.bias[h * dh : (h + 1) * dh]
                for h in range(mha.n_heads)
            ]
        )
        hw.b_self.copy_(torch.linalg.pinv(rows) @ torch.full((mha.n_heads,), -1e4))
        _, w_self, _, _ = hw.weights(query, keys, key_mask)
        assert w_self.max() < 1e-6
        plain = mha(query, keys, mask=key_mask[:, None, None, :])
        assert torch.allclose(hw(query, keys, key_mask), plain, atol=1e-5)


def test_highway_padding_invariance():
    hw = make_highway()
    query, keys = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    key_mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    out = hw(query, keys, key_mask)
    padded_keys = torch.cat([keys, 100 * torch.randn(2, 3, 8)], 1)
    padded_mask = torch.cat([key_mask, torch.zeros(2, 3, dtype=torch.bool)], 1)
    more_queries = torch.cat([query, torch.randn(2, 2, 8)], 1)
    assert torch.allclose(hw(more_queries, padded_keys, padded_mask)[:, :3], out, atol=1e-6)


def test_masked_max():
    x = torch.tensor([[[1.0, -5.0], [3.0, -7.0], [9.0, 9.0]], [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert masked_max(x, mask).tolist() == [[3.0, -5.0], [0.0, 0.0]]


# --------------------------------------------------------------------------- the model


def test_paper_sizes_and_config_errors():
    config = registry.make_config("hrt_last", 1000)
    assert (config.d_ff, config.n_layers, config.all_states) == (512, 2, False)
    assert registry.make_config("hrt_all", 1000).all_states
    # (the registry currently names model-validator errors "<model>.config"; the message
    # names the field)
    with pytest.raises(ConfigError, match=r"hrt_last\..*n_heads"):
        registry.build("hrt_last", 100, d_model=16, n_heads=5)
    with pytest.raises(ConfigError, match=r"hrt_all\.all_states"):
        registry.build("hrt_all", 100, all_states=False)
    with pytest.raises(ConfigError, match=r"hrt_last\.loss"):
        registry.build("hrt_last", 100, loss="hinge")


def test_recurrence_and_score_equal_manual_computation():
    """a_1 = v_1, a_i = H(v_i, a_{i-1}) run utterance by utterance without any padding,
    including a 70-token utterance (the MiuLab code kept only its last 50 positions)."""
    g = torch.Generator().manual_seed(3)

    def utterance(n: int) -> list[int]:
        return [BOS_ID, *torch.randint(5, VOCAB, (n,), generator=g).tolist(), EOS_ID]

    utts = [utterance(4), utterance(70), utterance(2)]
    speakers = [SPEAKER_SELF, SPEAKER_OTHER, SPEAKER_SELF]
    other = [utterance(3)]
    history = make_history([utts, other], [speakers, [SPEAKER_OTHER]])
    cands = [utterance(5), utterance(1)]
    ids = torch.zeros(2, 2, 7, dtype=torch.long)
    for b in range(2):
        for n, c in enumerate(cands):
            ids[b, n, : len(c)] = torch.tensor(c)
    batch = SelectBatch(history, ids, ids != 0, torch.zeros(2, 2), ("a", "b"))

    for name in ("hrt_last", "hrt_all"):
        model = build(name)

        def encode(tokens: list[int], speaker: int, model=model) -> Tensor:
            t = torch.tensor([tokens])
            ones = torch.ones_like(t, dtype=torch.bool)
            pos = torch.arange(len(tokens))[None]
            return model.encoder(t, ones, pos, torch.full_like(t, speaker))[0]

        with torch.no_grad():
            states = [encode(utts[0], speakers[0])]
            for u, s in zip(utts[1:], speakers[1:], strict=True):
                states.append(model.recurrence(encode(u, s)[None], states[-1][None])[0])
            last, last_mask, every, every_mask = model.encode_context(batch.history)
            assert int(last_mask[0].sum()) == len(utts[-1])
            assert torch.allclose(last[0][last_mask[0]], states[-1], atol=1e-5)
            assert torch.allclose(every[0][every_mask[0]], torch.cat(states), atol=1e-5)
            # all states come back compacted: real positions only, cut at the history length
            assert every.shape[1] == batch.history.input_ids.shape[1] < 3 * 72

            context = torch.cat(states) if name == "hrt_all" else states[-1]
            for n, c in enumerate(cands):
                v = encode(c, SPEAKER_SELF)
                cand_vec = model.highway(v[None], context[None])[0].max(0).values
                ctx_vec = model.highway(context[None], v[None])[0].max(0).values
                expected = cand_vec @ ctx_vec
                assert torch.allclose(model.score(batch)[0, n], expected, atol=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(shared_highway=True),
        dict(highway_formula=HighwayFormula.PAPER_EQ3),
    ],
)
@pytest.mark.parametrize("name", ["hrt_last", "hrt_all"])
def test_padding_and_batch_composition_do_not_change_scores(name, overrides):
    model = build(name, **overrides)
    batch = random_select_batch(batch_size=4)
    with torch.no_grad():
        scores = model.score(batch)
        assert torch.isfinite(scores).all()
        assert torch.allclose(model.score(pad_batch(batch)), scores, atol=1e-5)
        for b in range(4):
            alone = model.score(select_rows(batch, [b]))
            assert torch.allclose(alone[0], scores[b], atol=1e-5)
        reordered = model.score(select_rows(batch, [3, 1]))
        assert torch.allclose(reordered, scores[[3, 1]], atol=1e-5)


def test_recurrence_and_matching_have_their_own_highway_modules():
    model = build("hrt_last")  # the authors' code: two modules
    highways = [m for m in model.modules() if isinstance(m, HighwayAttention)]
    assert len(highways) == 2 and model.recurrence is not model.highway
    shared = build("hrt_last", shared_highway=True)
    assert shared.recurrence is shared.highway
    assert shared.recurrence.mha.q_proj.weight is shared.highway.mha.q_proj.weight
    assert count_parameters(model) - count_parameters(shared) == count_parameters(model.highway)


def test_gradients_reach_every_parameter():
    model = build("hrt_all").train()
    batch = random_select_batch(batch_size=4)
    model.loss(batch).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_knowledge_features():
    batch = random_select_batch(batch_size=2)
    g = torch.Generator().manual_seed(5)
    ck = (torch.rand(*batch.history.input_ids.shape, 2, generator=g) < 0.3).float()
    xk = (torch.rand(*batch.candidate_ids.shape, 2, generator=g) < 0.3).float()
    with_k = dataclasses.replace(batch, context_knowledge=ck, candidate_knowledge=xk)
    model = build("hrt_all", knowledge_dim=2)
    with torch.no_grad():
        scores = model.score(with_k)
        flipped = dataclasses.replace(with_k, candidate_knowledge=1 - xk)
        assert not torch.allclose(model.score(flipped), scores)
        assert torch.allclose(model.score(pad_batch(with_k)), scores, atol=1e-5)
    with pytest.raises(ValueError, match="no context_knowledge"):
        model.score(batch)
    with pytest.raises(ValueError, match="knowledge_dim is 2"):
        model.score(dataclasses.replace(with_k, context_knowledge=torch.cat([ck, ck], -1)))


def test_empty_history_gives_finite_scores():
    batch = random_select_batch(batch_size=2)
    h = batch.history
    empty = History(*(torch.zeros_like(getattr(h, f.name)) for f in dataclasses.fields(h)))
    with torch.no_grad():
        scores = build("hrt_last").score(dataclasses.replace(batch, history=empty))
    assert torch.isfinite(scores).all()


# --------------------------------------------------------------------------- losses


def test_lse_loss_by_hand():
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.5, -1.0, 3.0], [1.0, 2.0, 3.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    loss = lse_ranking_loss(logits, labels, margin=0.5)
    # row 0: log(e^0 + e^1) + (-2) + 0.5 ; row 1: 3 + log(e^-0.5 + e^1) + 0.5 ; row 2: none.
    expected = [
        max(0.0, math.log(1 + math.e) - 2 + 0.5),
        3 + math.log(math.exp(-0.5) + math.e) + 0.5,
        0.0,
    ]
    assert loss.tolist() == pytest.approx(expected, rel=1e-5)
    # A well separated row costs nothing.
    assert lse_ranking_loss(torch.tensor([[10.0, -10.0]]), torch.tensor([[1.0, 0.0]])).item() == 0


def test_lse_loss_gradient_is_finite_without_positives():
    # row 1's positive (-0.4) is below its negatives' log-sum-exp (1.30): its hinge is
    # active (2.70 at margin 1), so each of its logits has a gradient
    logits = torch.tensor([[0.3, -1.2, 0.5], [0.2, -0.4, 0.9]], requires_grad=True)
    labels = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    ranking_loss(logits, labels, RankingLoss.LSE, 1.0).loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[0] == 0).all() and (logits.grad[1] != 0).all()


def test_model_loss_follows_config():
    batch = random_select_batch(batch_size=3)
    model = build("hrt_last", loss="lse", margin=0.3)
    with torch.no_grad():
        expected = lse_ranking_loss(model.score(batch), batch.labels, 0.3).mean()
        assert torch.allclose(model.loss(batch).loss, expected)
        bce = build("hrt_last")
        logits = bce.score(batch)
        expected = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        out = bce.loss(batch)
        assert torch.allclose(out.loss, expected) and int(out.n_tokens) == 3


# --------------------------------------------------------------------------- overfitting


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hrt_last", "hrt_all"])
def test_overfits_real_chitchat_batch(name, chitchat):
    batch, vocab = chitchat
    torch.manual_seed(0)
    model = registry.build(name, len(vocab), **{**SMALL, "n_layers": 1})
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
