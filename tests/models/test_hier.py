"""HT-Encoder family: encoder equivalences, mask semantics inside the model, padding,
batching, causality, incremental decoding, act input, the joint model, paper sizes and
overfitting a real chitchat batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.artifacts import DataSizes
from pipeline.data.batch import GenerateBatch, History
from pipeline.data.special import BOS_ID, EOS_ID, PAD_ID
from pipeline.errors import ConfigError
from pipeline.models import masks, registry
from pipeline.models.hier import HierJoint, HierTransformer, greedy_tokens
from pipeline.models.masks import ContextMask, MemoryKeys
from tests.batches import chitchat_generate_batch, make_history, random_generate_batch

NAMES = ["hier", "hier_cls", "set", "mat", "hier_pp", "set_pp", "hier_joint"]
VOCAB = 40
N_ACTS = 6


def small(name: str, vocab: int = VOCAB, **extra) -> HierTransformer:
    """A tiny model of ``name`` (its structural presets kept), dropout off."""
    sizes = dict(d_model=32, d_ff=48, n_heads=4, n_decoder_layers=1, dropout=0.0)
    if name != "mat":
        sizes["n_utterance_layers"] = 1
    if name not in ("set", "set_pp"):
        sizes["n_context_layers"] = 1
    if name == "hier_joint":
        sizes |= dict(max_belief_len=6, max_act_len=5)
    torch.manual_seed(0)
    data = DataSizes(vocab_size=vocab, n_acts=N_ACTS)
    return registry.build(name, data, **(sizes | extra)).eval()  # type: ignore[return-value]


def random_ids(batch_size: int, max_len: int, vocab: int, seed: int) -> torch.Tensor:
    """``<bos> w.. <eos>`` rows of varied length, right-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch_size, max_len, dtype=torch.long)
    for b in range(batch_size):
        n = int(torch.randint(1, max_len - 1, (1,), generator=g))
        ids[b, 0], ids[b, n + 1] = BOS_ID, EOS_ID
        ids[b, 1 : n + 1] = torch.randint(5, vocab, (n,), generator=g)
    return ids


def full_batch(batch: GenerateBatch, vocab: int = VOCAB) -> GenerateBatch:
    """Adds random acts / belief / act sequences so every model can run on ``batch``."""
    b = batch.batch_size
    g = torch.Generator().manual_seed(1)
    return dataclasses.replace(
        batch,
        acts=(torch.rand(b, N_ACTS, generator=g) < 0.4).float(),
        belief_ids=random_ids(b, 7, vocab, 2),
        act_ids=random_ids(b, 5, vocab, 3),
    )


BATCH = full_batch(random_generate_batch(4, VOCAB, max_utterances=4, max_utt_len=6, seed=3))


def pad_history(history: History, extra: int) -> History:
    pad = lambda t: torch.cat([t, t.new_zeros(t.shape[0], extra)], dim=1)  # noqa: E731
    return History(*(pad(getattr(history, f.name)) for f in dataclasses.fields(History)))


def row(batch: GenerateBatch, b: int) -> GenerateBatch:
    """Row ``b`` alone, with its padding columns trimmed."""
    n = int(batch.history.input_mask[b].sum())
    h = batch.history
    history = History(*(getattr(h, f.name)[b : b + 1, :n] for f in dataclasses.fields(History)))
    take = lambda t: None if t is None else t[b : b + 1]  # noqa: E731
    return dataclasses.replace(
        batch,
        history=history,
        target_ids=take(batch.target_ids),
        target_mask=take(batch.target_mask),
        turn=take(batch.turn),
        dialogue_id=batch.dialogue_id[b : b + 1],
        acts=take(batch.acts),
        belief_ids=take(batch.belief_ids),
        act_ids=take(batch.act_ids),
    )


