"""Params of the data stages: download and tokenize (splits, vocabulary, per-task limits)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from pipeline.config.evaluate import LMEvaluateParams
from pipeline.config.sections import CorpusKey, Section
from pipeline.names import OnError, Task

# --------------------------------------------------------------------------- data


# The split names as params spell them (``pipeline.data.splits.Split`` is the enum).
SplitName = Literal["train", "valid", "test"]


class DownloadParams(Section):
    """``download``: where corpora come from."""

    mirror: str | None = Field(
        default=None,
        description="A directory or file:// URL standing in for the internet: a URL's "
        "file name is looked up there (tests and offline users).",
    )
    retries: int = Field(default=4, ge=0, le=20)
    timeout_s: float = Field(default=60.0, gt=0)
    skip: dict[CorpusKey, tuple[SplitName, ...]] = Field(
        default_factory=dict,
        description="per corpus, splits whose files are not fetched (a machine with only "
        "MultiWOZ's validation and test files: {multiwoz21: [train]}, with train_on: valid)",
    )


class SplitParams(Section):
    """Seeded split by dialogue for corpora without an official one."""

    seed: int = 13
    valid: float = Field(default=0.1, ge=0, lt=1)
    test: float = Field(default=0.1, ge=0, lt=1)

    @model_validator(mode="after")
    def _fractions(self) -> SplitParams:
        if self.valid + self.test >= 1:
            raise ValueError("valid + test must leave a training split (sum < 1)")
        return self


class VocabParams(Section):
    """``kind``: ``word`` (regex words, punctuation split off), ``bpe``, or ``whitespace``
    for text a corpus ships tokenised (Mikolov's PTB: split on spaces only, its ``<unk>``
    the unknown word). ``size``: at most this many tokens, special ones included; ``null``:
    every training type seen ``min_freq`` times."""

    kind: Literal["word", "bpe", "whitespace"] = "word"
    size: int | None = Field(default=20000, ge=16)
    min_freq: int = Field(default=1, ge=1)
    lowercase: bool = True


class GenerateParams(Section):
    """History limits: ``null`` keeps the whole dialogue so far (the HT-Encoder authors'
    MultiWOZ setting, ``profiles/paper.yaml``)."""

    max_history: int | None = Field(
        default=150, gt=0, description="most recent history tokens kept; null: all"
    )
    max_utterances: int | None = Field(
        default=10, gt=0, description="most recent utterances kept; null: all"
    )
    max_response: int = Field(default=30, gt=0)
    delexicalize: bool = Field(default=False, description="MultiWOZ: replace slot values")


class SelectParams(Section):
    """Candidates of select examples. ``resample_negatives`` and ``augment_min_utterances``
    act on the training split only, when batches are read (``data/resample.py``): the
    validation and test candidates are the ones tokenize stored."""

    n_candidates_train: int = Field(default=10, ge=2, description="1 positive + negatives")
    n_candidates_eval: int = Field(default=100, ge=2)
    max_candidate: int = Field(default=30, gt=0)
    resample_negatives: bool = Field(
        default=False,
        description="training split: draw the negatives afresh every epoch (seeded by the "
        "run's seed, the epoch and the example), by the rule tokenize draws them with, "
        "instead of the fixed ones tokenize stored; a corpus with its own candidates "
        "(DSTC7) then keeps all of them in the training shards and each epoch draws "
        "n_candidates_train of them, as the HRT authors' code does every epoch",
    )
    augment_min_utterances: int | None = Field(
        default=None,
        ge=1,
        description="training split, with resample_negatives: each epoch keep the first L "
        "utterances of an example's context, L uniform in [min(this, n), n] (n: its "
        "utterances), the utterance after them becoming the positive when L < n: the HRT "
        "authors' context augmentation (DSTC7Dataset, their min_context_len, 4 there; "
        "their released train.py turns it off); null: contexts as stored",
    )

    @model_validator(mode="after")
    def _augment_needs_draws(self) -> SelectParams:
        if self.augment_min_utterances is not None and not self.resample_negatives:
            raise ValueError(
                "augment_min_utterances draws a new positive each epoch: set "
                "resample_negatives: true as well"
            )
        return self


class LMStreamParams(Section):
    """``lm.stream``: how ``lm.layout: stream`` cuts the training text into segments
    (``pipeline.data.streams``). Defaults: the Transformer-XL PTB code's (github
    ischlag/Fast-Weight-Memory-public, ``language-modelling/transformer_xl_ptb/train.py``
    l. 97-102, 338-341, 359, 416): 70 target tokens after up to 70 of context, 5% of the segments
    half as long, a normal jitter of sd 5, at least 5 tokens; a hierarchical LM cuts whole
    sentences, 3 after up to 3 (PTB's sentences average 22 tokens: about the same text)."""

    target_tokens: int = Field(default=70, gt=0, description="scored tokens a segment")
    context_tokens: int = Field(default=70, ge=0, description="tokens before it, unscored")
    jitter_tokens: float = Field(default=5.0, ge=0, description="sd of a segment's length")
    min_tokens: int = Field(default=5, gt=0, description="the shortest segment")
    short_fraction: float = Field(
        default=0.05, ge=0, lt=1, description="segments of half the target length"
    )
    target_sentences: int = Field(default=3, gt=0, description="hierarchical LMs: scored")
    context_sentences: int = Field(default=3, ge=0, description="hierarchical LMs: context")


class LMParams(Section):
    """``max_sentence``: tokens kept per sentence (its ``<eos>`` included); ``null`` keeps
    every token (PTB's convention: no sentence is cut). ``layout`` and ``validation``: how
    the language models on the corpus read its training and validation splits (the shards
    are the same documents either way)."""

    sentences_per_document: int = Field(default=10, gt=0)
    max_sentence: int | None = Field(default=50, gt=1)
    layout: Literal["documents", "stream"] = Field(
        default="documents",
        description="training split: documents, each from <bos>; or stream, the split as "
        "one text cut into segments every epoch (lm.stream), as LM papers train on PTB",
    )
    stream: LMStreamParams = LMStreamParams()
    validation: LMEvaluateParams = Field(
        default=LMEvaluateParams(),
        description="the validation that keeps an LM's weights: per document, or streamed; "
        "the params check holds it to the corpus's evaluate lm protocol",
    )


class ChatTargets(enum.StrEnum):
    """Which turns of a chat corpus are generation targets: every turn after the first, or
    only the assistant's (or the user's)."""

    ALL = "all"
    ASSISTANT = "assistant"
    USER = "user"


@dataclass(frozen=True, slots=True)
class FormatTraits:
    """What a declared format is, in the plain terms config, data and the params check ask
    about it (never its name).

    ``label``: a file of it, in messages. ``layout``: how its dialogues are written, for the
    fix of a file that holds none. ``own_splits``: each dialogue names its split, so the
    corpus is one file (no ``splits``) whose dialogues keep their split; otherwise one file
    is split by dialogue with the corpus's seeded ``split``. ``acts``: turns carry dialogue
    acts and belief states (an act inventory, act models). ``empty_turns``: an empty
    utterance stays a turn (so its acts and state stay in place); otherwise every turn has
    text. ``answers_as``: the one speaker a corpus of it answers as; None: ``targets``
    chooses (every turn after the first, or one role's).
    """

    label: str
    layout: str
    own_splits: bool
    acts: bool
    empty_turns: bool
    answers_as: str | None

    def responder(self, targets: ChatTargets) -> str | None:
        """The speaker whose turns are generation targets (None: every turn after the first)."""
        if self.answers_as is not None:
            return self.answers_as
        return None if targets is ChatTargets.ALL else targets.value


class SourceFormat(enum.StrEnum):
    """The formats a corpus of one's own may come in, each with its :class:`FormatTraits`
    (``SourceFormat.CONVLAB.traits.acts``): one row per format, the only table of them. A
    format's reader is registered against it in ``pipeline.data.declared.READERS``."""

    traits: FormatTraits

    def __new__(cls, value: str, traits: FormatTraits) -> SourceFormat:
        member = str.__new__(cls, value)
        member._value_ = value
        member.traits = traits
        return member

    CHAT_JSONL = (
        "chat_jsonl",
        FormatTraits(
            label="chat JSONL file",
            layout='one JSON object per line, {"messages": [{"role": "user", "content": '
            '"Hi"}, {"role": "assistant", "content": "Hello"}]}',
            own_splits=False,
            acts=False,
            empty_turns=False,
            answers_as=None,
        ),
    )
    CONVLAB = (
        "convlab_unified",
        FormatTraits(
            label="ConvLab data.zip",
            layout="ConvLab-3's unified format: a JSON list of dialogues, data/dialogues.json "
            "in data.zip",
            own_splits=True,
            acts=True,
            empty_turns=True,
            answers_as="system",
        ),
    )


_SHA256 = r"^[0-9a-f]{64}$"


class FileSource(Section):
    """One file of a declared corpus: a path in the project, an absolute path, or a
    ``file://`` or ``https://`` URL, with its sha256 if known (then every fetch is verified
    against it; otherwise the first fetch's digest is recorded and later ones checked)."""

    file: str = Field(min_length=1)
    sha256: str | None = Field(default=None, pattern=_SHA256)

    @field_validator("file")
    @classmethod
    def _scheme(cls, file: str) -> str:
        return _location(file)


def _location(file: str) -> str:
    scheme, sep, _ = file.partition("://")
    if sep and scheme not in ("file", "https", "http"):
        raise ValueError(f"a path, a file:// or an https:// URL, not {scheme}://")
    return file


class CorpusSource(Section):
    """Where a corpus of one's own comes from and what format it is in: one ``file`` (split
    by dialogue with the corpus' seeded ``split``; a ConvLab ``data.zip`` carries its own
    splits) or one file per split (``splits``: train, valid and test)."""

    format: SourceFormat
    file: str | None = Field(default=None, min_length=1)
    sha256: str | None = Field(default=None, pattern=_SHA256)
    splits: dict[SplitName, FileSource] | None = None
    targets: ChatTargets = Field(
        default=ChatTargets.ALL,
        description="chat_jsonl: the turns a generate example answers: all (every turn "
        "after the first) or one role's (assistant, user)",
    )

    @model_validator(mode="after")
    def _one_source(self) -> CorpusSource:
        if (self.file is None) == (self.splits is None):
            raise ValueError("file: give one file, or splits with a file per split")
        if self.splits is not None:
            missing = [s for s in ("train", "valid", "test") if s not in self.splits]
            if missing:
                raise ValueError(f"splits: add {', '.join(missing)} (or give one file)")
            if self.sha256 is not None:
                raise ValueError("sha256: give each split's sha256 under splits.<split>")
        else:
            assert self.file is not None
            _location(self.file)
        traits = self.format.traits
        if traits.own_splits and self.splits is not None:
            raise ValueError(f"splits: a {traits.label} holds its own splits: give one file")
        if traits.answers_as is not None and self.targets is not ChatTargets.ALL:
            raise ValueError(
                f"targets: a {traits.label} answers as the {traits.answers_as}: remove targets"
            )
        return self

    def files(self) -> dict[str | None, FileSource]:
        """The source files by the split they hold (``None``: every split, one file)."""
        if self.splits is not None:
            return dict(self.splits)
        assert self.file is not None
        return {None: FileSource(file=self.file, sha256=self.sha256)}


class CorpusParams(Section):
    """How one corpus is turned into examples."""

    source: CorpusSource | None = Field(
        default=None,
        description="a corpus of one's own: its file(s) and format (a built-in corpus has "
        "none: pipeline.data.corpora knows its sources)",
    )
    tasks: tuple[Task, ...] = (Task.GENERATE,)
    vocab: VocabParams = VocabParams()
    split: SplitParams = SplitParams()
    generate: GenerateParams = GenerateParams()
    select: SelectParams = SelectParams()
    lm: LMParams = LMParams()
    max_dialogues: int | None = Field(
        default=None, gt=0, description="keep only the first N dialogues per split (tiny runs)"
    )
    train_on: Literal["train", "valid"] = Field(
        default="train",
        description="valid: the corpus's validation dialogues are the training data, a "
        "seeded `split.valid` fraction of them held out for validation; the test split is "
        "the corpus's own (a machine without the training file; the report says so)",
    )
    resplit_train: bool = Field(
        default=False,
        description="true: the corpus's training dialogues alone, split by `split` (seeded, "
        "by dialogue), its own validation and test files unused: how the U-Net authors split "
        "PersonaChat (its training file, 90/5/5)",
    )

    @model_validator(mode="after")
    def _tasks(self) -> CorpusParams:
        if not self.tasks:
            raise ValueError("tasks: name at least one of generate, select, lm")
        if self.resplit_train and self.train_on == "valid":
            raise ValueError("resplit_train: splits the training dialogues; drop train_on: valid")
        return self


class TokenizeParams(Section):
    """``tokenize``: examples and shards."""

    on_error: OnError = OnError.RAISE
    shard_rows: int = Field(default=50_000, gt=0)
    chunk_dialogues: int = Field(
        default=2_000,
        gt=0,
        description="dialogues encoded at a time: the stage holds one such chunk (and the "
        "vocabulary), not the corpus; the examples do not depend on it",
    )
    corpora: dict[CorpusKey, CorpusParams] = Field(default_factory=dict)
