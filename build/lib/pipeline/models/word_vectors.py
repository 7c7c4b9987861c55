"""Pre-trained word vectors (FastText / word2vec ``.vec`` text) as a model's initial word
embeddings, as the Highway Recurrent Transformer paper initialised its model ("pre-trained
word embeddings FastText are used").

The file format: an optional header line ``<count> <dim>``, then one line per word,
``<word> <v1> ... <vdim>`` separated by single spaces (FastText ends each line with a
space); gzipped files (``.vec.gz``) are read as they are. Real files hold millions of
words (GBs), so :func:`read_word_vectors` streams the file once and keeps only the rows
of the vocabulary's tokens; :func:`copy_into` writes them into an ``nn.Embedding``.

Scale. The vectors come at whatever scale their trainer left them, while our embeddings
are initialised at a scale the model is built around: ``layers.TokenEmbedding`` draws
rows with std ``d**-0.5`` and multiplies them by ``sqrt(d)`` in ``forward``, so every
token enters the model with per-element RMS 1, the size of the sinusoidal positional
encodings added to it; a plain ``nn.Embedding`` (the RNN baselines) draws std 1 and does
not scale. Storing the file's values as they are would make a pre-trained word ``sqrt(d)``
times its file size, and dividing by ``sqrt(d)`` (so that ``forward`` returns the file's
values) would make known words far smaller than unknown ones and than the positional
encodings. We therefore multiply every loaded vector by ONE factor, chosen so that the
loaded rows' RMS equals the RMS of the embedding's rows as initialised (pad row excluded):
known and unknown words, and whatever the model adds to them, keep the balance the model
was designed with, whatever the embedding's own scaling; and one common factor keeps the
vectors' geometry (cosines, relative norms), which is what pre-training gives. The factor
is returned by :func:`copy_into`.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.data.special import PAD_ID
from pipeline.errors import DataError, HiertxError
from pipeline.models.layers import TokenEmbedding

_GZIP_MAGIC = b"\x1f\x8b"


class DimensionError(HiertxError, ValueError):
    """The vectors' dimension differs from the embedding's: says both and what to do."""

    def __init__(self, path: object, file_dim: int, model_dim: int) -> None:
        self.path = str(path)
        self.file_dim = file_dim
        self.model_dim = model_dim
        super().__init__(
            f"{self.path}: the word vectors have {file_dim} dimensions but the model's token "
            f"embedding has {model_dim}: set the model's embedding size (its d_model, or "
            f"d_embed where its config has one) to {file_dim}, or use a file of "
            f"{model_dim}-dimensional vectors"
        )


@dataclass(frozen=True)
class Coverage:
    """How much of a vocabulary a vectors file covers.

    ``types`` counts the vocabulary's tokens that may get a vector (every token but
    ``<pad>``, whose row stays zero; special tokens such as ``<bos>`` are counted and are
    normally absent from a file); ``found`` of them have a row in the file; ``file_words``
    is the number of vector rows the file holds.
    """

    found: int
    types: int
    file_words: int

    @property
    def fraction(self) -> float:
        """``found / types`` (0 for an empty vocabulary)."""
        return self.found / self.types if self.types else 0.0

    def as_dict(self) -> dict[str, float]:
        """The numbers a run logs (``found``, ``types``, ``fraction``, ``file_words``)."""
        return {
            "found": self.found,
            "types": self.types,
            "fraction": self.fraction,
            "file_words": self.file_words,
        }


@dataclass(frozen=True)
class WordVectors:
    """The rows of one vocabulary read from a vectors file: ``vectors[i]`` (float32,
    ``[n, dim]``, the file's values) belongs to vocabulary id ``ids[i]`` (int64, ``[n]``);
    ``vocab_size`` is the vocabulary's size (the embedding's row count)."""

    path: str
    dim: int
    vocab_size: int
    ids: Tensor
    vectors: Tensor
    coverage: Coverage


@contextmanager
def _open(path: Path) -> Iterator[BinaryIO]:
    """``path`` as bytes, gunzipped when it is gzip (by its magic number, not its name)."""
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == _GZIP_MAGIC
    opener = gzip.open if gzipped else open
    with opener(path, "rb") as fh:
        yield fh


def _header(line: bytes) -> tuple[int, int] | None:
    """``(count, dim)`` of a word2vec/FastText header line, None for a vector row."""
    fields = line.split()
    if len(fields) == 2 and all(f.isdigit() for f in fields):
        return int(fields[0]), int(fields[1])
    return None


def read_word_vectors(
    path: str | Path, tokens: Sequence[str], dim: int | None = None, pad_id: int = PAD_ID
) -> WordVectors:
    """The vectors of ``tokens`` (a vocabulary in id order: ``Vocab.tokens``) in the file
    at ``path``, read in one streaming pass.

    Words are matched exactly (the vocabulary's casing); the first row of a word counts;
    the ``pad_id`` token never gets a vector. ``dim``: the dimension the caller needs; a
    file of another one raises :class:`DimensionError` at its first line, before the rest
    is read. Every line's number of values is checked; values are parsed only for the
    rows kept. A malformed line (no values, a wrong number of them, a value that is not a
    finite number) or a header whose count disagrees with the rows (a truncated file) is a
    ``DataError`` naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "word-vectors file not found")
    # Bytes keys: a row's word is matched without decoding the row (most rows are skipped).
    wanted = {t.encode("utf-8"): i for i, t in enumerate(tokens) if i != pad_id}
    ids: list[int] = []
    rows: list[np.ndarray] = []
    header: tuple[int, int] | None = None
    n_rows = 0
    try:
        with _open(path) as fh:
            for number, line in enumerate(fh, start=1):
                line = line.rstrip(b" \t\r\n")
                if not line:
                    continue  # a blank line (the end of some files) holds no vector
                if number == 1 and (header := _header(line)) is not None:
                    if header[1] < 1:
                        raise DataError(path, f"header gives dimension {header[1]}", number)
                    if dim is not None and header[1] != dim:
                        raise DimensionError(path, header[1], dim)
                    dim = header[1]
                    continue
                word, _, values = line.partition(b" ")
                # the cheap count first; several spaces between values are tolerated
                n_values = values.count(b" ") + 1 if values else 0
                if n_values != dim and values:
                    n_values = len(values.split())
                if not values:
                    raise DataError(path, f"no vector values after the word {_show(word)}", number)
                if dim is None:  # a file without header: its first row sets the dimension
                    dim = n_values
                elif n_values != dim:
                    if n_rows == 0 and header is None:
                        raise DimensionError(path, n_values, dim)
                    raise DataError(
                        path, f"{n_values} values after {_show(word)}, expected {dim}", number
                    )
                n_rows += 1
                index = wanted.pop(word, None)
                if index is None:
                    continue
                ids.append(index)
                rows.append(_parse(values, path, number, word))
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise DataError(path, f"cannot read the word-vectors file: {err}") from None
    if dim is None:
        raise DataError(path, "no word vectors in the file")
    if header is not None and header[0] != n_rows:
        raise DataError(
            path,
            f"the header announces {header[0]} vectors but the file holds {n_rows}: a "
            "truncated download? fetch the file again (or fix its header line)",
            1,
        )
    return WordVectors(
        path=str(path),
        dim=dim,
        vocab_size=len(tokens),
        ids=torch.tensor(ids, dtype=torch.long),
        vectors=torch.from_numpy(np.stack(rows) if rows else np.zeros((0, dim), np.float32)),
        coverage=Coverage(
            found=len(ids), types=len(tokens) - (0 <= pad_id < len(tokens)), file_words=n_rows
        ),
    )


