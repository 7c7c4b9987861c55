"""Metrics on generated text: the ChatEval set (U-Net paper) and BLEU (HIER paper).

Texts are compared as whitespace-separated words: the pipeline's word vocabulary decodes
to exactly that (``Vocab.decode`` joins tokens with single spaces), so the words counted
here are the model's tokens. An empty line has no words (ChatEval's ``split(' ')`` would
count one empty word).

ChatEval (Sedoc et al. 2019, https://chateval.org), definitions as in its code:

- average length: mean number of words per response;
- distinct-1: unique words / total words;
- distinct-2: unique bigrams (taken within lines, never across a line break) / total
  WORDS. ChatEval divides by words, not by bigrams; so do we, to be comparable. (The U-Net
  authors' code computed distinct-n differently; DESIGN.md, "Known defects".)

Embedding metrics (Liu et al. 2016, "How NOT to evaluate your dialogue system"), as
ChatEval computes them (github chateval/evaluation: Serban et al.'s ``embedding_metrics.py``
called as ``(model responses, references)`` on vectors that ``pymagnitude`` serves
UNIT-NORMALISED, its default). Per response/reference pair, then averaged:

- every word vector is first scaled to unit length (this changes average and extrema:
  a frequent word no longer outweighs the rest by its norm);
- embedding average: cosine between the SUMS of the two sides' unit word vectors;
- embedding extrema: per dimension, the value of largest magnitude over the words (ties go
  to the positive value), then the cosine of the two extrema vectors;
- greedy matching: each word of one side is matched to its most similar word on the other
  side (dot products of unit vectors: cosines), the similarities are averaged, and the two
  directions are averaged.

Words without a vector are left out. Empty sides as ChatEval: for average and extrema a pair
whose RESPONSE has no known word is skipped (left out of the mean: NaN per pair, counted by
``ChatEvalScores.embedding_skipped``, which the evaluate stage reports), one whose reference
has none scores 0; greedy matching scores 0 when either side is empty. Systems whose
responses are sometimes empty are therefore averaged over fewer pairs: the skipped count
says how many.

BLEU is sacrebleu's corpus BLEU (per example, its sufficient statistics: ``bleu_stats``,
which the bootstrap sums). HIER computed BLEU with the start token still in the text;
``strip_special`` removes ``<pad> <bos> <eos> <sep>`` first (``<unk>`` is a real output
word and stays). sacrebleu's default ``13a`` tokenizer is right for detokenised text; for
pre-tokenised delexicalised MultiWOZ text, ``tokenize="none"`` splits on spaces only, like
the official MultiWOZ scorer (``13a`` would cut ``[hotel_name]`` into three tokens). The
report prints sacrebleu's signature (:func:`bleu_signature`) under every table with BLEU.

``wrapped_bleu`` is the HT-Encoder paper's convention (the ``BLEUScorer`` of the MultiWOZ
and HDSA code with "Shawn's evaluation" on, which HIER's scorer keeps): whitespace tokens,
each hypothesis and reference wrapped in ``GO_ ... EOS_``, corpus n-gram counts, n-gram
precisions smoothed by adding 1e-7 and brevity penalty 1 when the hypotheses are longer.
The wrapping adds matched boundary n-grams to every pair, so it reads higher than
sacrebleu on the same text (0.6-2 points on MultiWOZ); it is reported beside sacrebleu,
named for the paper, never instead of it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.typing import ArrayLike

from pipeline.data.special import SPECIAL_TOKENS, UNK

if TYPE_CHECKING:  # imported where BLEU is computed: training imports this module
    import sacrebleu

DEFAULT_TOKENIZE = "13a"
_STRIPPED = tuple(t for t in SPECIAL_TOKENS if t != UNK)
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in _STRIPPED))


class Vectors(Protocol):
    """Word -> vector lookup: a gensim ``KeyedVectors`` or a plain ``dict``."""

    def __contains__(self, word: object, /) -> bool: ...

    def __getitem__(self, word: str, /) -> ArrayLike: ...


def words(line: str) -> list[str]:
    """The words of a line: its whitespace-separated tokens."""
    return line.split()


def _check_lines(lines: Sequence[str], name: str = "lines") -> None:
    if isinstance(lines, str):
        raise TypeError(f"{name}: expected a sequence of lines, got one string")
    if len(lines) == 0:
        raise ValueError(f"{name}: no lines")


def _check_pairs(hyps: Sequence[str], refs: Sequence[str]) -> None:
    _check_lines(hyps, "hyps")
    _check_lines(refs, "refs")
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")


# --------------------------------------------------------------------------- length/diversity


def average_length(lines: Sequence[str]) -> float:
    """Mean number of words per line."""
    _check_lines(lines)
    return sum(len(words(line)) for line in lines) / len(lines)


def distinct_n(lines: Sequence[str], n: int) -> float:
    """ChatEval distinct-n: unique within-line n-grams / total words (0 if no words)."""
    _check_lines(lines)
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    grams: set[tuple[str, ...]] = set()
    total = 0
    for line in lines:
        tokens = words(line)
        total += len(tokens)
        grams.update(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return len(grams) / total if total else 0.0


def distinct_1(lines: Sequence[str]) -> float:
    """Unique words / total words."""
    return distinct_n(lines, 1)


def distinct_2(lines: Sequence[str]) -> float:
    """Unique within-line bigrams / total words (ChatEval's denominator)."""
    return distinct_n(lines, 2)


# --------------------------------------------------------------------------- embeddings


def _matrix(tokens: Sequence[str], vectors: Vectors) -> np.ndarray:
    """Unit-length vectors of the known ``tokens``, ``[k, d]`` float64 (``k`` may be 0)."""
    rows = [np.asarray(vectors[w], dtype=np.float64) for w in tokens if w in vectors]
    return _unit_rows(np.stack(rows)) if rows else np.zeros((0, 0))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norm if norm > 0 else 0.0


def _unit_rows(m: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    return np.divide(m, norms, out=np.zeros_like(m), where=norms > 0)


def _extrema(m: np.ndarray) -> np.ndarray:
    high, low = m.max(0), m.min(0)
    return np.where(np.abs(low) > high, low, high)


def embedding_average(hyp: str, ref: str, vectors: Vectors) -> float:
    """Cosine between the summed unit word vectors of ``hyp`` and ``ref``; NaN (skipped)
    if ``hyp`` has no known word, 0 if ``ref`` has none (module docstring)."""
    x, y = _matrix(words(hyp), vectors), _matrix(words(ref), vectors)
    if not len(x):
        return math.nan
    if not len(y):
        return 0.0
    return _cosine(x.sum(0), y.sum(0))


def embedding_extrema(hyp: str, ref: str, vectors: Vectors) -> float:
    """Cosine between the extrema (per-dimension value of largest magnitude) of the unit
    word vectors; NaN (skipped) if ``hyp`` has no known word, 0 if ``ref`` has none."""
    x, y = _matrix(words(hyp), vectors), _matrix(words(ref), vectors)
    if not len(x):
        return math.nan
    if not len(y):
        return 0.0
    return _cosine(_extrema(x), _extrema(y))


def greedy_matching(hyp: str, ref: str, vectors: Vectors) -> float:
    """Symmetric greedy matching: mean over both directions of the mean best word cosine
    (0 if a side has no known word)."""
    x, y = _matrix(words(hyp), vectors), _matrix(words(ref), vectors)
    if not len(x) or not len(y):
        return 0.0
    sims = x @ y.T
    return float((sims.max(1).mean() + sims.max(0).mean()) / 2.0)


@dataclass(frozen=True)
class EmbeddingScores:
    """Per-example embedding metrics, each ``[N]`` float64 (NaN: a skipped pair)."""

    average: np.ndarray
    extrema: np.ndarray
    greedy: np.ndarray

    @property
    def skipped(self) -> int:
        """Pairs left out of the average and extrema means (no known response word)."""
        return int(np.isnan(self.average).sum())


def embedding_scores(hyps: Sequence[str], refs: Sequence[str], vectors: Vectors) -> EmbeddingScores:
    """The three embedding metrics of every (hypothesis, reference) pair."""
    _check_pairs(hyps, refs)
    pairs = list(zip(hyps, refs, strict=True))
    return EmbeddingScores(
        average=np.array([embedding_average(h, r, vectors) for h, r in pairs]),
        extrema=np.array([embedding_extrema(h, r, vectors) for h, r in pairs]),
        greedy=np.array([greedy_matching(h, r, vectors) for h, r in pairs]),
    )


@dataclass(frozen=True)
class ChatEvalScores:
    """ChatEval metrics of a set of responses (the U-Net paper's Tables 4-5)."""

    avg_length: float
    distinct_1: float
    distinct_2: float
    embedding_average: float
    embedding_extrema: float
    greedy_matching: float
    embedding_skipped: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def chateval(hyps: Sequence[str], refs: Sequence[str], vectors: Vectors) -> ChatEvalScores:
    """Every ChatEval metric of ``hyps`` (embedding ones against ``refs``, pair by pair)."""
    scores = embedding_scores(hyps, refs, vectors)
    return ChatEvalScores(
        avg_length=average_length(hyps),
        distinct_1=distinct_1(hyps),
        distinct_2=distinct_2(hyps),
        embedding_average=_mean_of_scored(scores.average),
        embedding_extrema=_mean_of_scored(scores.extrema),
        greedy_matching=float(scores.greedy.mean()),
        embedding_skipped=scores.skipped,
    )


def _mean_of_scored(values: np.ndarray) -> float:
    """The mean over the pairs not skipped (NaN if every pair was)."""
    scored = values[~np.isnan(values)]
    return float(scored.mean()) if len(scored) else math.nan


# --------------------------------------------------------------------------- BLEU


def strip_special(text: str) -> str:
    """``text`` without ``<pad> <bos> <eos> <sep>`` (``<unk>`` kept), spaces normalised."""
    return " ".join(_SPECIAL_RE.sub(" ", text).split())


@cache
def _bleu(tokenize: str) -> sacrebleu.BLEU:
    import sacrebleu

    # force: pipeline text is tokenised on purpose; don't warn about " ." line endings.
    try:
        return sacrebleu.BLEU(tokenize=tokenize, force=True)
    except KeyError:
        raise ValueError(
            f"tokenize: unknown sacrebleu tokenizer {tokenize!r} (use '13a', 'none', 'intl', ...)"
        ) from None


def corpus_bleu(
    hyps: Sequence[str], refs: Sequence[str] | None, tokenize: str = DEFAULT_TOKENIZE
) -> float:
    """sacrebleu corpus BLEU (0-100) of ``hyps`` against one reference each.

    Special tokens are stripped from both sides. ``refs`` may only be None to fit
    ``stats.paired_bootstrap``'s signature; it is required.
    """
    if refs is None:
        raise ValueError("corpus_bleu: references are required")
    _check_pairs(hyps, refs)
    hyps = [strip_special(h) for h in hyps]
    refs = [strip_special(r) for r in refs]
    return float(_bleu(tokenize).corpus_score(hyps, [refs]).score)


def bleu_signature(tokenize: str = DEFAULT_TOKENIZE) -> str:
    """sacrebleu's signature of corpus BLEU with ``tokenize`` (``nrefs:1|case:mixed|...``)."""
    bleu = _bleu(tokenize)
    bleu.corpus_score(["a"], [["a"]])  # sacrebleu knows the reference count after a score
    return str(bleu.get_signature())


_WRAP = ("GO_", "EOS_")


def wrapped_bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus BLEU (0-100) in the HT-Encoder paper's convention (module docstring)."""
    return wrapped_bleu_from_stats(wrapped_bleu_stats(hyps, refs))


def wrapped_bleu_stats(hyps: Sequence[str], refs: Sequence[str]) -> np.ndarray:
    """Per-pair statistics ``[N, 10]`` of ``wrapped_bleu`` (hyp and ref length with the
    GO_/EOS_ wrap, matched and total 1-4-grams); summed rows give any subset's score
    through ``wrapped_bleu_from_stats``, as ``bleu_stats`` does for sacrebleu."""
    _check_pairs(hyps, refs)
    rows = np.zeros((len(hyps), 10), dtype=np.int64)
    for row, hyp, ref in zip(rows, hyps, refs, strict=True):
        h = [_WRAP[0], *strip_special(hyp).split(), _WRAP[1]]
        r = [_WRAP[0], *strip_special(ref).split(), _WRAP[1]]
        row[0], row[1] = len(h), len(r)
        for n in range(1, 5):
            h_grams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_grams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            row[1 + n] = sum(min(c, r_grams[g]) for g, c in h_grams.items())
            row[5 + n] = sum(h_grams.values())
    return rows


def wrapped_bleu_from_stats(stats: np.ndarray, refs: object = None) -> float:
    """``wrapped_bleu`` from ``wrapped_bleu_stats`` rows or their sum (``refs`` ignored,
    as in ``bleu_from_stats``). The authors' epsilons (1e-7) are kept: a zero n-gram
    precision gives a tiny score instead of an error."""
    total = stats.sum(0) if stats.ndim == 2 else stats
    hyp_len, ref_len = int(total[0]), int(total[1])
    matched, counted = total[2:6], total[6:10]
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    precisions = [m / (t + 1e-7) + 1e-7 for m, t in zip(matched, counted, strict=True)]
    return 100.0 * brevity * math.exp(sum(0.25 * math.log(p) for p in precisions))


def bleu_stats(
    hyps: Sequence[str], refs: Sequence[str], tokenize: str = DEFAULT_TOKENIZE
) -> np.ndarray:
    """Per-sentence BLEU sufficient statistics ``[N, 10]`` (hyp length, ref length, matched
    and total 1-4-grams). Summing any subset of rows and calling ``bleu_from_stats`` gives
    that subset's corpus BLEU, which makes a 1000-sample bootstrap cheap."""
    _check_pairs(hyps, refs)
    bleu = _bleu(tokenize)
    # sacrebleu's own significance tests use this same (underscored) method.
    rows = bleu._extract_corpus_statistics(
        [strip_special(h) for h in hyps], [[strip_special(r) for r in refs]]
    )
    return np.asarray(rows, dtype=np.int64)


def bleu_from_stats(stats: np.ndarray, refs: object = None) -> float:
    """Corpus BLEU (0-100) from ``bleu_stats`` rows (``[N, 10]``, summed here) or their sum.

    ``refs`` is ignored (it lets the function serve as a ``paired_bootstrap`` metric).
    """
    total = stats.sum(0) if stats.ndim == 2 else stats
    return float(_bleu(DEFAULT_TOKENIZE)._compute_score_from_stats(total.tolist()).score)
