"""Params of tracking (MLflow) and of the evaluate stage (decodings, word vectors, the
language models' protocol)."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.sections import CorpusKey, Section, merge_params

# --------------------------------------------------------------------------- tracking


class TrackingParams(Section):
    """``tracking``: what MLflow records (the URI comes from $MLFLOW_TRACKING_URI)."""

    enabled: bool = True
    experiment_prefix: str = Field(default="hiertx", min_length=1)
    log_model: bool = Field(default=True, description="log the final model as a pyfunc")
    register_model: bool = Field(default=True, description="register it as hiertx-<run>")
    sample_generations: int = Field(default=5, ge=0, description="validation samples logged")


# --------------------------------------------------------------------------- evaluate


class DecodeStrategy(enum.StrEnum):
    """``hier_beam``: the HT-Encoder authors' beam (``pipeline.decode.generate``)."""

    GREEDY = "greedy"
    BEAM = "beam"
    HIER_BEAM = "hier_beam"
    TOP_K = "top_k"
    NUCLEUS = "nucleus"


def check_anti_lm(strategy: DecodeStrategy, anti_lm: float) -> None:
    """The anti-LM re-ranks the tokens a search chooses between: refused for sampling."""
    if anti_lm > 0 and strategy in (DecodeStrategy.TOP_K, DecodeStrategy.NUCLEUS):
        raise ValueError(
            "anti_lm: applies to greedy and beam searches, which rank tokens; sampling "
            "draws from the model's own distribution (set anti_lm: 0)"
        )


class DecodeParams(Section):
    """One decoding of the test histories (fields of ``pipeline.decode.DecodeConfig``;
    ``max_length`` is the corpus' ``generate.max_response``). Its metrics carry
    :attr:`suffix`: none for greedy, ``_beam5`` for a beam of 5, ``_hierbeam5`` for the
    HT-Encoder authors' beam, ``_topk10``, ``_topp0.9``."""

    strategy: DecodeStrategy = DecodeStrategy.GREEDY
    beam_size: int = Field(default=5, ge=1)
    length_penalty: float = Field(default=0.0, ge=0)
    min_length: int = Field(default=0, ge=0)
    no_repeat_ngram: int = Field(default=0, ge=0)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    temperature: float = Field(default=1.0, gt=0)
    seed: int = 0
    anti_lm: float = Field(
        default=0.0, ge=0, description="greedy/beam: MMI-antiLM weight of Li et al. (2016)"
    )
    anti_lm_tokens: int = Field(default=0, ge=0, description="tokens it applies to; 0 = all")

    @model_validator(mode="after")
    def _check_anti_lm(self) -> DecodeParams:
        check_anti_lm(self.strategy, self.anti_lm)
        return self

    @property
    def description(self) -> str:
        """The decoding in words, its metric label first: ``greedy (min length 3, no
        3-gram twice, MMI-antiLM 0.5 over first 3 tokens)``."""
        label = self.suffix.lstrip("_") or "greedy"
        options = []
        if self.strategy in (DecodeStrategy.TOP_K, DecodeStrategy.NUCLEUS):
            options += [f"T {self.temperature:g}", f"seed {self.seed}"]
        elif self.length_penalty:
            options.append(f"length penalty {self.length_penalty:g}")
        if self.min_length:
            options.append(f"min length {self.min_length}")
        if self.no_repeat_ngram:
            options.append(f"no {self.no_repeat_ngram}-gram twice")
        if self.anti_lm:
            span = f"first {self.anti_lm_tokens}" if self.anti_lm_tokens else "all"
            options.append(f"MMI-antiLM {self.anti_lm:g} over {span} tokens")
        return f"{label} ({', '.join(options)})" if options else label

    @property
    def suffix(self) -> str:
        if self.strategy == DecodeStrategy.GREEDY:
            return ""
        if self.strategy == DecodeStrategy.BEAM:
            return f"_beam{self.beam_size}"
        if self.strategy == DecodeStrategy.HIER_BEAM:
            return f"_hierbeam{self.beam_size}"
        if self.strategy == DecodeStrategy.TOP_K:
            return f"_topk{self.top_k}"
        return f"_topp{self.top_p:g}"


class Word2VecParams(Section):
    """Word vectors of the embedding metrics: ``vectors`` (a word2vec text/binary or GloVe
    file), else a word2vec trained on the corpus' training responses."""

    vectors: str | None = Field(default=None, description="pre-trained vectors file")
    dim: int = Field(default=300, gt=0)
    window: int = Field(default=5, gt=0)
    min_count: int = Field(default=1, gt=0)
    epochs: int = Field(default=5, gt=0)
    seed: int = 0
    max_sentences: int | None = Field(
        default=None, gt=0, description="train on at most this many training responses"
    )


# Importance samples of a latent-variable model's test NLL: the VHRED/VHCR papers' K.
LATENT_SAMPLES = 100


class LMProtocol(enum.StrEnum):
    """How a language model's test perplexity is measured (``pipeline.eval.language``).

    ``document``: each test document on its own, its first token after ``<bos>`` alone.
    ``stream``: the test split as one text, as LM papers report PTB: a window slides over
    it and scores every token once, each with the context before it in the window.
    """

    DOCUMENT = "document"
    STREAM = "stream"


