"""ChatEval metrics and BLEU against hand-computed values and sacrebleu itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sacrebleu
from gensim.models import KeyedVectors

from pipeline.eval.stats import paired_bootstrap
from pipeline.eval.text import (
    average_length,
    bleu_from_stats,
    bleu_signature,
    bleu_stats,
    chateval,
    corpus_bleu,
    distinct_1,
    distinct_2,
    distinct_n,
    embedding_average,
    embedding_extrema,
    embedding_scores,
    greedy_matching,
    strip_special,
    wrapped_bleu,
)

# Hand-set 2-d vectors: a = (1, 0), b = (0, 2), c = (-3, 1).
VECTORS = {
    "a": np.array([1.0, 0.0]),
    "b": np.array([0.0, 2.0]),
    "c": np.array([-3.0, 1.0]),
}


WORDS = [f"w{i}" for i in range(20)]


def sentences(n: int, seed: int) -> list[str]:
    """Random sentences over a small vocabulary, so n-grams of all orders match sometimes."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 15)))) for _ in range(n)]


# --------------------------------------------------------------------------- diversity


def test_distinct_on_two_lines():
    lines = ["a b a", "c b"]
    # 5 words, unique {a, b, c} = 3 -> distinct-1 = 3/5
    assert distinct_1(lines) == pytest.approx(3 / 5)
    # within-line bigrams (a,b) (b,a) (c,b): 3 unique, divided by 5 WORDS -> 3/5.
    # (Dividing by the 3 bigrams would give 1.0; a cross-line bigram (a,c) would give 4/5.)
    assert distinct_2(lines) == pytest.approx(3 / 5)


def test_distinct_counts_repeats_once():
    # 4 words, 1 unique word, 1 unique bigram (a,a)
    assert distinct_1(["a a a a"]) == pytest.approx(1 / 4)
    assert distinct_2(["a a a a"]) == pytest.approx(1 / 4)
    assert distinct_n(["a b c", "a b c"], 3) == pytest.approx(1 / 6)


def test_lengths_and_empty_lines():
    # empty lines have no words (not one empty word as with split(' '))
    assert average_length(["a b a", "c b", ""]) == pytest.approx(5 / 3)
    assert distinct_1(["", " "]) == 0.0
    with pytest.raises(ValueError, match="no lines"):
        average_length([])
    with pytest.raises(TypeError, match="one string"):
        distinct_1("a b")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n: must be"):
        distinct_n(["a"], 0)


# --------------------------------------------------------------------------- embeddings


# Unit vectors (ChatEval's pymagnitude serves them normalised): a = (1, 0), b = (0, 1),
# c = (-3, 1) / sqrt 10.
C0, C1 = -3 / math.sqrt(10), 1 / math.sqrt(10)


def test_embedding_metrics_hand_values_on_unit_vectors():
    hyp, ref = "a c", "b"
    # average: sum(hyp) = (1 + C0, C1), ref = (0, 1): cos = C1 / |(1 + C0, C1)| = 0.98709;
    # on raw vectors it would be cos((-2, 1), (0, 2)) = 1/sqrt 5 = 0.447
    average = C1 / math.hypot(1 + C0, C1)
    assert embedding_average(hyp, ref, VECTORS) == pytest.approx(average)
    assert average == pytest.approx(0.98709, abs=1e-5)
    # extrema: dim 0 over {1, C0 = -0.949} -> 1, dim 1 over {0, C1} -> C1;
    # cos((1, C1), (0, 1)) = C1 / sqrt(1 + 1/10) = 1/sqrt 11 (raw vectors: 1/sqrt 10)
    assert embedding_extrema(hyp, ref, VECTORS) == pytest.approx(1 / math.sqrt(11))
    # greedy: cos(a,b) = 0, cos(c,b) = 1/sqrt 10.
    # hyp -> ref: mean(0, 1/sqrt 10); ref -> hyp: max = 1/sqrt 10; average of both
    expected = (1 / math.sqrt(10) / 2 + 1 / math.sqrt(10)) / 2
    assert greedy_matching(hyp, ref, VECTORS) == pytest.approx(expected)
    assert greedy_matching(ref, hyp, VECTORS) == pytest.approx(expected)  # symmetric