def teacher_logits(model: HierTransformer, batch: GenerateBatch) -> torch.Tensor:
    memory = model.encode(batch)
    return model.decode(batch.target_ids[:, :-1], memory)[0]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol=1e-6, rtol=1e-5) -> None:
    """Like ``torch.testing.assert_close``, which in torch 2.13 first imports
    ``torch.distributed.tensor`` and sympy (several seconds on a busy machine)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    gap = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), f"max abs diff {gap}"


def oracle(name: str) -> dict:
    return {"oracle_annotations": True} if name == "hier_joint" else {}


# --------------------------------------------------------------------------- configs


def test_registered_with_paper_sizes():
    expect = {  # Table 1: layers shared/context/decoder, H = d_ff, A = heads, E = d_model
        "hier": (3, 3, 3, 100, 4, 100, None),
        "set": (6, 0, 3, 100, 4, 100, None),
        "mat": (0, 4, 6, 200, 5, 100, None),
        "hier_pp": (4, 6, 3, 91, 7, 175, 48),  # the paper's 44: HDSA's inventory
        "set_pp": (4, 0, 3, 91, 7, 175, 48),
        "hier_cls": (4, 6, 3, 91, 7, 175, 48),
        "hier_joint": (3, 3, 3, 100, 4, 100, None),
    }
    assert set(NAMES) <= set(registry.names("generate"))
    for name, sizes in expect.items():
        c = registry.make_config(name, DataSizes(vocab_size=1505, n_acts=48))
        got = (
            c.n_utterance_layers,
            c.n_context_layers,
            c.n_decoder_layers,
            c.d_ff,
            c.n_heads,
            c.d_model,
            c.n_acts,
        )
        assert got == sizes, name
    assert registry.make_config("hier", 10).context_mask is ContextMask.HIER
    assert registry.make_config("hier", 10).memory_keys is MemoryKeys.ALL
    cls = registry.make_config("hier_cls", DataSizes(vocab_size=10, n_acts=3))
    assert (cls.context_mask, cls.memory_keys) == (ContextMask.CLS, MemoryKeys.FIRST_TOKENS)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"hier\.n_heads") as err:
        registry.build("hier", 10, n_heads=3)
    assert "d_head" in str(err.value)
    with pytest.raises(ConfigError, match=r"hier\.n_context_layers"):
        registry.build("hier", 10, n_utterance_layers=0, n_context_layers=0)
    with pytest.raises(ConfigError, match=r"set\.n_context_layers"):
        registry.build("set", 10, n_context_layers=2)  # fixed by the preset
    with pytest.raises(ConfigError, match=r"hier_joint\.n_acts"):
        registry.build("hier_joint", 10, n_acts=4)
    # act models take the act inventory from the data, never from params or a constant
    with pytest.raises(ConfigError, match=r"hier_pp\.n_acts: hier_pp reads the dialogue acts"):
        registry.build("hier_pp", 10)  # a corpus without acts
    with pytest.raises(ConfigError, match=r"set_pp\.n_acts: comes from the data"):
        registry.build("set_pp", DataSizes(vocab_size=10, n_acts=5), n_acts=44)
    # Explicit per-head size lifts the divisibility constraint.
    model = registry.build("hier", 10, d_model=30, n_heads=4, d_head=8, d_ff=16)
    assert model.encoder.context_layers[0].attn.d_head == 8


# --------------------------------------------------------------------------- encoder


def test_all_true_masks_equal_a_plain_encoder():
    model = small("hier", n_utterance_layers=2, n_context_layers=2)
    enc, h = model.encoder, BATCH.history
    b, length = h.input_ids.shape
    ones = torch.ones(b, length, length, dtype=torch.bool)
    # The same EncoderLayers run without masks, local PE first, global PE in between.
    x = enc.embed(h.input_ids) + enc.positions(h.utt_pos)
    for layer in enc.utterance_layers:
        x = layer(x)
    x = x + enc.positions.range(length)
    for layer in enc.context_layers:
        x = layer(x)
    assert_close(enc(h, ones, ones), x)


LAYOUT_CASES = [(name, {}) for name in NAMES] + [
    ("hier", {"context_mask": kind}) for kind in ("hier_naacl", "cls", "full")
]
REAL_BATCH = full_batch(chitchat_generate_batch(batch_size=6, vocab_size=VOCAB)[0])


def assert_same_grads(model: torch.nn.Module, other: torch.nn.Module, atol: float) -> None:
    for (key, a), (_, b) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), key
        if a.grad is not None:
            assert_close(a.grad, b.grad, atol=atol)


@pytest.mark.parametrize("layout", ["auto", "flex"])
@pytest.mark.parametrize(("name", "extra"), LAYOUT_CASES)
def test_layouts_compute_what_the_masks_compute(name, extra, layout):
    """The default (``auto``, eager: packed, layers on the real tokens, attention grouped as
    the UT/CT-masks allow) and ``flex`` (the masks as FlexAttention block masks) compute
    what the paper's masked flat history computes: same states, loss, gradients, on a
    random and on a real chitchat batch, both padded. Without gradients FlexAttention's own
    kernel runs on the CPU; with them (it has no CPU backward) the same mask mods, dense."""
    model = small(name, attention_layout=layout, **oracle(name), **extra).train()
    masked = small(name, attention_layout="masked", **oracle(name), **extra).train()
    masked.load_state_dict(model.state_dict())
    expected = "packed" if layout == "auto" else "flex"
    assert model.layout(BATCH.history) == expected
    for batch in (BATCH, REAL_BATCH):
        h, real = batch.history, batch.history.input_mask
        with torch.no_grad():
            states = model.encode_history(h).states[real]
            assert_close(states, masked.encode_history(h).states[real])
            assert_close(model.eval().loss(batch).loss, masked.eval().loss(batch).loss)
        model.train(), masked.train()
        loss, loss_masked = model.loss(batch).loss, masked.loss(batch).loss
        assert_close(loss, loss_masked)
        model.zero_grad(), masked.zero_grad()
        loss.backward()
        loss_masked.backward()
        assert_same_grads(model, masked, atol=1e-6)


def test_auto_layout_is_packed_when_eager_and_flex_only_without_attention_dropout():
    from pipeline.models.hier import AttentionLayout, resolve_layout

    def auto(compiling: bool, cuda: bool, attention_dropout: bool) -> str:
        return resolve_layout(
            AttentionLayout.AUTO,
            compiling=compiling,
            cuda=cuda,
            attention_dropout=attention_dropout,
        ).value

    assert auto(False, True, False) == auto(False, False, True) == "packed"
    assert auto(True, True, False) == "flex"
    assert auto(True, True, True) == auto(True, False, False) == "masked"
    assert registry.make_config("hier", 10).attention_layout == "auto"
    for layout in ("packed", "masked", "flex"):
        assert (
            resolve_layout(
                AttentionLayout(layout), compiling=True, cuda=True, attention_dropout=False
            ).value
            == layout
        )


def test_flex_layout_needs_attention_dropout_zero():
    with pytest.raises(ConfigError, match=r"hier\.attention_layout: flex cannot drop attention"):
        registry.build("hier", 10, attention_layout="flex")  # dropout 0.1, the paper's
    with pytest.raises(ConfigError, match=r"hier\.attention_layout: flex.*0\.2 is in effect"):
        registry.build("hier", 10, attention_layout="flex", dropout=0.0, attention_dropout=0.2)
    model = registry.build("hier", 10, attention_layout="flex", attention_dropout=0.0)
    assert model.config.dropout == 0.1  # the rest of the network keeps its dropout


def test_mat_with_full_mask_is_a_plain_transformer_encoder_over_local_and_global_pe():
    """MAT keeps the local PE of the utterance stage it lacks, as the authors' code does."""
    model = small("mat", context_mask="full")
    enc, h = model.encoder, BATCH.history
    x = enc.embed(h.input_ids) + enc.positions(h.utt_pos)
    x = x + enc.positions.range(h.input_ids.shape[1])
    key_mask = h.input_mask[:, None, None, :]
    for layer in enc.context_layers:
        x = layer(x, mask=key_mask)
    real = h.input_mask
    assert_close(model.encode(BATCH).states[real], x[real])


