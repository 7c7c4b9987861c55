"""One batched ``generate()`` for every ``Seq2SeqModel``: greedy, beam, top-k, nucleus.

Conventions:
- Decoding starts from ``<bos>``; ``max_length`` counts generated tokens (the final
  ``<eos>`` included), ``min_length`` the tokens that must precede ``<eos>``.
- Returned ``tokens`` exclude ``<bos>``, include the ``<eos>`` when one was produced, and
  are padded with ``<pad>``; ``lengths`` count them (``<eos>`` included).
- ``<pad>`` and ``<bos>`` are never generated.
- A hypothesis' score is its summed token log-probability (``log_softmax`` of the raw
  logits, tokens blocked by ``min_length``/``no_repeat_ngram`` at ``-inf``, temperature
  and top-k/top-p filtering not applied) divided by the GNMT length penalty
  ``((5 + length) / 6) ** length_penalty`` (Wu et al., 2016); ``length_penalty=0`` keeps
  the plain sum. Beam search ranks hypotheses by that score; greedy and sampled outputs
  report it too, so strategies are comparable.
- ``anti_lm`` > 0 is Li et al. (2016)'s MMI-antiLM ("A Diversity-Promoting Objective
  Function for Neural Conversation Models", eq. 7-8): greedy and beam searches rank the
  next token by ``log p(y_t | y_<t, history) - anti_lm * log U(y_t | y_<t)`` for the first
  ``anti_lm_tokens`` generated tokens (their gamma; 0 = all), and the score above sums
  that objective. Their U is a separately trained language model of responses; here it
  is the same model after an empty history (``History.empty_turn``), what the model says
  whatever it is told, so the objective rewards what the history adds.
- With ``use_cache`` and a model whose ``init_state`` returns a state, each step feeds
  only the new token; otherwise the whole prefix is re-decoded (same outputs).
- The model runs in eval mode (no dropout) under ``torch.no_grad``, with the global RNG
  seeded from ``seed`` inside a forked RNG state, so model-internal sampling (VHRED's
  latent) repeats with the seed and the caller's RNG is untouched. Token sampling draws
  from its own ``torch.Generator`` seeded with ``seed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from pipeline.config import DecodeStrategy, check_anti_lm
from pipeline.data.batch import GenerateBatch, History
from pipeline.data.special import BOS_ID, EOS_ID, PAD_ID
from pipeline.execution import forked_rng
from pipeline.models.base import DecoderState, Seq2SeqModel, select_batch_dim


class DecodeConfig(BaseModel):
    """How to decode. Sampling strategies apply ``temperature``, then keep the ``top_k``
    most likely tokens (if ``top_k > 0``), then the smallest set whose probability reaches
    ``top_p`` (if ``top_p < 1``); ``nucleus`` with ``top_p=1`` is plain sampling."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: DecodeStrategy = DecodeStrategy.GREEDY
    beam_size: int = Field(default=5, ge=1)
    length_penalty: float = Field(default=0.0, ge=0.0)
    min_length: int = Field(default=0, ge=0)
    max_length: int = Field(default=30, ge=1, description="the U-Net paper decodes 30 tokens")
    no_repeat_ngram: int = Field(default=0, ge=0, description="0 = off")
    top_k: int = Field(default=0, ge=0, description="0 = off")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    temperature: float = Field(default=1.0, gt=0.0)
    seed: int = 0
    anti_lm: float = Field(default=0.0, ge=0.0, description="MMI-antiLM weight; 0 = off")
    anti_lm_tokens: int = Field(default=0, ge=0, description="tokens it applies to; 0 = all")
    use_cache: bool = True

    @model_validator(mode="after")
    def _check(self) -> DecodeConfig:
        if self.min_length > self.max_length:
            raise ValueError("min_length: must not exceed max_length")
        if self.strategy == DecodeStrategy.TOP_K and self.top_k < 1:
            raise ValueError("top_k: strategy top_k needs top_k >= 1")
        check_anti_lm(self.strategy, self.anti_lm)
        return self


@dataclass
class Beams:
    """Every kept hypothesis of a beam search: ``tokens`` ``[B, K, T]``, ``lengths`` and
    ``scores`` ``[B, K]``, sorted by score (best first)."""

    tokens: Tensor
    lengths: Tensor
    scores: Tensor


@dataclass
class GenerationOutput:
    """The chosen response per example: ``tokens`` ``[B, T]``, ``lengths`` and ``scores``
    ``[B]`` (see the module docstring); ``beams`` for beam search."""

    tokens: Tensor
    lengths: Tensor
    scores: Tensor
    beams: Beams | None = None


def length_penalty(lengths: Tensor, alpha: float) -> Tensor:
    """GNMT length normalisation ``((5 + length) / 6) ** alpha``."""
    return ((5.0 + lengths.float()) / 6.0) ** alpha


