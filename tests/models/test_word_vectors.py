"""Pre-trained word vectors: reading .vec files (header or not, gzipped), the rows kept,
the one scale factor, the pad row, coverage, and the errors that name file and line."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.artifacts import DataSizes
from pipeline.data.special import SPECIAL_TOKENS
from pipeline.errors import DataError
from pipeline.models import registry
from pipeline.models.layers import TokenEmbedding
from pipeline.models.word_vectors import (
    Coverage,
    DimensionError,
    copy_into,
    read_word_vectors,
    token_embeddings,
)

# ids 0-4 are the special tokens; the words: a=5, b=6, c=7
TOKENS = [*SPECIAL_TOKENS, "a", "b", "c"]
ROWS = "a 3 4 \nzzz 9 9 \nb -4 3 \n<pad> 7 7 \n"  # FastText ends rows with a space
HEADER = "4 2\n"


def load(embedding: nn.Embedding, path: Path) -> Coverage:
    """As a fresh run loads them: the driver reads the file for the model's width
    (``train.training``), each worker copies the rows in (``train.job``)."""
    vectors = read_word_vectors(path, TOKENS, embedding.embedding_dim)
    copy_into(embedding, vectors)
    return vectors.coverage


def write(path: Path, text: str) -> Path:
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("name", "text"),
    [("header.vec", HEADER + ROWS), ("plain.vec", ROWS), ("zipped.vec.gz", HEADER + ROWS)],
)
def test_reads_the_vocabulary_rows_with_or_without_header_and_gzipped(tmp_path, name, text):
    vectors = read_word_vectors(write(tmp_path / name, text), TOKENS)
    assert vectors.dim == 2 and vectors.vocab_size == 8
    # the file's order; zzz is no vocabulary word, <pad> never gets a vector
    assert vectors.ids.tolist() == [5, 6]
    assert vectors.vectors.tolist() == [[3.0, 4.0], [-4.0, 3.0]]
    cov = vectors.coverage
    # 7 types may get a vector (all but <pad>), 2 of them do; 4 rows in the file
    assert (cov.found, cov.types, cov.file_words) == (2, 7, 4)
    assert cov.fraction == pytest.approx(2 / 7)
    assert cov.as_dict() == {"found": 2, "types": 7, "fraction": 2 / 7, "file_words": 4}


def test_the_first_row_of_a_word_counts_and_blank_lines_are_skipped(tmp_path):
    path = write(tmp_path / "v.vec", "c 1 1\n\nc 2 2\n\n")
    vectors = read_word_vectors(path, TOKENS)
    assert vectors.ids.tolist() == [7] and vectors.vectors.tolist() == [[1.0, 1.0]]
    assert vectors.coverage.file_words == 2


def _embedding() -> TokenEmbedding:
    embedding = TokenEmbedding(len(TOKENS), 2)
    with torch.no_grad():
        embedding.weight[1:] = torch.tensor([1.0, -1.0])  # RMS of the non-pad rows: 1
    return embedding


def test_copies_known_rows_at_the_initial_scale_and_leaves_the_rest(tmp_path):
    embedding = _embedding()
    before = embedding.weight.detach().clone()
    coverage = load(embedding, write(tmp_path / "v.vec", HEADER + ROWS))
    assert coverage.found == 2 and coverage.types == 7
    after = embedding.weight.detach()
    # the kept rows a=(3,4), b=(-4,3) have RMS sqrt(50/4); the rows as initialised RMS 1:
    # one factor 1/sqrt(12.5) = sqrt(2)/5 for both
    factor = math.sqrt(2) / 5
    assert after[5].tolist() == pytest.approx([3 * factor, 4 * factor])
    assert after[6].tolist() == pytest.approx([-4 * factor, 3 * factor])
    assert torch.equal(after[[1, 2, 3, 4, 7]], before[[1, 2, 3, 4, 7]])  # no vector: untouched
    assert torch.equal(after[0], torch.zeros(2))  # the file's <pad> row is not taken
    # what the model sees: sqrt(d) times the rows, known words as large as the others
    seen = embedding(torch.tensor([5, 6]))
    assert seen.pow(2).mean().sqrt().item() == pytest.approx(math.sqrt(2))
    assert embedding(torch.tensor([7])).pow(2).mean().sqrt().item() == pytest.approx(math.sqrt(2))


def test_copy_into_returns_the_factor_and_keeps_a_plain_embeddings_pad_row(tmp_path):
    vectors = read_word_vectors(write(tmp_path / "v.vec", ROWS), TOKENS, pad_id=-1)
    assert vectors.ids.tolist() == [5, 6, 0]  # no pad excluded when reading ...
    embedding = nn.Embedding(len(TOKENS), 2, padding_idx=0)
    with torch.no_grad():
        embedding.weight[1:] = 2.0  # RMS 2
    factor = copy_into(embedding, vectors)
    # ... but the embedding's padding row is never written: a and b alone set the factor
    assert factor == pytest.approx(2 / math.sqrt(12.5))
    assert torch.equal(embedding.weight[0].detach(), torch.zeros(2))
    assert embedding.weight[5].tolist() == pytest.approx([3 * factor, 4 * factor])


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (HEADER + "a 3 4\nb 1\n", 3, "1 values after 'b', expected 2"),
        ("a 3 4\nzzz 1 2 3\n", 2, "3 values after 'zzz', expected 2"),
        (HEADER + "a 3 4\nb\n", 3, "no vector values"),
        (HEADER + "a 3 4\nb 1 x\n", 3, "not a number"),
        ("a 3 4\nb 1 nan\n", 2, "not a finite float32"),
        ("a 3 4\nb 1 1e50\n", 2, "not a finite float32"),
        ("5 2\na 3 4\nb 1 2\n", 1, "the header announces 5 vectors but the file holds 2"),
    ],
)
def test_a_corrupt_line_names_the_file_and_line(tmp_path, text, line, reason):
    path = write(tmp_path / "bad.vec", text)
    with pytest.raises(DataError) as caught:
        read_word_vectors(path, TOKENS)
    assert f"{path}:{line}: " in str(caught.value) and reason in str(caught.value)
    assert caught.value.line == line


def test_a_truncated_gzip_file_is_a_data_error(tmp_path):
    whole = write(tmp_path / "v.vec.gz", HEADER + ROWS * 200).read_bytes()
    cut = tmp_path / "cut.vec.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"cut\.vec\.gz"):
        read_word_vectors(cut, TOKENS)


@pytest.mark.parametrize("text", [HEADER + ROWS, ROWS], ids=["header", "no header"])
def test_another_dimension_says_both_and_what_to_set(tmp_path, text):
    path = write(tmp_path / "v.vec", text)
    with pytest.raises(DimensionError) as caught:
        load(TokenEmbedding(len(TOKENS), 3), path)
    err = caught.value
    assert (err.file_dim, err.model_dim) == (2, 3)
    assert "have 2 dimensions" in str(err) and "has 3" in str(err)
    assert "d_model" in str(err) and "to 2" in str(err)
    with pytest.raises(DimensionError, match="have 2 dimensions"):
        copy_into(TokenEmbedding(len(TOKENS), 3), read_word_vectors(path, TOKENS))


def test_another_vocabulary_size_is_refused(tmp_path):
    vectors = read_word_vectors(write(tmp_path / "v.vec", ROWS), TOKENS)
    with pytest.raises(ValueError, match="vocabulary of 8 tokens, but the embedding has 9"):
        copy_into(TokenEmbedding(9, 2), vectors)


def test_a_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_word_vectors(tmp_path / "nope.vec", TOKENS)


def test_every_registered_model_exposes_its_token_embeddings():
    vocab = 500
    for name in registry.names():
        with torch.device("meta"):  # sizes only: nothing allocated
            model = registry.build(name, DataSizes(vocab, 40))
        embeddings = token_embeddings(model)
        assert embeddings, f"{name} has no token embedding"
        assert all(e.num_embeddings == vocab for e in embeddings), name
        if name in ("ensemble", "hier_joint"):  # one per wrapped model / decoder
            assert len(embeddings) > 1
        else:
            assert len(embeddings) == 1, name


@pytest.mark.parametrize("name", ["hrt_last", "hrt_all", "transformer_ranker"])
def test_selection_models_take_the_vectors(tmp_path, name):
    model = registry.build(name, DataSizes(len(TOKENS)), d_embed=2, d_model=8, n_heads=2)
    (embedding,) = token_embeddings(model)
    assert isinstance(embedding, TokenEmbedding) and embedding.embedding_dim == 2
    before = embedding.weight.detach().clone()
    load(embedding, write(tmp_path / "v.vec", ROWS))
    after = embedding.weight.detach()
    factor = before[1:].pow(2).mean().sqrt() / math.sqrt(12.5)
    assert torch.allclose(after[5], torch.tensor([3.0, 4.0]) * factor)
    assert torch.allclose(after[6], torch.tensor([-4.0, 3.0]) * factor)
    assert torch.equal(after[[0, 1, 7]], before[[0, 1, 7]]) and not after[0].any()
