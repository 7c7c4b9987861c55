"""generate(): every strategy on a hand-checkable constant model, a tiny Transformer
encoder-decoder built from the shared layers, and the RNN baselines."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor, nn

from pipeline.data.batch import GenerateBatch, History
from pipeline.data.special import BOS_ID, EOS_ID, PAD_ID
from pipeline.decode import DecodeConfig, GenerationOutput, generate, length_penalty
from pipeline.models import registry
from pipeline.models.base import BlockDims, Seq2SeqModel, select_batch_dim
from pipeline.models.blocks import Decoder, DecoderCache, EncoderLayer
from pipeline.models.layers import SinusoidalPositions, TokenEmbedding, padding_mask
from tests.batches import random_generate_batch

VOCAB = 40


# --------------------------------------------------------------------------- test models


class ConstantModel(Seq2SeqModel):
    """Always predicts the same distribution: token 5 (0.6), <eos> (0.3), token 6 (0.1)."""

    def __init__(self, vocab: int = 8) -> None:
        super().__init__()
        probs = torch.full((vocab,), 1e-12)
        probs[5], probs[EOS_ID], probs[6] = 0.6, 0.3, 0.1
        self.register_buffer("logits", probs.log())

    def encode(self, batch: GenerateBatch) -> Tensor:
        return batch.history.input_ids[:, :1]

    def decode(self, tokens: Tensor, memory: object, state=None):
        assert isinstance(memory, Tensor) and memory.shape[0] == tokens.shape[0]
        return self.logits.expand(tokens.shape[0], tokens.shape[1], -1), state


class EchoModel(Seq2SeqModel):
    """Says the history's first word ``w`` with 0.3, token 5 with 0.5, ``<eos>`` with 0.2;
    after an empty history (no word) token 5 with 0.8 and ``<eos>`` with 0.2."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.vocab = vocab

    def encode(self, batch: GenerateBatch) -> Tensor:
        return batch.history.input_ids[:, 1]

    def decode(self, tokens: Tensor, memory: object, state=None):
        assert isinstance(memory, Tensor)
        probs = torch.full((tokens.shape[0], self.vocab), 1e-12)
        probs[:, EOS_ID] = 0.2
        said = memory != EOS_ID
        probs[:, 5] = torch.where(said, 0.5, 0.8)
        rows = said.nonzero().squeeze(1)
        probs[rows, memory[rows]] = 0.3
        return probs.log()[:, None].expand(-1, tokens.shape[1], -1), state


@dataclass
class TinyMemory:
    states: Tensor
    mask: Tensor


class TinyTransformer(Seq2SeqModel):
    """A 1-layer encoder + 2-layer decoder from ``pipeline.models.layers``, with a KV cache."""

    def __init__(self, vocab: int = VOCAB, d: int = 32) -> None:
        super().__init__()
        self.embed = TokenEmbedding(vocab, d)
        self.positions = SinusoidalPositions(d)
        self.encoder = EncoderLayer(BlockDims(d, 4, 64, dropout=0.0))
        self.decoder = Decoder(vocab, 2, BlockDims(d, 4, 64, dropout=0.0))

    def encode(self, batch: GenerateBatch) -> TinyMemory:
        h = batch.history
        x = self.embed(h.input_ids) + self.positions.range(h.input_ids.shape[1])
        return TinyMemory(self.encoder(x, mask=padding_mask(h.input_mask)), h.input_mask)

    def decode(self, tokens: Tensor, memory: object, state: DecoderCache | None = None):
        assert isinstance(memory, TinyMemory)
        return self.decoder(tokens, memory.states, memory.mask, cache=state), state

    def init_state(self, memory: object, batch_size: int) -> DecoderCache:
        return self.decoder.init_cache()