def generate(model: Seq2SeqModel, batch: GenerateBatch, config: DecodeConfig) -> GenerationOutput:
    """Decode a response for every example of ``batch`` (on the model's device)."""
    was_training = model.training
    model.eval()
    device = batch.target_ids.device
    try:
        with torch.no_grad(), forked_rng(device):
            torch.manual_seed(config.seed)
            memory = model.encode(batch)
            unconditional = None
            if config.anti_lm > 0:
                empty = History.empty_turn(batch.batch_size, device)
                unconditional = model.encode(dataclasses.replace(batch, history=empty))
            search = Search(model, memory, batch.batch_size, device, config, unconditional)
            return _SEARCHES.get(config.strategy, _sample)(search)
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class Search:
    """One decoding's inputs: the model, its memory of the batch, the batch's size, the
    device and the decoding config (each strategy's function takes it); with ``anti_lm``,
    the model's memory of empty histories (``unconditional``)."""

    model: Seq2SeqModel
    memory: object
    batch_size: int
    device: torch.device
    config: DecodeConfig
    unconditional: object | None = None

    def anti_lm(self, rows: Tensor | None = None) -> _AntiLM:
        """The anti-LM term for the search's rows (``rows``: the example of each row)."""
        memory = self.unconditional
        if memory is not None and rows is not None:
            memory = select_batch_dim(memory, rows)
        n = self.batch_size if rows is None else len(rows)
        return _AntiLM(self.model, memory, n, self.config)

    def __iter__(self) -> Iterator[Any]:  # unpacks as its fields, shallow (not astuple)
        return iter((self.model, self.memory, self.batch_size, self.device, self.config))


# --------------------------------------------------------------------------- steps


class _Stepper:
    """Next-token logits for a growing prefix, incrementally when the model allows."""

    def __init__(self, model: Seq2SeqModel, memory: object, rows: int, use_cache: bool):
        self.model, self.memory = model, memory
        self.state: DecoderState | None = model.init_state(memory, rows) if use_cache else None

    def __call__(self, prefix: Tensor) -> Tensor:
        """``prefix`` ``[N, t]`` -> logits of token ``t + 1``: ``[N, V]`` (float32)."""
        if self.state is not None:
            logits, self.state = self.model.decode(prefix[:, -1:], self.memory, self.state)
        else:
            logits, _ = self.model.decode(prefix, self.memory, None)
        return logits[:, -1].float()

    def reorder(self, index: Tensor) -> None:
        """Follow the beams to their new rows. The memory needs no reordering: a beam's
        parent belongs to the same example, whose memory rows are identical."""
        if self.state is not None:
            self.state = self.state.select(index)


class _AntiLM:
    """The MMI-antiLM ranking of next tokens (module docstring): ``log p - anti_lm * log U``
    over the first ``anti_lm_tokens`` tokens, ``log p`` itself without an unconditional
    memory or past them."""

    def __init__(self, model: Seq2SeqModel, memory: object | None, rows: int, config: DecodeConfig):
        self.weight, self.tokens = config.anti_lm, config.anti_lm_tokens
        self.step = None if memory is None else _Stepper(model, memory, rows, config.use_cache)

    def __call__(self, logp: Tensor, prefix: Tensor) -> Tensor:
        """``logp`` ``[N, V]`` (blocked tokens at ``-inf``) -> the ranking of token ``t + 1``."""
        if self.step is None or (self.tokens and prefix.shape[1] > self.tokens):
            return logp
        return logp - self.weight * self.step(prefix).log_softmax(-1)

    def reorder(self, index: Tensor) -> None:
        if self.step is not None:
            self.step.reorder(index)


def _blocked(prefix: Tensor, vocab: int, config: DecodeConfig) -> Tensor:
    """``[N, V]`` True where the next token is forbidden: ``<pad>`` and ``<bos>`` always,
    ``<eos>`` before ``min_length`` generated tokens, tokens completing an n-gram already
    in the prefix."""
    rows, t = prefix.shape
    blocked = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=prefix.device)
    blocked[:, [PAD_ID, BOS_ID]] = True
    if t - 1 < config.min_length:  # the prefix holds <bos> + (t - 1) generated tokens
        blocked[:, EOS_ID] = True
    n = config.no_repeat_ngram
    if n > 0 and t >= n:
        grams = prefix.unfold(1, n, 1)  # [N, t - n + 1, n]
        seen = (grams[:, :, :-1] == prefix[:, None, t - n + 1 :]).all(-1)
        banned = torch.where(seen, grams[:, :, -1], vocab)  # index `vocab` is a dump slot
        blocked.scatter_(1, banned, True)
    return blocked[:, :vocab]


