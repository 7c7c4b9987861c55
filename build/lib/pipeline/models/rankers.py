"""Response-selection baselines of the HRT paper, score ensembles and DSTC7's NONE candidate.

- ``dual_lstm`` (Lowe et al., 2015): one LSTM (tied weights) encodes the flat context
  and each candidate; logit ``c^T M r + b``.
- ``hier_lstm``: an utterance LSTM encodes each utterance and each candidate, a context
  LSTM runs over the utterance vectors (HRED's encoder); the same bilinear logit.
- ``transformer_ranker``: the flat context and each candidate through the same
  Transformer blocks, then bi-directional highway attention, max-pool, dot product (the
  paper's "Transformer"); ``transformer_last_ranker`` sees only the last utterance.
- ``Ensemble``: sums the logits of several models (the paper sums scores before the
  sigmoid).
- DSTC7 subtask 4 ("maybe no correct answer"): ``WithNoneCandidate`` appends a virtual
  NONE candidate with logit 0 (the BCE decision threshold, sigmoid(0) = 1/2), labelled
  correct exactly when no real candidate is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from pipeline.data.batch import SelectBatch
from pipeline.models import masks
from pipeline.models.base import LossOutput, ModelConfig, SelectModel
from pipeline.models.registry import register
from pipeline.models.selection import (
    FeatureEmbedding,
    HighwayAttention,
    RankingLoss,
    RankingModel,
    SelectConfig,
    SequenceEncoder,
    TransformerSelectConfig,
    bidirectional_score,
    check_knowledge,
    encode_candidates,
    ranking_loss,
)
from pipeline.models.utterances import split_utterances
from pipeline.names import Task

# --------------------------------------------------------------------------- LSTM baselines


def _lengths(mask: Tensor, name: str) -> Tensor:
    """Lengths of left-aligned ``mask`` rows ``[..., L]``; errors if a row has gaps."""
    lengths = mask.sum(-1)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    if not torch.equal(mask, positions < lengths[..., None]):
        raise ValueError(f"{name}: real tokens must come first, padding last")
    return lengths


def run_lstm(lstm: nn.LSTM, x: Tensor, lengths: Tensor) -> Tensor:
    """Final hidden state ``[N, hidden]`` of ``x`` ``[N, L, d]`` read up to ``lengths``
    (packed, so padding never enters). Empty rows read one (zero-embedded pad) step."""
    packed = nn.utils.rnn.pack_padded_sequence(
        x, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False
    )
    _, (hidden, _) = lstm(packed)
    return hidden[-1]


class LSTMRankerConfig(SelectConfig):
    """Lowe et al.'s dual encoder: 300-d embeddings, 200 LSTM units."""

    d_hidden: int = Field(200, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)


class HierLSTMConfig(LSTMRankerConfig):
    """The MiuLab hierarchical RNN: 128 units per LSTM."""

    d_hidden: int = Field(128, ge=1)


class BilinearScore(nn.Module):
    """``c^T M r + b`` for context ``[B, h]`` and candidates ``[B, N, h]`` -> ``[B, N]``.

    M starts as the identity (so training starts from the inner product)."""

    def __init__(self, d_hidden: int) -> None:
        super().__init__()
        self.M = nn.Parameter(torch.eye(d_hidden))
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, context: Tensor, candidates: Tensor) -> Tensor:
        return torch.einsum("bh,hk,bnk->bn", context, self.M, candidates) + self.b


class _LSTMRanker(RankingModel):
    """Embedding (+ knowledge features) and one LSTM shared by context and candidates."""

    config: LSTMRankerConfig
    supports_compile: ClassVar[bool] = False  # LSTMs (``recurrent``, "Compiling")
    eager_reason: ClassVar[str] = (
        "it runs nn.LSTM, which torch.compile does not trace (pipeline/models/recurrent.py)"
    )

    def __init__(self, config: LSTMRankerConfig) -> None:
        super().__init__()
        self.config = config
        d_in = config.d_embed + config.knowledge_dim
        self.embed = FeatureEmbedding(config.vocab_size, config.d_embed, config.knowledge_dim, d_in)
        self.lstm = nn.LSTM(d_in, config.d_hidden, batch_first=True)
        self.dropout = nn.Dropout(config.dropout)
        self.bilinear = BilinearScore(config.d_hidden)

    def embed_tokens(self, ids: Tensor, knowledge: Tensor | None) -> Tensor:
        return self.dropout(self.embed(ids, knowledge))

    def encode_candidates(self, batch: SelectBatch) -> Tensor:
        """``[B, N, hidden]``."""
        b, n, length = batch.candidate_ids.shape
        knowledge = check_knowledge(self.config, batch.candidate_knowledge, "candidate_knowledge")
        if knowledge is not None:
            knowledge = knowledge.reshape(b * n, length, -1)
        x = self.embed_tokens(batch.candidate_ids.reshape(b * n, length), knowledge)
        lengths = _lengths(batch.candidate_mask.reshape(b * n, length), "candidate_mask")
        return run_lstm(self.lstm, x, lengths).view(b, n, -1)