def _perturb(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    return x + 3.0 * where.unsqueeze(-1) * torch.randn_like(x)


def test_cls_context_layers_see_only_first_tokens():
    model = small("hier_cls")
    h = BATCH.history
    x = torch.randn(*h.input_ids.shape, 32)
    ct = masks.context_mask(h, ContextMask.CLS)
    first = masks.first_tokens(h)
    non_first = h.input_mask & ~first
    out = model.encoder.contextualise(x, ct)
    out2 = model.encoder.contextualise(_perturb(x, non_first), ct)
    assert_close(out[first], out2[first])
    # The decoder reads first tokens only: perturbing other encoder outputs changes nothing.
    memory = model.encode(BATCH)
    logits = model.decode(BATCH.target_ids, memory)[0]
    moved = dataclasses.replace(memory, states=_perturb(memory.states, ~first))
    assert_close(model.decode(BATCH.target_ids, moved)[0], logits)
    # ... while first tokens matter.
    moved = dataclasses.replace(memory, states=_perturb(memory.states, first))
    assert not torch.allclose(model.decode(BATCH.target_ids, moved)[0], logits)


HAND = make_history([[[2, 7, 3], [2, 8, 9, 3], [2, 6, 3]]], [[2, 1, 2]])  # 3 utterances
UTT = [HAND.utt_index == i for i in range(3)]  # [1, L] each


@pytest.mark.parametrize(
    ("kind", "perturbed", "unchanged", "changed"),
    [
        # HIER: only the final utterance reads other utterances.
        (ContextMask.HIER, 0, [1], [2]),
        (ContextMask.HIER, 2, [0, 1], []),
        # NAACL code: every utterance reads the final one, the final reads only itself.
        (ContextMask.HIER_NAACL, 2, [], [0, 1]),
        (ContextMask.HIER_NAACL, 0, [1, 2], []),
        (ContextMask.FULL, 0, [], [1, 2]),
    ],
)
def test_context_mask_semantics_in_the_encoder(kind, perturbed, unchanged, changed):
    model = small("hier", context_mask=kind)
    x = torch.randn(1, HAND.input_ids.shape[1], 32)
    ct = masks.context_mask(HAND, kind)
    out = model.encoder.contextualise(x, ct)
    out2 = model.encoder.contextualise(_perturb(x, UTT[perturbed]), ct)
    for u in unchanged:
        assert_close(out[UTT[u]], out2[UTT[u]])
    for u in changed:
        assert not torch.allclose(out[UTT[u]], out2[UTT[u]])


def test_utterance_layers_encode_each_utterance_independently():
    model = small("set")
    h = HAND
    ids = h.input_ids.clone()
    ids[UTT[0]] = 11  # change the words of utterance 0
    out = model.encoder(h, masks.utterance_mask(h), None)
    out2 = model.encoder(dataclasses.replace(h, input_ids=ids), masks.utterance_mask(h), None)
    assert_close(out[UTT[1] | UTT[2]], out2[UTT[1] | UTT[2]])
    assert not torch.allclose(out[UTT[0]], out2[UTT[0]])


@pytest.mark.parametrize("keys", [MemoryKeys.ALL, MemoryKeys.FINAL_UTTERANCE])
def test_decoder_cross_attention_keys(keys):
    model = small("hier", memory_keys=keys)
    batch = GenerateBatch(
        history=HAND,
        target_ids=torch.tensor([[BOS_ID, 9, 10, EOS_ID]]),
        target_mask=torch.ones(1, 4, dtype=torch.bool),
        turn=torch.tensor([3]),
        dialogue_id=("hand",),
    )
    memory = model.encode(batch)
    logits = teacher_logits(model, batch)
    moved = dataclasses.replace(memory, states=_perturb(memory.states, UTT[0]))
    logits2 = model.decode(batch.target_ids[:, :-1], moved)[0]
    if keys is MemoryKeys.ALL:
        assert not torch.allclose(logits, logits2)
    else:  # the final utterance only
        assert_close(logits, logits2)


# --------------------------------------------------------------------------- all models


@pytest.mark.parametrize("name", NAMES)
def test_batched_equals_one_by_one_and_padding_changes_nothing(name):
    model = small(name, **oracle(name))
    logits = teacher_logits(model, BATCH)
    assert torch.isfinite(logits).all()
    for b in range(BATCH.batch_size):
        alone = teacher_logits(model, row(BATCH, b))
        real = BATCH.target_mask[b, 1:]
        assert_close(logits[b, real], alone[0, real], atol=1e-5, rtol=1e-4)
    padded = dataclasses.replace(BATCH, history=pad_history(BATCH.history, 5))
    assert_close(teacher_logits(model, padded), logits, atol=1e-5, rtol=1e-4)
    out = model.loss(BATCH)
    assert torch.isfinite(out.loss) and out.n_tokens == BATCH.target_mask[:, 1:].sum()


@pytest.mark.parametrize("name", NAMES)
def test_decoder_is_causal_and_incremental_equals_full(name):
    model = small(name, **oracle(name))
    memory = model.encode(BATCH)
    tokens = BATCH.target_ids
    full = model.decode(tokens, memory)[0]
    changed = tokens.clone()
    changed[:, 3:] = 7
    assert_close(model.decode(changed, memory)[0][:, :3], full[:, :3])
    state = model.init_state(memory, BATCH.batch_size)
    steps = []
    for t in range(tokens.shape[1]):
        logits, state = model.decode(tokens[:, t : t + 1], memory, state)
        steps.append(logits)
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    # A reordered state (beam search) decodes the reordered rows.
    index = torch.tensor([2, 0])
    state = model.init_state(memory, BATCH.batch_size)
    model.decode(tokens[:, :2], memory, state)
    picked = dataclasses.replace(
        memory, **{f: getattr(memory, f)[index] for f in ("states", "mask")}
    )
    if memory.act_offset is not None:
        picked.act_offset = memory.act_offset[index]
    step = model.decode(tokens[index, 2:3], picked, state.select(index))[0]
    assert_close(step[:, 0], full[index, 2], atol=1e-5, rtol=1e-4)


def test_acts_change_the_output_and_train_the_act_embedding():
    for name in ("hier_pp", "set_pp"):
        model = small(name)
        other = dataclasses.replace(BATCH, acts=1.0 - BATCH.acts)
        assert not torch.allclose(teacher_logits(model, BATCH), teacher_logits(model, other))
        model.loss(BATCH).loss.backward()
        grad = model.act_embed.weight.grad
        assert grad is not None and grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"batch\.acts"):
        small("hier_pp").encode(dataclasses.replace(BATCH, acts=None))
    with pytest.raises(ValueError, match="act dimensions"):
        small("hier_pp").encode(dataclasses.replace(BATCH, acts=BATCH.acts[:, :2]))