def _filter(logits: Tensor, config: DecodeConfig) -> Tensor:
    """Temperature, top-k and top-p filtering of ``[N, V]`` logits (``-inf`` = removed)."""
    logits = logits / config.temperature
    if config.top_k > 0:
        kth = logits.topk(min(config.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first
        # token is always kept).
        drop_sorted = (probs.cumsum(-1) - probs) >= config.top_p
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# --------------------------------------------------------------------------- greedy / sampling


def _sample(search: Search) -> GenerationOutput:
    """Greedy decoding or sampling, one row per example."""
    model, memory, batch_size, device, config = search
    step = _Stepper(model, memory, batch_size, config.use_cache)
    anti_lm = search.anti_lm()
    generator = torch.Generator(device=device).manual_seed(config.seed)
    seqs = torch.full((batch_size, config.max_length + 1), PAD_ID, device=device)
    seqs[:, 0] = BOS_ID
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
    scores = torch.zeros(batch_size, device=device)
    t = 0
    for t in range(config.max_length):
        prefix = seqs[:, : t + 1]
        logits = step(prefix)
        blocked = _blocked(prefix, logits.shape[-1], config)
        logp = logits.log_softmax(-1).masked_fill(blocked, float("-inf"))
        logits = logits.masked_fill(blocked, float("-inf"))
        logp = anti_lm(logp, prefix)
        if config.strategy == DecodeStrategy.GREEDY:
            token = logp.argmax(-1)
        else:
            probs = _filter(logits, config).softmax(-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        token = token.masked_fill(finished, PAD_ID)
        scores += logp.gather(1, token[:, None]).squeeze(1).masked_fill(finished, 0.0)
        seqs[:, t + 1] = token
        lengths += ~finished
        finished |= token == EOS_ID
        if bool(finished.all()):
            break
    tokens = seqs[:, 1 : t + 2]
    return GenerationOutput(
        tokens, lengths, scores / length_penalty(lengths, config.length_penalty)
    )


# --------------------------------------------------------------------------- beam search


def _beam_search(search: Search) -> GenerationOutput:
    """Batched beam search over ``batch_size x beam_size`` rows.

    Each step takes the ``2K`` best continuations per example: those among the first
    ``K`` that end in ``<eos>`` enter the pool of finished hypotheses (the ``K`` best by
    normalised score are kept), the ``K`` best others stay alive. An example is done when
    its ``K``-th finished score beats the best score any alive beam could still reach (its
    current sum divided by the largest length penalty, as log-probabilities only lower the
    sum), so stopping early never changes the result.
    """
    model, memory, batch_size, device, config = search
    b, k, width = batch_size, config.beam_size, config.max_length + 1
    rows = torch.arange(b, device=device)
    expand = rows.repeat_interleave(k)
    step = _Stepper(model, select_batch_dim(memory, expand), b * k, config.use_cache)
    anti_lm = search.anti_lm(expand)
    seqs = torch.full((b * k, width), PAD_ID, device=device)
    seqs[:, 0] = BOS_ID
    alive = torch.zeros(b, k, device=device)
    alive[:, 1:] = float("-inf")  # identical beams at the start: expand only the first
    pool_scores = torch.full((b, k), float("-inf"), device=device)
    pool_tokens = torch.full((b, k, width), PAD_ID, device=device)
    pool_lengths = torch.zeros(b, k, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    best_penalty = ((5.0 + config.max_length) / 6.0) ** config.length_penalty
    for t in range(config.max_length):
        prefix = seqs[:, : t + 1]
        logits = step(prefix)
        vocab = logits.shape[-1]
        logp = logits.log_softmax(-1).masked_fill(_blocked(prefix, vocab, config), float("-inf"))
        logp = anti_lm(logp, prefix)
        candidates = (alive.view(-1, 1) + logp).view(b, k * vocab)
        top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=1)
        beam, token = top_index // vocab, top_index % vocab
        extended = seqs.view(b, k, width).gather(1, beam[..., None].expand(-1, -1, width))
        extended[:, :, t + 1] = token
        length = torch.full_like(token, t + 1)

        # Finished candidates ranked among the K best join the pool (so beam_size=1 is
        # greedy search); rows already done accept no more.
        is_eos = token == EOS_ID
        in_beam = torch.arange(token.shape[1], device=device) < k
        eos_scores = top_scores / length_penalty(length, config.length_penalty)
        eos_scores = eos_scores.masked_fill(~(is_eos & in_beam) | done[:, None], float("-inf"))
        pool_scores, pool_tokens, pool_lengths = _keep_best(
            k,
            torch.cat([pool_scores, eos_scores], 1),
            torch.cat([pool_tokens, extended], 1),
            torch.cat([pool_lengths, length], 1),
        )

        # The K best non-<eos> candidates continue (a stable sort keeps their order).
        keep = is_eos.long().sort(dim=1, stable=True).indices[:, :k]
        alive = top_scores.gather(1, keep)
        parent = (rows[:, None] * k + beam.gather(1, keep)).view(-1)
        seqs = extended.gather(1, keep[..., None].expand(-1, -1, width)).view(b * k, width)
        step.reorder(parent)
        anti_lm.reorder(parent)

        done |= pool_scores[:, -1] >= alive.max(1).values / best_penalty
        if bool(done.all()):
            break
    else:
        # Out of length: alive beams compete unfinished (rows already done are settled).
        length = torch.full_like(pool_lengths, config.max_length)
        final = alive / length_penalty(length, config.length_penalty)
        final = final.masked_fill(done[:, None], float("-inf"))
        pool_scores, pool_tokens, pool_lengths = _keep_best(
            k,
            torch.cat([pool_scores, final], 1),
            torch.cat([pool_tokens, seqs.view(b, k, width)], 1),
            torch.cat([pool_lengths, length], 1),
        )
    used = int(pool_lengths.max()) if pool_lengths.numel() else 0
    beams = Beams(pool_tokens[:, :, 1 : used + 1], pool_lengths, pool_scores)
    best = int(pool_lengths[:, 0].max()) if b else 0
    tokens = beams.tokens[:, 0, :best]
    return GenerationOutput(tokens, pool_lengths[:, 0], pool_scores[:, 0], beams)


def _slot_beam_search(search: Search) -> GenerationOutput:
    """The HT-Encoder authors' beam search (their ``Beam.py`` and ``translate_batch``):
    ``K`` slots per example ranked by summed log-probability; a slot that produced
    ``<eos>`` keeps its place and its score (it continues with ``<pad>`` at no cost) until
    ``K`` better unfinished continuations push it out; the search ends when every slot has
    ended or after ``max_length`` tokens, and the answer is the slot with the best MEAN
    token log-probability (``<eos>`` counted). Unlike theirs, ``<pad>``/``<bos>`` are never
    generated and ``min_length``/``no_repeat_ngram`` apply as for every strategy."""
    model, memory, batch_size, device, config = search
    b, k, width = batch_size, config.beam_size, config.max_length + 1
    rows = torch.arange(b, device=device)
    expand = rows.repeat_interleave(k)
    step = _Stepper(model, select_batch_dim(memory, expand), b * k, config.use_cache)
    anti_lm = search.anti_lm(expand)
    seqs = torch.full((b * k, width), PAD_ID, device=device)
    seqs[:, 0] = BOS_ID
    scores = torch.zeros(b, k, device=device)
    scores[:, 1:] = float("-inf")  # identical slots at the start: expand only the first
    ended = torch.zeros(b * k, dtype=torch.bool, device=device)
    lengths = torch.zeros(b * k, dtype=torch.long, device=device)
    for t in range(config.max_length):
        prefix = seqs[:, : t + 1]
        logits = step(prefix)
        vocab = logits.shape[-1]
        logp = logits.log_softmax(-1).masked_fill(_blocked(prefix, vocab, config), float("-inf"))
        logp = anti_lm(logp, prefix)
        # An ended slot's only continuation is <pad> at no cost.
        stay = torch.full_like(logp, float("-inf"))
        stay[:, PAD_ID] = 0.0
        logp = torch.where(ended[:, None], stay, logp)
        candidates = (scores.view(-1, 1) + logp).view(b, k * vocab)
        scores, index = candidates.topk(k, dim=1)
        beam, token = index // vocab, index % vocab
        parent = (rows[:, None] * k + beam).view(-1)
        seqs = seqs[parent]
        seqs[:, t + 1] = token.view(-1)
        was_ended = ended[parent]
        lengths = lengths[parent] + (~was_ended).long()
        ended = was_ended | (token.view(-1) == EOS_ID)
        step.reorder(parent)
        anti_lm.reorder(parent)
        if bool(ended.all()):
            break
    mean = scores / lengths.view(b, k).clamp(min=1)
    order = mean.sort(dim=1, descending=True).indices
    take = (rows[:, None] * k + order).view(-1)
    tokens = seqs[take, 1:].view(b, k, -1)
    beams = Beams(tokens, lengths[take].view(b, k), mean.gather(1, order))
    best = int(beams.lengths[:, 0].max()) if b else 0
    return GenerationOutput(
        beams.tokens[:, 0, :best], beams.lengths[:, 0], beams.scores[:, 0], beams
    )


def _keep_best(
    k: int, scores: Tensor, tokens: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``k`` best hypotheses per example, sorted by score."""
    scores, index = scores.topk(k, dim=1)
    tokens = tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1]))
    return scores, tokens, lengths.gather(1, index)


_SEARCHES = {DecodeStrategy.BEAM: _beam_search, DecodeStrategy.HIER_BEAM: _slot_beam_search}
