"""Vocabularies: tokenization, frequency ranking, fixed special ids, persistence, BPE."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.config import VocabParams, parse_params
from pipeline.data.special import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID
from pipeline.data.vocab import Vocab, build_vocab, is_placeholder, word_tokenize
from pipeline.errors import ConfigError, DataError
from tests.batches import chitchat_dialogues


def test_word_tokenize_splits_punctuation_and_keeps_placeholders() -> None:
    text = "Hi, you! I don't like [hotel_area] [laughs] <unk> $3.50"
    assert word_tokenize(text) == [
        "hi", ",", "you", "!", "i", "don't", "like", "[hotel_area]",
        "[", "laughs", "]", "<unk>", "$", "3", ".", "50",
    ]  # fmt: skip
    assert word_tokenize("Hello World", lowercase=False) == ["Hello", "World"]
    assert is_placeholder("[train_book_people]") and not is_placeholder("[laughs]")


def test_build_vocab_ranks_by_count_then_token_with_fixed_special_ids() -> None:
    singles = [f"s{i}" for i in range(9, -1, -1)]  # 10 words seen once, in reverse order
    texts = ["e b a", "a b e", "a e b a", "a", " ".join(singles)]  # a:5, b:3, e:3
    vocab = build_vocab(texts, VocabParams(size=16))  # room for 11 words
    assert vocab.tokens[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    # Count descending; ties (b/e, the singles) by the token itself.
    assert vocab.tokens[len(SPECIAL_TOKENS) :] == ("a", "b", "e", *(f"s{i}" for i in range(8)))
    assert (vocab.id("<pad>"), vocab.id("<unk>"), vocab.id("<bos>")) == (PAD_ID, UNK_ID, BOS_ID)
    assert vocab.id("s9") == UNK_ID
    frequent = build_vocab(texts, VocabParams(size=100, min_freq=3))
    assert frequent.tokens[len(SPECIAL_TOKENS) :] == ("a", "b", "e")


def test_reserved_tokens_get_ids_even_when_unseen() -> None:
    vocab = build_vocab(["x y"], VocabParams(size=16), reserved=["[hotel_name]", "<pad>"])
    assert vocab.tokens[len(SPECIAL_TOKENS)] == "[hotel_name]"
    assert vocab.encode("at [hotel_name] .")[1] == vocab.id("[hotel_name]")
    with pytest.raises(ValueError, match="no room"):
        build_vocab(["x"], VocabParams(size=16), reserved=[f"[a_{i}]" for i in range(20)])


def test_encode_decode_round_trip_and_unknown_words() -> None:
    vocab = build_vocab(["the cat sat on the mat ."], VocabParams(size=16))
    ids = vocab.encode("The dog sat.")
    assert ids == [vocab.id("the"), UNK_ID, vocab.id("sat"), vocab.id(".")]
    assert vocab.decode([BOS_ID, *ids, EOS_ID, PAD_ID]) == "the <unk> sat ."
    assert vocab.decode([BOS_ID, *ids], strip_special=False) == "<bos> the <unk> sat ."
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab.decode([len(vocab)])


def test_encode_batch_equals_encode_one_by_one() -> None:
    texts = [t for d in chitchat_dialogues(30) for t in d]
    vocab = build_vocab(texts, VocabParams(size=300))
    tricky = ["", "a\x00b", "  ", "Hello, World!!", "[hotel_area] x", *texts]
    batch = vocab.encode_batch(tricky)
    assert len(batch) == len(tricky)
    for text, ids in zip(tricky, batch, strict=True):
        assert ids.dtype == np.int32
        assert ids.tolist() == vocab.encode(text)


def test_save_load_round_trip_and_hash(tmp_path) -> None:
    vocab = build_vocab(["a b c a"], VocabParams(size=16, lowercase=False))
    vocab.save(tmp_path / "vocab.json")
    loaded = Vocab.load(tmp_path / "vocab.json")
    assert loaded == vocab and loaded.tokens == vocab.tokens and not loaded.lowercase
    other = build_vocab(["a b d a"], VocabParams(size=16, lowercase=False))
    assert other.content_hash != vocab.content_hash
    cased = build_vocab(["a b c a"], VocabParams(size=16, lowercase=True))
    assert cased.content_hash != vocab.content_hash  # same tokens, different encoding


def test_load_rejects_missing_and_corrupt_files(tmp_path) -> None:
    with pytest.raises(DataError, match="not found"):
        Vocab.load(tmp_path / "nope.json")
    bad = tmp_path / "vocab.json"
    bad.write_text("{not json")
    with pytest.raises(DataError) as err:
        Vocab.load(bad)
    assert str(bad) in str(err.value)
    bad.write_text(json.dumps({"format": 1, "kind": "word", "lowercase": True, "tokens": ["x"]}))
    with pytest.raises(DataError, match="invalid vocabulary"):
        Vocab.load(bad)


def test_bpe_vocab_keeps_special_ids_and_round_trips(tmp_path) -> None:
    texts = [t for d in chitchat_dialogues(60) for t in d]
    params = VocabParams(kind="bpe", size=400)
    vocab = build_vocab(texts, params, reserved=["[hotel_name]"])
    assert vocab.kind == "bpe" and len(vocab) == 400
    assert vocab.tokens[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    text = "Hello there, how are you doing today?"
    ids = vocab.encode(text)
    assert UNK_ID not in ids and all(i >= len(SPECIAL_TOKENS) for i in ids)
    assert vocab.decode([BOS_ID, *ids, EOS_ID]) == text.lower()
    assert vocab.id("[hotel_name]") in vocab.encode("the [hotel_name] is nice")
    assert [a.tolist() for a in vocab.encode_batch(texts[:20])] == [
        vocab.encode(t) for t in texts[:20]
    ]
    vocab.save(tmp_path / "bpe.json")
    loaded = Vocab.load(tmp_path / "bpe.json")
    assert loaded == vocab and loaded.encode(text) == ids


def test_bad_vocab_params_name_the_dotted_key() -> None:
    raw = {"tokenize": {"corpora": {"chitchat": {"vocab": {"size": 3}}}}}
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    assert err.value.key == "tokenize.corpora.chitchat.vocab.size"
    raw = {"tokenize": {"corpora": {"chitchat": {"vocab": {"kind": "chars"}}}}}
    with pytest.raises(ConfigError) as err:
        parse_params(raw)
    assert err.value.key == "tokenize.corpora.chitchat.vocab.kind"
