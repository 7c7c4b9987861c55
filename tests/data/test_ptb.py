"""Penn Treebank is Mikolov's, token for token: the counts every PTB perplexity is over."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_params
from pipeline.data.loader import open_split
from pipeline.data.tokenize import tokenize_corpus
from pipeline.data.vocab import Vocab

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("params_file", ["params.yaml", "profiles/paper.yaml"])
def test_ptb_tokenizes_to_mikolovs_counts(shared_data: Path, tmp_path: Path, params_file: str):
    """With the shipped settings: 929,589 / 73,760 / 82,430 scored tokens (every word plus
    one <eos> per sentence), a vocabulary of exactly 10,000 word types (<unk> and <eos>
    included; <pad> <bos> <sep> are not words), no sentence cut."""
    params = load_params(REPO / params_file)
    out = tmp_path / "ptb"
    record = tokenize_corpus("ptb", shared_data / "ptb", out, params)
    assert record.vocab_words == 10_000
    assert record.target_tokens["lm"] == {"train": 929_589, "valid": 73_760, "test": 82_430}
    vocab = Vocab.load(out / "vocab.json")
    assert vocab.kind == "whitespace" and "<unk>" in vocab and "n't" in vocab and "N" in vocab
    # the file's own <unk> is the one unknown type: no word is unknown to the vocabulary
    lines = (shared_data / "ptb" / "ptb.test.txt").read_text().splitlines()
    words = [w for line in lines for w in line.split()]
    assert all(w in vocab for w in words)
    longest = max(len(line.split()) for line in lines)
    test = open_split(out, "lm", "test")
    assert max(len(s) for i in range(len(test)) for s in test[i].sentences) == longest + 1