@register("dual_lstm", Task.SELECT, LSTMRankerConfig)
class DualLSTM(_LSTMRanker):
    """Lowe et al. (2015) dual encoder over the flat context."""

    def score(self, batch: SelectBatch) -> Tensor:
        history = batch.history
        knowledge = check_knowledge(self.config, batch.context_knowledge, "context_knowledge")
        x = self.embed_tokens(history.input_ids, knowledge)
        context = run_lstm(self.lstm, x, _lengths(history.input_mask, "history.input_mask"))
        return self.bilinear(context, self.encode_candidates(batch))


@register("hier_lstm", Task.SELECT, HierLSTMConfig)
class HierLSTM(_LSTMRanker):
    """Utterance LSTM (shared with the candidates) -> context LSTM -> bilinear score."""

    def __init__(self, config: LSTMRankerConfig) -> None:
        super().__init__(config)
        self.context_lstm = nn.LSTM(config.d_hidden, config.d_hidden, batch_first=True)

    def score(self, batch: SelectBatch) -> Tensor:
        knowledge = check_knowledge(self.config, batch.context_knowledge, "context_knowledge")
        utt = split_utterances(batch.history, knowledge)
        b, n_utt, utt_len = utt.ids.shape
        x = self.embed_tokens(
            utt.ids.view(b * n_utt, utt_len),
            None if utt.knowledge is None else utt.knowledge.flatten(0, 1),
        )
        lengths = _lengths(utt.mask.view(b * n_utt, utt_len), "history utterances")
        vectors = run_lstm(self.lstm, x, lengths).view(b, n_utt, -1)
        context = run_lstm(self.context_lstm, vectors, utt.count)
        return self.bilinear(context, self.encode_candidates(batch))


# --------------------------------------------------------------------------- Transformer


class TransformerRankerConfig(TransformerSelectConfig):
    """``last_utterance``: encode only the context's last utterance (Transformer-Last)."""

    last_utterance: bool = False


