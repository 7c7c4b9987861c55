"""Word vectors for the embedding metrics: word2vec trained on the training split, or a file.

The U-Net paper scores responses with word2vec embeddings (ChatEval). By default we train a
gensim word2vec on the TRAINING split's responses, decoded and split into words as the
metrics split them (``eval.generation.embedding_vectors``), so that every word a model can
emit and that occurs in training has a vector; users may instead supply pre-trained
vectors (e.g. GoogleNews) in word2vec text or binary format, or GloVe's header-less text
format.

Training is deterministic for a seed with ``workers=1``: gensim initialises vectors from
``numpy.random.default_rng(seed)`` and draws negatives/down-sampling from a generator
seeded the same way; several workers interleave updates in thread order.

gensim is imported where vectors are trained or read, not with this module: the evaluation
code that imports this module also runs where gensim is not installed (``bench.gpu_check``
on a bare GPU machine), which never computes these metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import DataError

if TYPE_CHECKING:
    from gensim.models import KeyedVectors


def train_word2vec(
    sentences: Iterable[Sequence[str]],
    dim: int = 300,
    window: int = 5,
    min_count: int = 1,
    epochs: int = 5,
    seed: int = 0,
    workers: int = 1,
) -> KeyedVectors:
    """Train CBOW word2vec (negative sampling, gensim defaults otherwise) on ``sentences``.

    ``sentences`` is read into memory once (gensim makes several passes). ``min_count=1``
    gives every training word a vector. Deterministic for a ``seed`` when ``workers == 1``.
    """
    corpus = [list(s) for s in sentences]
    if not any(corpus):
        raise ValueError("train_word2vec: no words to train on")
    if dim < 1 or window < 1 or min_count < 1 or epochs < 1 or workers < 1:
        raise ValueError(
            f"train_word2vec: dim, window, min_count, epochs and workers must be >= 1 "
            f"(got {dim}, {window}, {min_count}, {epochs}, {workers})"
        )
    counts = Counter(w for s in corpus for w in s)
    if max(counts.values()) < min_count:
        raise ValueError(f"train_word2vec: no word occurs min_count={min_count} times")
    from gensim.models import Word2Vec

    model = Word2Vec(
        sentences=corpus,
        vector_size=dim,
        window=window,
        min_count=min_count,
        epochs=epochs,
        seed=seed,
        workers=workers,
    )
    return model.wv


def _header(first: bytes) -> tuple[int, int] | None:
    fields = first.split()
    if len(fields) == 2 and all(f.isdigit() for f in fields):
        return int(fields[0]), int(fields[1])
    return None


def _is_text_row(line: bytes, dim: int | None) -> bool:
    try:
        fields = line.decode("utf-8").rstrip("\r\n").split(" ")
        fields = [f for f in fields if f]
        if len(fields) < 2 or (dim is not None and len(fields) != dim + 1):
            return False
        [float(f) for f in fields[1:]]
    except (UnicodeDecodeError, ValueError):
        return False
    return True


def sniff_format(path: str | Path) -> tuple[bool, bool]:
    """``(binary, has_header)`` of a vectors file, from its first two lines."""
    with open(path, "rb") as fh:
        first = fh.readline()
        second = fh.readline(1 << 20)
    header = _header(first)
    if header is None:
        if _is_text_row(first, None):
            return False, False  # GloVe: text rows without a "count dim" header
        raise DataError(path, "not a word-vectors file: expected a 'count dim' header line", 1)
    if not second:
        raise DataError(path, "word-vectors file has a header but no vectors", 2)
    return not _is_text_row(second, header[1]), True


def load_vectors(path: str | Path, binary: bool | None = None) -> KeyedVectors:
    """Word vectors from a word2vec text/binary file (or header-less GloVe text).

    ``binary=None`` detects the format from the file's first lines.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(
            path, "word-vectors file not found; point the vectors setting at a word2vec file"
        )
    sniffed_binary, has_header = sniff_format(path)
    if binary is None:
        binary = sniffed_binary
    from gensim.models import KeyedVectors

    try:
        return KeyedVectors.load_word2vec_format(str(path), binary=binary, no_header=not has_header)
    except (ValueError, EOFError, UnicodeDecodeError, IndexError) as err:
        kind = "binary" if binary else "text"
        raise DataError(path, f"cannot read word2vec {kind} vectors: {err}") from None