def _show(word: bytes) -> str:
    return repr(word.decode("utf-8", errors="replace"))


def _parse(values: bytes, path: Path, number: int, word: bytes) -> np.ndarray:
    """One row's values as float32 (a vocabulary's rows as Python floats would take ~8x
    the memory)."""
    try:
        with np.errstate(over="ignore"):  # beyond float32 becomes inf: refused below
            row = np.array(values.split(), dtype=np.float32)
    except ValueError:
        raise DataError(path, f"a value after {_show(word)} is not a number", number) from None
    if not np.isfinite(row).all():
        raise DataError(path, f"a value after {_show(word)} is not a finite float32", number)
    return row


def copy_into(embedding: nn.Embedding, vectors: WordVectors) -> float:
    """Write ``vectors`` into ``embedding``'s rows of their words, scaled by one factor
    (module docstring: the loaded rows' RMS becomes that of the rows as initialised);
    returns the factor. Rows of words without a vector keep their values; the padding
    row (``embedding.padding_idx``) stays zero. A dimension other than the embedding's is
    a :class:`DimensionError`, another vocabulary size a ``ValueError``."""
    weight = embedding.weight
    if vectors.dim != embedding.embedding_dim:
        raise DimensionError(vectors.path, vectors.dim, embedding.embedding_dim)
    if vectors.vocab_size != embedding.num_embeddings:
        raise ValueError(
            f"{vectors.path}: read for a vocabulary of {vectors.vocab_size} tokens, but the "
            f"embedding has {embedding.num_embeddings} rows: read it with the model's vocabulary"
        )
    pad = embedding.padding_idx
    keep = vectors.ids != pad if pad is not None else torch.ones_like(vectors.ids, dtype=torch.bool)
    ids, rows = vectors.ids[keep], vectors.vectors[keep]
    if len(ids) == 0:
        return 1.0
    with torch.no_grad():
        initialised = weight.detach().float()
        if pad is not None:
            initialised = torch.cat([initialised[:pad], initialised[pad + 1 :]])
        target, have = _rms(initialised), _rms(rows)
        factor = target / have if target > 0 and have > 0 else 1.0
        weight[ids.to(weight.device)] = (rows * factor).to(weight.device, weight.dtype)
        if pad is not None:
            weight[pad].zero_()
    return factor


def _rms(values: Tensor) -> float:
    return float(values.double().pow(2).mean().sqrt()) if values.numel() else 0.0


def token_embeddings(model: nn.Module) -> list[nn.Embedding]:
    """The embeddings of ``model``'s vocabulary (its word embeddings, where pre-trained
    vectors go: ``models.word_vectors``): every ``layers.TokenEmbedding``, and every plain
    ``nn.Embedding`` with ``config.vocab_size`` rows (the RNN baselines'), each weight once,
    in module order. One for most models; one per wrapped model of an ensemble, one per
    decoder of ``hier_joint``."""
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    found: dict[int, nn.Embedding] = {}
    for module in model.modules():
        plain = type(module) is nn.Embedding and module.num_embeddings == vocab_size
        if isinstance(module, TokenEmbedding) or plain:
            found.setdefault(id(module.weight), module)  # type: ignore[arg-type]
    return list(found.values())