@register("transformer_ranker", Task.SELECT, TransformerRankerConfig, last_utterance=False)
@register("transformer_last_ranker", Task.SELECT, TransformerRankerConfig, last_utterance=True)
class TransformerRanker(RankingModel):
    """The paper's Transformer baseline: no recurrence, the whole context (global PE over
    the flat history) or only its last utterance, matched by bi-directional highway
    attention like HRT."""

    config: TransformerRankerConfig

    def __init__(self, config: TransformerRankerConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.encoder = SequenceEncoder.from_config(c)
        self.highway = HighwayAttention.from_config(c)

    def encode_context(self, batch: SelectBatch) -> tuple[Tensor, Tensor]:
        """``[B, L, d]`` and its mask.

        The last utterance alone is cut from the utterance grid, whose size is read from the
        batch; under ``torch.compile`` it stays in the flat history instead, as its only
        real tokens (positions within it, as alone): the same encodings of its tokens and
        the same scores within float rounding, at static shapes and with no host read.
        """
        history = batch.history
        knowledge = check_knowledge(self.config, batch.context_knowledge, "context_knowledge")
        if self.config.last_utterance and torch.compiler.is_compiling():
            ids, speaker, positions = history.input_ids, history.speaker, history.utt_pos
            mask = masks.final_utterance(history)
        elif self.config.last_utterance:
            utt = split_utterances(history, knowledge)
            rows = torch.arange(utt.ids.shape[0], device=utt.ids.device)
            last = (utt.count - 1).clamp(min=0)
            ids, mask, speaker = utt.ids[rows, last], utt.mask[rows, last], utt.speaker[rows, last]
            knowledge = None if utt.knowledge is None else utt.knowledge[rows, last]
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        else:
            ids, mask, speaker = history.input_ids, history.input_mask, history.speaker
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.encoder(ids, mask, positions, speaker, knowledge), mask

    def score(self, batch: SelectBatch) -> Tensor:
        context, context_mask = self.encode_context(batch)
        knowledge = check_knowledge(self.config, batch.candidate_knowledge, "candidate_knowledge")
        candidates, candidate_mask = encode_candidates(self.encoder, batch, knowledge)
        return bidirectional_score(self.highway, context, context_mask, candidates, candidate_mask)


# --------------------------------------------------------------------------- ensembles, NONE


class Ensemble(SelectModel):
    """Sum of the logits of ``models`` (trained separately, or fine-tuned together with
    the default BCE loss on the summed logits, the paper's "Ensemble & Fine Tune")."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        if not models:
            raise ValueError("models: an ensemble needs at least one model")
        for i, model in enumerate(models):
            if not isinstance(model, SelectModel):
                raise TypeError(f"models[{i}]: {type(model).__name__} is not a SelectModel")
        self.models = nn.ModuleList(models)

    @property
    def supports_compile(self) -> bool:  # type: ignore[override]
        """Whether every member compiles whole."""
        return all(getattr(m, "supports_compile", True) for m in self.models)

    def score(self, batch: SelectBatch) -> Tensor:
        return torch.stack([m.score(batch) for m in self.models]).sum(0)


NONE_LOGIT = 0.0


def append_none(logits: Tensor) -> Tensor:
    """``[B, N]`` -> ``[B, N+1]``: a virtual NONE candidate with logit 0 at the end."""
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], 1), NONE_LOGIT)], -1)


def none_labels(labels: Tensor) -> Tensor:
    """``[B, N]`` -> ``[B, N+1]``: NONE is correct exactly when no real candidate is."""
    none = (labels.sum(-1, keepdim=True) == 0).to(labels.dtype)
    return torch.cat([labels, none], -1)


class WithNoneCandidate(SelectModel):
    """DSTC7 subtask 4: scores ``[B, N+1]`` with NONE last; labels via ``none_labels``.

    Loss: BCE on the real candidates (NONE's fixed logit 0 has no parameters, and BCE
    already pushes every candidate of an answerless example below it); LSE on all N+1,
    where NONE is the positive of answerless examples and a negative otherwise.
    """

    def __init__(
        self, model: SelectModel, loss: RankingLoss | None = None, margin: float | None = None
    ) -> None:
        super().__init__()
        self.model = model
        config = getattr(model, "config", None)
        self.loss_kind = RankingLoss(loss or getattr(config, "loss", RankingLoss.BCE))
        self.margin = margin if margin is not None else getattr(config, "margin", 0.0)

    @property
    def supports_compile(self) -> bool:  # type: ignore[override]
        """Whether the wrapped model compiles whole."""
        return bool(getattr(self.model, "supports_compile", True))

    def score(self, batch: SelectBatch) -> Tensor:
        return append_none(self.model.score(batch))

    def loss(self, batch: SelectBatch) -> LossOutput:
        logits = self.model.score(batch)
        real = batch.candidate_mask.any(-1)
        if self.loss_kind == RankingLoss.BCE:
            return ranking_loss(logits, batch.labels, RankingLoss.BCE, real=real)
        with_none = torch.cat([real, real.new_ones(real.shape[0], 1)], -1)
        return ranking_loss(
            append_none(logits), none_labels(batch.labels), RankingLoss.LSE, self.margin, with_none
        )


# --------------------------------------------------------------------------- registered wrappers


class EnsembleConfig(ModelConfig):
    """An ensemble by name (HRT paper, "Ensemble"): the registered select models
    ``members``, each at its paper sizes with ``overrides[member]`` applied, logits summed."""

    members: tuple[str, ...] = ("hrt_last", "hrt_all")
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _members_are_select_models(self) -> EnsembleConfig:
        _check_select_models("members", self.members, self.overrides)
        return self


class WithNoneConfig(ModelConfig):
    """DSTC7 subtask 4 by name: the registered select model ``model`` (with ``overrides``)
    scoring a virtual NONE candidate too, trained with ``loss`` (``margin`` for LSE)."""

    model: str = "hrt_last"
    overrides: dict[str, Any] = Field(default_factory=dict)
    loss: RankingLoss = RankingLoss.BCE
    margin: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _model_is_a_select_model(self) -> WithNoneConfig:
        _check_select_models("model", (self.model,), {self.model: self.overrides})
        return self


_WRAPPERS = ("ensemble", "with_none")


def _check_select_models(
    field: str, names: Sequence[str], overrides: dict[str, dict[str, Any]]
) -> None:
    from pipeline.models import registry

    if not names:
        raise ValueError(f"{field}: name at least one model")
    select = [n for n in registry.names(Task.SELECT) if n not in _WRAPPERS]
    for name in [*names, *overrides]:
        if name not in select:
            raise ValueError(f"{field}: {name!r} is not a select model; choose among {select}")


def _member(name: str, vocab_size: int, overrides: dict[str, Any]) -> SelectModel:
    from pipeline.models import registry

    return registry.build(name, vocab_size, **overrides)  # type: ignore[return-value]


@register("ensemble", Task.SELECT, EnsembleConfig)
def build_ensemble(config: EnsembleConfig) -> Ensemble:
    return Ensemble(
        [_member(m, config.vocab_size, config.overrides.get(m, {})) for m in config.members]
    )


@register("with_none", Task.SELECT, WithNoneConfig)
def build_with_none(config: WithNoneConfig) -> WithNoneCandidate:
    inner = _member(config.model, config.vocab_size, config.overrides)
    return WithNoneCandidate(inner, config.loss, config.margin)