def test_joint_loss_terms_and_gradients_reach_every_decoder():
    model = small("hier_joint")
    assert isinstance(model, HierJoint)
    out = model.loss(BATCH)
    assert set(out.terms) == {"belief", "act", "response"}
    assert_close(out.loss, sum(out.terms.values()))
    out.loss.backward()
    for part in (model.belief_decoder, model.act_decoder, model.decoder, model.encoder):
        grads = [p.grad for p in part.parameters()]
        assert all(g is not None for g in grads)
        assert sum(g.abs().sum() for g in grads) > 0
    assert model.belief_summary.weight.grad.abs().sum() > 0
    # Belief feeds the act decoder: other beliefs change the act loss, not the belief loss.
    other = dataclasses.replace(BATCH, belief_ids=random_ids(4, 7, VOCAB, 9))
    out2 = model.loss(other)
    assert not torch.allclose(out.terms["act"], out2.terms["act"])
    assert not torch.allclose(out.terms["response"], out2.terms["response"])
    with pytest.raises(ValueError, match="belief_ids"):
        model.loss(dataclasses.replace(BATCH, belief_ids=None))


def test_joint_encode_predicts_belief_and_acts_unless_oracle():
    model = small("hier_joint")
    encoded = model.encode_history(BATCH.history)
    belief = greedy_tokens(model.belief_decoder, encoded, 6)
    assert belief.shape[1] <= 6 and (belief[:, 0] == BOS_ID).all()
    for seq in belief.tolist():  # after <eos> only padding
        if EOS_ID in seq:
            assert all(t == PAD_ID for t in seq[seq.index(EOS_ID) + 1 :])
    # Greedy tokens are the argmax of teacher forcing on themselves (cache == full).
    logits = model.belief_decoder(belief[:, :-1], encoded.states, encoded.mask)
    real = belief[:, 1:] != PAD_ID
    assert torch.equal(logits.argmax(-1)[real], belief[:, 1:][real])
    # The response memory is [belief embeddings; act embeddings; encoder outputs].
    memory = model.encode(dataclasses.replace(BATCH, belief_ids=None, act_ids=None))
    enc_len = BATCH.history.input_ids.shape[1]
    assert torch.equal(memory.mask[:, : belief.shape[1]], belief != PAD_ID)
    assert torch.equal(memory.mask[:, -enc_len:], BATCH.history.input_mask)
    assert torch.isfinite(model.decode(BATCH.target_ids, memory)[0]).all()
    oracle_model = small("hier_joint", oracle_annotations=True)
    gold = oracle_model.encode(BATCH)
    assert gold.states.shape[1] == enc_len + 7 + 5
    # Teacher forcing in loss() uses exactly the oracle memory.
    out = oracle_model.loss(BATCH)
    logits = oracle_model.decode(BATCH.target_ids[:, :-1], gold)[0]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), BATCH.target_ids[:, 1:].reshape(-1), reduction="none"
    )
    assert_close(out.nll_sum, (nll * BATCH.target_mask[:, 1:].reshape(-1)).sum(), atol=1e-4)