def test_extrema_takes_the_larger_magnitude_and_a_tie_goes_to_positive():
    vectors = {"d": np.array([1.0, 1.0]), "e": np.array([-2.0, 0.0])}
    # unit d = (0.707, 0.707), e = (-1, 0): dim 0 -> -1, dim 1 -> 0.707;
    # cos((-1, 0.707), (-1, 0)) = 1 / sqrt 1.5 (raw vectors would give 2 / sqrt 5)
    assert embedding_extrema("d e", "e", vectors) == pytest.approx(1 / math.sqrt(1.5))
    vectors = {"d": np.array([2.0, 0.0]), "e": np.array([-1.0, 0.0])}
    # unit: dim 0 max 1, min -1 (same magnitude) -> 1; the extrema vector is (1, 0) = d
    assert embedding_extrema("d e", "d", vectors) == pytest.approx(1.0)


def test_unknown_words_left_out_and_empty_sides_as_chateval():
    assert embedding_average("a c zzz", "b qq", VECTORS) == pytest.approx(
        embedding_average("a c", "b", VECTORS)
    )
    for metric in (embedding_average, embedding_extrema):
        assert math.isnan(metric("zzz", "a", VECTORS))  # no response word: skipped
        assert metric("a", "", VECTORS) == 0.0  # no reference word: 0
    assert greedy_matching("zzz", "a", VECTORS) == greedy_matching("a", "", VECTORS) == 0.0


def test_chateval_averages_pairs_and_accepts_gensim_vectors():
    kv = KeyedVectors(vector_size=2)
    kv.add_vectors(list(VECTORS), np.stack(list(VECTORS.values())))
    hyps, refs = ["a c", "a", "zzz", "b"], ["b", "a", "a", "zzz"]
    scores = chateval(hyps, refs, kv)
    # per pair: average (0.98709, 1, skipped, 0), extrema (1/sqrt 11, 1, skipped, 0)
    average = C1 / math.hypot(1 + C0, C1)
    assert scores.embedding_average == pytest.approx((average + 1) / 3, rel=1e-6)
    assert scores.embedding_extrema == pytest.approx((1 / math.sqrt(11) + 1) / 3, rel=1e-6)
    assert scores.embedding_skipped == 1
    assert scores.avg_length == pytest.approx(5 / 4)
    assert scores.distinct_1 == pytest.approx(4 / 5)
    assert scores.distinct_2 == pytest.approx(1 / 5)
    per_pair = embedding_scores(hyps, refs, VECTORS)
    assert scores.greedy_matching == pytest.approx(per_pair.greedy.mean(), rel=1e-6)
    assert set(scores.as_dict()) >= {"distinct_1", "embedding_average", "greedy_matching"}
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        embedding_scores(["a", "b"], ["a"], VECTORS)


# --------------------------------------------------------------------------- BLEU


def test_corpus_bleu_hand_value():
    hyp, ref = "the cat sat on the mat", "the cat sat on a mat"
    # clipped n-gram precisions 5/6, 3/5, 2/4, 1/3; equal lengths -> no brevity penalty;
    # BLEU = (5/6 * 3/5 * 1/2 * 1/3) ** (1/4) = (1/12) ** (1/4)
    assert corpus_bleu([hyp], [ref]) == pytest.approx(100 * (1 / 12) ** 0.25, abs=1e-9)
    assert corpus_bleu([hyp], [ref]) == pytest.approx(sacrebleu.corpus_bleu([hyp], [[ref]]).score)