def tiny(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer()


def rnn(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    extra = {"sample_latent": True} if name in ("vhred", "vhcr") else {}
    return registry.build(name, VOCAB, d_embed=16, d_hidden=16, dropout=0.0, **extra)


def batch(size: int = 4, seed: int = 1) -> GenerateBatch:
    return random_generate_batch(size, VOCAB, seed=seed)


def rescore(model: Seq2SeqModel, b: GenerateBatch, out_tokens: Tensor, alpha: float) -> Tensor:
    """Teacher-forced normalised score of generated ``tokens`` (no <bos>, <eos> kept)."""
    model.eval()
    with torch.no_grad():
        memory = model.encode(b)
        full = torch.cat([torch.full_like(out_tokens[:, :1], BOS_ID), out_tokens], 1)
        logits, _ = model.decode(full[:, :-1], memory)
        logp = logits.log_softmax(-1).gather(2, full[:, 1:, None]).squeeze(2)
        mask = out_tokens != PAD_ID
        lengths = mask.sum(1)
        return (logp * mask).sum(1) / length_penalty(lengths, alpha)


def assert_well_formed(out: GenerationOutput, config: DecodeConfig) -> None:
    """Lengths within bounds; <eos> only last; padding after the length."""
    positions = torch.arange(out.tokens.shape[1])[None]
    assert int(out.lengths.max()) <= config.max_length
    assert torch.equal(out.tokens != PAD_ID, positions < out.lengths[:, None])
    is_eos = out.tokens == EOS_ID
    assert torch.equal(is_eos.sum(1) <= 1, torch.ones_like(out.lengths, dtype=torch.bool))
    ended = is_eos.any(1)
    last = out.tokens.gather(1, (out.lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    assert torch.equal(last[ended], torch.full_like(last[ended], EOS_ID))
    assert bool((out.lengths[ended] > config.min_length).all())
    assert bool((out.lengths[~ended] == config.max_length).all())


# --------------------------------------------------------------------------- config


def test_config_validation() -> None:
    assert DecodeConfig().max_length == 30
    with pytest.raises(ValidationError, match="min_length"):
        DecodeConfig(min_length=5, max_length=4)
    with pytest.raises(ValidationError, match="top_k"):
        DecodeConfig(strategy="top_k", top_k=0)
    with pytest.raises(ValidationError):
        DecodeConfig(beam=3)
    with pytest.raises(ValidationError):
        DecodeConfig(top_p=0.0)
    with pytest.raises(ValidationError, match="anti_lm: applies to greedy and beam"):
        DecodeConfig(strategy="nucleus", anti_lm=0.5)


def test_length_penalty_is_gnmt() -> None:
    assert length_penalty(torch.tensor(1), 1.0).item() == pytest.approx(1.0)
    assert length_penalty(torch.tensor(7), 2.0).item() == pytest.approx(4.0)
    assert length_penalty(torch.tensor(13), 0.0).item() == 1.0


# --------------------------------------------------------------------------- hand-checked


def test_constant_model_greedy_emits_its_favourite_token() -> None:
    out = generate(ConstantModel(), batch(3), DecodeConfig(max_length=4))
    assert out.tokens.tolist() == [[5, 5, 5, 5]] * 3
    assert out.lengths.tolist() == [4, 4, 4]
    assert out.scores.tolist() == pytest.approx([4 * math.log(0.6)] * 3, abs=1e-5)
    assert out.beams is None


def test_constant_model_beam_prefers_short_without_penalty() -> None:
    out = generate(ConstantModel(), batch(2), DecodeConfig(strategy="beam", beam_size=2))
    assert out.beams is not None
    assert out.beams.tokens[0, 0, :1].tolist() == [EOS_ID]
    assert out.beams.tokens[0, 1, :2].tolist() == [5, EOS_ID]
    assert out.beams.lengths.tolist() == [[1, 2]] * 2
    expected = [math.log(0.3), math.log(0.6) + math.log(0.3)]
    assert out.beams.scores.tolist() == [pytest.approx(expected, abs=1e-5)] * 2
    assert out.tokens[:, :1].tolist() == [[EOS_ID]] * 2


def test_constant_model_beam_with_length_penalty_runs_to_max_length() -> None:
    # With alpha = 2 the normalised score grows with length: 30 fives (unfinished) beat
    # every hypothesis that ends with <eos> (29 fives + <eos> scores lower).
    config = DecodeConfig(strategy="beam", beam_size=2, length_penalty=2.0)
    out = generate(ConstantModel(), batch(1), config)
    assert out.tokens.tolist() == [[5] * 30]
    assert out.scores.item() == pytest.approx(30 * math.log(0.6) / (35 / 6) ** 2, abs=1e-5)
    assert out.beams is not None
    second = (29 * math.log(0.6) + math.log(0.3)) / (35 / 6) ** 2
    assert out.beams.scores[0, 1].item() == pytest.approx(second, abs=1e-5)


def test_constant_model_min_length_blocks_eos() -> None:
    config = DecodeConfig(strategy="beam", beam_size=2, min_length=3)
    out = generate(ConstantModel(), batch(1), config)
    assert out.tokens.tolist() == [[5, 5, 5, EOS_ID]]
    assert out.scores.item() == pytest.approx(3 * math.log(0.6) + math.log(0.3), abs=1e-5)


def test_constant_model_no_repeat_ngram() -> None:
    out = generate(ConstantModel(), batch(1), DecodeConfig(no_repeat_ngram=2))
    assert out.tokens.tolist() == [[5, 5, EOS_ID]]
    # A unigram block forbids any token twice: 5, then <eos>.
    out = generate(ConstantModel(), batch(1), DecodeConfig(no_repeat_ngram=1))
    assert out.tokens.tolist() == [[5, EOS_ID]]


def test_constant_model_sampling_filters() -> None:
    b = batch(16)
    top1 = generate(ConstantModel(), b, DecodeConfig(strategy="top_k", top_k=1, max_length=6))
    assert top1.tokens.tolist() == [[5] * 6] * 16
    narrow = DecodeConfig(strategy="nucleus", top_p=0.5, max_length=6)
    assert generate(ConstantModel(), b, narrow).tokens.tolist() == [[5] * 6] * 16
    wide = generate(ConstantModel(), b, DecodeConfig(strategy="nucleus", top_p=0.85, seed=3))
    assert set(wide.tokens.unique().tolist()) == {PAD_ID, 5, EOS_ID}  # token 6 is cut off


def test_anti_lm_ranks_what_the_history_adds_over_its_first_tokens() -> None:
    b = batch(3)
    words = b.history.input_ids[:, 1].tolist()
    plain = generate(EchoModel(), b, DecodeConfig(max_length=3))
    assert plain.tokens.tolist() == [[5, 5, 5]] * 3
    # First token: the word ranks log 0.3 - 0.5 log 1e-12 = 12.6 against token 5's
    # log 0.5 - 0.5 log 0.8 = -0.58; past anti_lm_tokens = 1 the plain argmax (5) is back.
    config = DecodeConfig(max_length=3, anti_lm=0.5, anti_lm_tokens=1)
    out = generate(EchoModel(), b, config)
    assert out.tokens.tolist() == [[w, 5, 5] for w in words]
    first = math.log(0.3) - 0.5 * math.log(1e-12)
    assert out.scores.tolist() == pytest.approx([first + 2 * math.log(0.5)] * 3, rel=1e-5)
    # Over every token (anti_lm_tokens 0): <eos> (log 0.2 - 0.5 log 0.2 = -0.80) loses to
    # token 5 (-0.58), and a unigram block lets neither the word nor 5 come twice.
    every = DecodeConfig(max_length=4, anti_lm=0.5, no_repeat_ngram=1)
    assert generate(EchoModel(), b, every).tokens.tolist() == [[w, 5, EOS_ID] for w in words]
    for strategy in ("beam", "hier_beam"):  # a beam of one is greedy search
        one = config.model_copy(update={"strategy": strategy, "beam_size": 1})
        assert generate(EchoModel(), b, one).tokens.tolist() == out.tokens.tolist()


def reference_anti_lm_greedy(model: Seq2SeqModel, b: GenerateBatch, config: DecodeConfig):
    """Li et al.'s anti-LM greedy written out: both distributions re-decoded from the whole
    prefix each step, one example at a time, with no cache."""
    empty = History.empty_turn(b.batch_size, "cpu")
    model.eval()
    rows = []
    with torch.no_grad():
        memory = model.encode(b)
        unconditional = model.encode(dataclasses.replace(b, history=empty))
        for i in range(b.batch_size):
            index = torch.tensor([i])
            mine, theirs = select_batch_dim(memory, index), select_batch_dim(unconditional, index)
            prefix = [BOS_ID]
            while len(prefix) <= config.max_length and prefix[-1] != EOS_ID:
                tokens = torch.tensor([prefix])
                logp = model.decode(tokens, mine)[0][0, -1].log_softmax(-1)
                logp[[PAD_ID, BOS_ID]] = float("-inf")
                if len(prefix) <= config.anti_lm_tokens:
                    logp -= config.anti_lm * model.decode(tokens, theirs)[0][0, -1].log_softmax(-1)
                prefix.append(int(logp.argmax()))
            rows.append(prefix[1:])
    return rows


# --------------------------------------------------------------------------- real models

MODELS = ["tiny", "s2sa", "hred", "vhred", "vhcr"]


def make(name: str, seed: int = 0) -> Seq2SeqModel:
    """A model whose outputs depend on the history and vary between steps: freshly
    initialised models mostly repeat one token, which would make most checks vacuous."""
    model = tiny(seed) if name == "tiny" else rnn(name, seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 3.0 / p.shape[-1] ** 0.5)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model  # type: ignore[return-value]


@pytest.mark.parametrize("name", MODELS)
def test_beam_one_equals_greedy_and_scores_are_true(name: str) -> None:
    model, b = make(name), batch(4)
    greedy = generate(model, b, DecodeConfig(max_length=12))
    beam1 = generate(model, b, DecodeConfig(strategy="beam", beam_size=1, max_length=12))
    assert torch.equal(greedy.tokens, beam1.tokens)
    assert torch.allclose(greedy.scores, beam1.scores, atol=1e-5)
    assert_well_formed(greedy, DecodeConfig(max_length=12))
    if name not in ("vhred", "vhcr"):  # their latent is resampled by a plain encode()
        assert torch.allclose(rescore(model, b, greedy.tokens, 0.0), greedy.scores, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_scores_sorted_true_and_not_worse_than_greedy(name: str, alpha: float) -> None:
    model, b = make(name), batch(4)
    config = DecodeConfig(strategy="beam", beam_size=4, max_length=10, length_penalty=alpha)
    out = generate(model, b, config)
    assert out.beams is not None
    scores = out.beams.scores
    assert torch.equal(scores, scores.sort(dim=1, descending=True).values)
    assert torch.isfinite(scores).all()
    assert torch.equal(out.scores, scores[:, 0])
    assert_well_formed(out, config)
    greedy = generate(model, b, DecodeConfig(max_length=10, length_penalty=alpha))
    assert bool((out.scores >= greedy.scores - 1e-5).all())
    if name not in ("vhred", "vhcr"):
        for beam in range(4):
            tokens = out.beams.tokens[:, beam]
            assert torch.allclose(rescore(model, b, tokens, alpha), scores[:, beam], atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(max_length=8),
        DecodeConfig(strategy="beam", beam_size=3, max_length=8, no_repeat_ngram=2),
        DecodeConfig(strategy="nucleus", top_p=0.9, max_length=8, seed=4),
    ],
    ids=["greedy", "beam", "nucleus"],
)
def test_cache_on_off_identical(name: str, config: DecodeConfig) -> None:
    model, b = make(name), batch(3)
    cached = generate(model, b, config)
    uncached = generate(model, b, config.model_copy(update={"use_cache": False}))
    assert torch.equal(cached.tokens, uncached.tokens)
    assert torch.allclose(cached.scores, uncached.scores, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", "s2sa", "hred"])
def test_anti_lm_greedy_equals_the_written_out_search_and_beam_one(name: str) -> None:
    model, b = make(name), batch(4)
    config = DecodeConfig(max_length=8, anti_lm=0.4, anti_lm_tokens=3)
    out = generate(model, b, config)
    got = [row[:n] for row, n in zip(out.tokens.tolist(), out.lengths.tolist(), strict=True)]
    assert got == reference_anti_lm_greedy(model, b, config)
    assert (
        got
        != [  # the anti-LM changed some answer: the check above is not vacuous
            row[:n]
            for out_plain in [generate(model, b, DecodeConfig(max_length=8))]
            for row, n in zip(out_plain.tokens.tolist(), out_plain.lengths.tolist(), strict=True)
        ]
    )
    beam1 = generate(model, b, config.model_copy(update={"strategy": "beam", "beam_size": 1}))
    assert torch.equal(out.tokens, beam1.tokens)
    assert torch.allclose(out.scores, beam1.scores, atol=1e-5)
    uncached = generate(model, b, config.model_copy(update={"use_cache": False}))
    assert torch.equal(out.tokens, uncached.tokens)


@pytest.mark.parametrize("name", ["tiny", "s2sa", "hred"])
def test_batched_equals_one_by_one(name: str) -> None:
    model, b = make(name), batch(3)
    config = DecodeConfig(strategy="beam", beam_size=3, max_length=8)
    together = generate(model, b, config)
    for i in range(3):
        one = random_generate_batch(3, VOCAB, seed=1)
        single = GenerateBatch(
            history=type(one.history)(
                *(t[i : i + 1] for t in vars(one.history).values())  # type: ignore[arg-type]
            ),
            target_ids=one.target_ids[i : i + 1],
            target_mask=one.target_mask[i : i + 1],
            turn=one.turn[i : i + 1],
            dialogue_id=one.dialogue_id[i : i + 1],
        )
        alone = generate(model, single, config)
        n = int(alone.lengths[0])
        assert together.tokens[i, :n].tolist() == alone.tokens[0, :n].tolist()
        # float32 sums of per-step log-probabilities: a batch of 3 and a batch of 1 take
        # other matmul kernels (their choice depends on the thread count), which moves the
        # last bits of each step; 1e-5 failed by 2e-5 on 2 threads, on the old code too.
        assert together.scores[i].item() == pytest.approx(alone.scores[0].item(), abs=1e-4)


@pytest.mark.parametrize("name", ["tiny", "s2sa"])
def test_min_and_max_length_respected(name: str) -> None:
    model, b = make(name), batch(4)
    for config in (
        DecodeConfig(min_length=6, max_length=9),
        DecodeConfig(strategy="beam", beam_size=3, min_length=6, max_length=9),
        DecodeConfig(strategy="nucleus", min_length=4, max_length=5, seed=1),
    ):
        out = generate(model, b, config)
        assert_well_formed(out, config)
        assert bool((out.lengths >= config.min_length).all())


def _has_repeat(row: list[int], n: int) -> bool:
    grams = [tuple(row[i : i + n]) for i in range(len(row) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_no_repeat_ngram_blocks_repeats(strategy: str) -> None:
    model, b = make("s2sa", seed=2), batch(6)
    base = DecodeConfig(strategy=strategy, beam_size=3, max_length=30)
    free = generate(model, b, base)
    # An untrained model loops, so the blocking below has something to prevent.
    assert any(
        _has_repeat(r[:n], 2) for r, n in zip(free.tokens.tolist(), free.lengths, strict=True)
    )
    blocked = generate(model, b, base.model_copy(update={"no_repeat_ngram": 2}))
    for row, n in zip(blocked.tokens.tolist(), blocked.lengths.tolist(), strict=True):
        assert not _has_repeat([BOS_ID, *row[:n]], 2)


@pytest.mark.parametrize("name", ["tiny", "vhred"])
def test_sampling_seeded(name: str) -> None:
    model, b = make(name), batch(4)
    config = DecodeConfig(strategy="nucleus", top_p=0.95, max_length=10, seed=7)
    first, again = generate(model, b, config), generate(model, b, config)
    assert torch.equal(first.tokens, again.tokens)
    other = generate(model, b, config.model_copy(update={"seed": 8}))
    assert not torch.equal(first.tokens, other.tokens)


@pytest.mark.parametrize("name", ["tiny", "hred"])
def test_top_k_one_equals_greedy(name: str) -> None:
    model, b = make(name), batch(4)
    greedy = generate(model, b, DecodeConfig(max_length=10))
    top1 = generate(model, b, DecodeConfig(strategy="top_k", top_k=1, max_length=10, seed=3))
    assert torch.equal(greedy.tokens, top1.tokens)


def test_generate_restores_training_mode_and_rng() -> None:
    model = rnn("vhcr")
    model.train()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    generate(model, batch(2), DecodeConfig(strategy="top_k", top_k=5, max_length=5))
    assert model.training
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------------- hier_beam


def test_constant_model_hier_beam_normalises_by_length() -> None:
    """The authors' beam keeps the ended ``<eos>`` in its slot while ``5 5 5 ..`` stays
    alive; at the end the mean log-probability picks the long one (log 0.6 per token
    beats log 0.3), where the plain beam picks ``<eos>``."""
    config = DecodeConfig(strategy="hier_beam", beam_size=2, max_length=4)
    out = generate(ConstantModel(), batch(2), config)
    assert out.tokens.tolist() == [[5, 5, 5, 5]] * 2
    assert out.scores.tolist() == pytest.approx([math.log(0.6)] * 2, abs=1e-5)
    assert out.beams is not None and out.beams.lengths.tolist() == [[4, 1]] * 2
    assert out.beams.tokens[0, 1, :1].tolist() == [EOS_ID]
    assert out.beams.scores[0, 1].item() == pytest.approx(math.log(0.3), abs=1e-5)


def authors_beam(model: Seq2SeqModel, b: GenerateBatch, k: int, max_length: int) -> list:
    """The authors' algorithm written plainly, one example and one slot at a time, from the
    full prefix (no cache): (tokens without <bos>, mean log-probability) per example."""
    model.eval()
    answers = []
    with torch.no_grad():
        for i in range(b.batch_size):
            one = random_generate_batch(b.batch_size, VOCAB, seed=1)  # the same batch
            memory = model.encode(one)
            slots = [([BOS_ID], 0.0, False)]
            for _ in range(max_length):
                options = []
                for tokens, score, ended in slots:
                    if ended:
                        options.append(([*tokens, PAD_ID], score, True))
                        continue
                    rows = torch.tensor([tokens] * b.batch_size)
                    logits, _ = model.decode(rows, memory, None)
                    logp = logits[i, -1].float().log_softmax(-1)
                    logp[PAD_ID] = logp[BOS_ID] = float("-inf")
                    for token in range(logp.shape[0]):
                        value = score + float(logp[token])
                        options.append(([*tokens, token], value, token == EOS_ID))
                options.sort(key=lambda o: o[1], reverse=True)
                slots = options[:k]
                if all(ended for _, _, ended in slots):
                    break

            def mean(slot):
                generated = [t for t in slot[0][1:] if t != PAD_ID]
                return slot[1] / len(generated)

            best = max(slots, key=mean)
            answers.append(([t for t in best[0][1:] if t != PAD_ID], mean(best)))
    return answers


@pytest.mark.parametrize("name", ["tiny", "s2sa"])
def test_hier_beam_equals_the_authors_algorithm(name: str) -> None:
    model, b = make(name), batch(3)
    config = DecodeConfig(strategy="hier_beam", beam_size=3, max_length=7)
    out = generate(model, b, config)
    assert_well_formed(out, config)
    for i, (tokens, score) in enumerate(authors_beam(model, b, 3, 7)):
        assert out.tokens[i, : out.lengths[i]].tolist() == tokens
        assert out.scores[i].item() == pytest.approx(score, abs=1e-4)
    uncached = generate(model, b, config.model_copy(update={"use_cache": False}))
    assert torch.equal(out.tokens, uncached.tokens)
    rescored = rescore(model, b, out.tokens, 0.0) / out.lengths
    assert torch.allclose(rescored, out.scores, atol=1e-4)