def test_no_nan_with_padding_in_training_mode():
    model = small("hier")
    model.train()
    padded = dataclasses.replace(BATCH, history=pad_history(BATCH.history, 3))
    out = model.loss(padded)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --------------------------------------------------------------------------- overfitting


def adam_fit(model: torch.nn.Module, batch: GenerateBatch, steps: int, lr: float) -> list[float]:
    """Plain Adam (Kingma & Ba defaults) on ``model.loss(batch)``; the losses seen.

    Hand-written because constructing any ``torch.optim`` optimizer imports
    ``torch._dynamo`` (5-20 s on a busy 2-core machine), more than the fit itself.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    losses = []
    for t in range(1, steps + 1):
        loss = model.loss(batch).loss
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        losses.append(loss.item())
        with torch.no_grad():
            for p, g, m_i, v_i in zip(params, grads, m, v, strict=True):
                if g is None:
                    continue
                m_i.mul_(beta1).add_(g, alpha=1 - beta1)
                v_i.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                step = lr * (1 - beta2**t) ** 0.5 / (1 - beta1**t)
                p.addcdiv_(m_i, v_i.sqrt().add_(eps), value=-step)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_overfits_a_real_chitchat_batch(name):
    batch, vocab = chitchat_generate_batch(batch_size=4, vocab_size=300, max_history=40)
    batch = full_batch(batch, len(vocab))
    model = small(name, vocab=len(vocab))
    model.train()
    losses = adam_fit(model, batch, steps=30, lr=3e-3)
    assert losses[-1] < losses[0] / 4, (name, losses[0], losses[-1])
    # The fit uses the inputs (history, and acts/belief where the model reads them), not
    # only the decoder's memory of the responses: another row's inputs cost loss.
    h, perm = batch.history, torch.roll(torch.arange(batch.batch_size), 1)
    swapped = dataclasses.replace(
        batch,
        history=History(*(getattr(h, f.name)[perm] for f in dataclasses.fields(History))),
        acts=batch.acts[perm],
        belief_ids=batch.belief_ids[perm],
        act_ids=batch.act_ids[perm],
    )
    model.eval()
    with torch.no_grad():  # response NLL per token (hier_joint's loss adds other terms)
        right, wrong = (o.nll_sum / o.n_tokens for o in map(model.loss, (batch, swapped)))
    assert wrong > right * 1.2, (name, right.item(), wrong.item())
