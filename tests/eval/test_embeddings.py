"""Word vectors: deterministic word2vec training, word2vec text/binary/GloVe loading, and
gensim imported only when vectors are trained or read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gensim.models import KeyedVectors

from pipeline.errors import DataError
from pipeline.eval.embeddings import load_vectors, sniff_format, train_word2vec

REPO = Path(__file__).resolve().parents[2]
SENTENCES = [
    ["the", "cat", "sat", "on", "the", "mat"],
    ["the", "dog", "sat", "on", "the", "rug"],
    ["a", "cat", "and", "a", "dog"],
] * 5


def small(seed: int = 0) -> KeyedVectors:
    return train_word2vec(SENTENCES, dim=8, window=2, epochs=3, seed=seed)


def test_every_training_word_gets_a_vector():
    kv = small()
    assert kv.vector_size == 8
    assert set(kv.index_to_key) == {w for s in SENTENCES for w in s}
    assert np.isfinite(kv["cat"]).all()


def test_training_is_deterministic_for_a_seed():
    first, again, other = small(0), small(0), small(1)
    assert first.index_to_key == again.index_to_key
    np.testing.assert_array_equal(first.vectors, again.vectors)
    assert not np.allclose(first.vectors, other.vectors)


@pytest.mark.slow
def test_training_is_deterministic_across_processes():
    # Python's str hash differs per process; the vectors must not depend on it.
    code = (
        "from pipeline.eval.embeddings import train_word2vec\n"
        f"kv = train_word2vec({SENTENCES!r}, dim=8, window=2, epochs=3, seed=0)\n"
        "print(repr(kv['cat'].tolist()))\n"
    )
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # not ours
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == repr(small(0)["cat"].tolist()) + "\n"


def test_training_rejects_empty_corpus_and_bad_sizes():
    with pytest.raises(ValueError, match="no words"):
        train_word2vec([[], []])
    with pytest.raises(ValueError, match="must be >= 1"):
        train_word2vec(SENTENCES, dim=0)
    with pytest.raises(ValueError, match="min_count=99"):
        train_word2vec(SENTENCES, min_count=99)


@pytest.mark.parametrize("binary", [False, True])
def test_save_and_load_round_trip_with_format_detection(tmp_path, binary):
    kv = small()
    path = tmp_path / ("vectors.bin" if binary else "vectors.txt")
    kv.save_word2vec_format(str(path), binary=binary)
    assert sniff_format(path) == (binary, True)
    loaded = load_vectors(path)
    assert loaded.index_to_key == kv.index_to_key
    np.testing.assert_allclose(loaded.vectors, kv.vectors, rtol=1e-5, atol=1e-6)


def test_loads_header_less_glove_text(tmp_path):
    path = tmp_path / "glove.txt"
    path.write_text("cat 0.5 -1.0 2.0\ndog 1 0 0\n")
    kv = load_vectors(path)
    assert kv.vector_size == 3
    np.testing.assert_allclose(kv["cat"], [0.5, -1.0, 2.0])


def test_bad_vector_files_raise_data_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_vectors(tmp_path / "missing.txt")
    prose = tmp_path / "prose.txt"
    prose.write_text("hello world\nthis is not a vectors file\n")
    with pytest.raises(DataError, match=r"prose\.txt:1: not a word-vectors file"):
        load_vectors(prose)
    short = tmp_path / "short.txt"
    short.write_text("2 3\ncat 0.1 0.2 0.3\n")  # header promises 2 vectors, one follows
    with pytest.raises(DataError, match=r"short\.txt"):
        load_vectors(short)


@pytest.mark.slow
def test_the_evaluation_code_imports_gensim_only_to_compute_vectors():
    """The evaluation path runs where gensim is not installed (``bench.gpu_check``)."""
    code = (
        "import sys\n"
        "import pipeline.eval.generation\n"
        "print('gensim' in sys.modules)\n"
        "from pipeline.eval.embeddings import train_word2vec\n"
        "train_word2vec([['a', 'b']], dim=2, epochs=1)\n"
        "print('gensim' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True"]