def test_bleu_ignores_special_tokens_but_not_unk():
    assert strip_special("<bos> a <unk> b <eos> <pad> <pad>") == "a <unk> b"
    plain = corpus_bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    marked = corpus_bleu(
        ["<bos> the cat sat on the mat <eos>"], ["<bos> the cat sat on a mat <eos>"]
    )
    assert marked == pytest.approx(plain)


def test_bleu_tokenize_none_keeps_placeholders_whole():
    hyp, ref = "at [hotel_name] .", "at [restaurant_name] ."
    # whitespace tokens: "at", ".", and the placeholders differ -> 2 of 3 unigrams match
    stats = bleu_stats([hyp], [ref], tokenize="none")
    assert stats[0, 2] == 2 and stats[0, 6] == 3
    # 13a cuts "[hotel_name]" into "[ hotel _ name ]": 6 of 7 unigrams match
    stats_13a = bleu_stats([hyp], [ref])
    assert stats_13a[0, 2] == 6 and stats_13a[0, 6] == 7


def test_bleu_stats_reproduce_corpus_bleu_for_any_subset():
    hyps, refs = sentences(40, seed=0), sentences(40, seed=1)
    stats = bleu_stats(hyps, refs)
    assert stats.shape == (40, 10)
    assert bleu_from_stats(stats) == pytest.approx(corpus_bleu(hyps, refs), abs=1e-9)
    subset = [3, 3, 7, 12, 30]
    assert bleu_from_stats(stats[subset]) == pytest.approx(
        corpus_bleu([hyps[i] for i in subset], [refs[i] for i in subset]), abs=1e-9
    )


def test_bleu_bootstrap_fast_path_equals_resampled_corpus():
    refs = sentences(30, seed=2)
    good = [" ".join(r.split()[:-1]) for r in refs]  # reference minus its last word
    bad = sentences(30, seed=3)  # unrelated sentences
    slow = paired_bootstrap(corpus_bleu, good, bad, refs, n=60, seed=4)
    fast = paired_bootstrap(
        bleu_from_stats, bleu_stats(good, refs), bleu_stats(bad, refs), n=60, seed=4
    )
    assert fast.p_value == slow.p_value
    assert fast.score_a == pytest.approx(slow.score_a) and fast.score_b == pytest.approx(
        slow.score_b
    )
    assert fast.p_value < 0.05


def test_bleu_rejects_bad_input():
    with pytest.raises(ValueError, match="1 hypotheses but 2 references"):
        corpus_bleu(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="required"):
        corpus_bleu(["a"], None)
    with pytest.raises(ValueError, match="unknown sacrebleu tokenizer 'bogus'"):
        corpus_bleu(["a"], ["a"], tokenize="bogus")


def test_wrapped_bleu_hand_values():
    hyps = ["the cat sat on the mat", "a b c d"]
    refs = ["the cat sat on a mat", "a b c e"]
    # GO_/EOS_-wrapped: matched/total 1-grams 7/8 + 5/6, 2-grams 5/7 + 3/5, 3-grams 3/6 + 2/4,
    # 4-grams 2/5 + 1/3; lengths 14 = 14, so the brevity penalty is exp(0) = 1
    expected = 100 * (12 / 14 * 8 / 12 * 5 / 10 * 3 / 8) ** 0.25
    assert wrapped_bleu(hyps, refs) == pytest.approx(expected, rel=1e-6)
    # the wrapping is what lifts it over sacrebleu on the same text (50.0 here)
    assert corpus_bleu(hyps, refs, tokenize="none") == pytest.approx(50.0)
    assert wrapped_bleu(["a b"], ["a b"]) == pytest.approx(100.0, rel=1e-6)
    # shorter hypotheses pay the brevity penalty: 4 wrapped tokens against 6
    short = wrapped_bleu(["a b"], ["a b c d"])
    assert short < 100 * math.exp(1 - 6 / 4) + 1e-6


def test_bleu_signature_names_the_tokenizer():
    assert bleu_signature("none").startswith("nrefs:1|case:mixed|eff:no|tok:none|smooth:exp")
    assert "tok:13a" in bleu_signature("13a")