class LMEvaluateParams(Section):
    """``evaluate.lm``: the protocol of language models' test perplexity. Streamed, a flat
    model (GPT) slides over tokens and a hierarchical one (HGPT) over whole sentences; each
    window starts with ``<bos>`` (HGPT: its begin-of-document vector), holds up to
    ``context_*`` units before the ones it scores and scores the next ``stride_*`` units,
    then advances by them. Defaults: Transformer-XL's PTB test (its ``train.py`` l. 299-329
    and l. 499: 10 tokens scored a window after 130 of context, ``eval_bptt`` 10 and
    ``ext_len`` 70 + 70 - 10); for HGPT, 9 sentences of context, the most its document GPT
    sees in training on PTB's 10-sentence documents. ``unit: sentences`` streams a flat
    model by sentences too: both read the same windows."""

    protocol: LMProtocol = LMProtocol.DOCUMENT
    unit: Literal["model", "sentences"] = Field(
        default="model",
        description="stream: each model's own unit (flat: tokens, hierarchical: sentences), or "
        "sentences for every LM, so that flat and hierarchical models read the same windows",
    )
    context_tokens: int = Field(
        default=130, ge=0, description="stream, flat LMs: tokens of context before each window"
    )
    stride_tokens: int = Field(
        default=10, ge=1, description="stream, flat LMs: tokens each window scores (its step)"
    )
    context_sentences: int = Field(
        default=9, ge=0, description="stream, hierarchical LMs: sentences of context"
    )
    stride_sentences: int = Field(
        default=1, ge=1, description="stream, hierarchical LMs: sentences each window scores"
    )

    def window(self, model_unit: str) -> tuple[Literal["tokens", "sentences"], int, int]:
        """``(unit, context, stride)`` of a streamed evaluation of a model whose own stream
        unit is ``model_unit``."""
        if self.unit == "sentences" or model_unit == "sentences":
            return "sentences", self.context_sentences, self.stride_sentences
        return "tokens", self.context_tokens, self.stride_tokens


class CorpusEvaluateParams(Section):
    """``evaluate.corpora.<corpus>``: what differs on one corpus (only the keys given)."""

    max_batches: int | None = Field(
        default=None, gt=0, description="null: the whole test split (PTB perplexity, MultiWOZ)"
    )
    decodes: tuple[DecodeParams, ...] = Field(
        default=(DecodeParams(),), description="every generate model's decodings here"
    )
    lm: LMEvaluateParams = Field(
        default=LMEvaluateParams(),
        description="the language models' protocol here: only the keys that differ from "
        "evaluate.lm",
    )

    @field_validator("decodes")
    @classmethod
    def _decodes(cls, decodes: tuple[DecodeParams, ...]) -> tuple[DecodeParams, ...]:
        _check_decodes(decodes)
        return decodes


class EvaluateParams(Section):
    """``evaluate``: the test split of every trained seed of a run."""

    batch_size: int = Field(default=32, gt=0)
    max_batches: int | None = Field(
        default=None, gt=0, description="quick runs: only the first N test batches"
    )
    corpora: dict[CorpusKey, CorpusEvaluateParams] = Field(
        default_factory=dict,
        description="per corpus, the keys that differ (max_batches, decodes, lm)",
    )
    decodes: tuple[DecodeParams, ...] = Field(
        default=(DecodeParams(),), description="generate models: greedy (always) and others"
    )
    models: dict[str, tuple[DecodeParams, ...]] = Field(
        default_factory=dict, description="per model name: decodes replacing `decodes`"
    )
    word2vec: Word2VecParams = Word2VecParams()
    bootstrap_samples: int = Field(
        default=1000, ge=0, description="test-set resamples of the paired bootstrap tests"
    )
    n_samples: int = Field(default=5, ge=0, description="histories shown in samples.md")
    latent_samples: int = Field(
        default=LATENT_SAMPLES,
        ge=1,
        description="VHRED/VHCR: posterior draws of the importance-sampled test NLL (K)",
    )
    lm: LMEvaluateParams = Field(
        default=LMEvaluateParams(),
        description="language models: per document, or streamed in a sliding window",
    )

    @field_validator("decodes")
    @classmethod
    def _decodes(cls, decodes: tuple[DecodeParams, ...]) -> tuple[DecodeParams, ...]:
        _check_decodes(decodes)
        return decodes

    @field_validator("models")
    @classmethod
    def _model_decodes(
        cls, models: dict[str, tuple[DecodeParams, ...]]
    ) -> dict[str, tuple[DecodeParams, ...]]:
        for name, decodes in models.items():
            try:
                _check_decodes(decodes)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        return models

    def for_corpus(self, corpus: str) -> EvaluateParams:
        """These settings with the keys ``corpora.<corpus>`` sets replaced; its ``lm``
        block overrides only the keys it names (a global ``evaluate.lm`` stride with a
        per-corpus ``protocol: stream`` streams at that stride)."""
        if corpus not in self.corpora:
            return self
        own = self.corpora[corpus]
        update = {name: getattr(own, name) for name in own.model_fields_set}
        if "lm" in update:
            update["lm"] = merge_params(self.lm, own.lm)
        if "decodes" in update:  # they replace every model's decodings on this corpus
            update["models"] = {}
        return self.model_copy(update=update)

    def decodes_for(self, model: str) -> tuple[DecodeParams, ...]:
        """The decodings ``model`` is evaluated with."""
        return self.models.get(model, self.decodes)


def _check_decodes(decodes: tuple[DecodeParams, ...]) -> None:
    suffixes = [d.suffix for d in decodes]
    if "" not in suffixes:
        raise ValueError("add {strategy: greedy}: every generate model is decoded greedily")
    if len(set(suffixes)) != len(suffixes):
        raise ValueError(f"two decodings share a metric suffix: {suffixes}")


class ReportParams(Section):
    """``report``: where, besides ``reports/``, the report stage publishes its document."""

    results: str | None = Field(
        default=None,
        description="a git-tracked Markdown file (results/STUDY.md in profiles/study.yaml) "
        "the report stage writes with the run's verdicts, its figures in a folder beside it",
    )
