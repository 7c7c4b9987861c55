"""The unigram baseline: add-one probabilities and the tokens it scores, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.data.records import GenerateExample, LMExample, SelectExample
from pipeline.eval.unigram import Unigram, UnigramScore, scored_tokens


def test_add_one_probabilities_by_hand():
    # counts over a 5-word vocabulary: w1 x3, w2 x1 -> N = 4; p = (c + 1) / (4 + 5)
    model = Unigram.fit([np.array([1, 1, 2]), np.array([1])], vocab_size=5)
    assert np.exp(model.log_probs) == pytest.approx([1 / 9, 4 / 9, 2 / 9, 1 / 9, 1 / 9])
    assert model.nll(np.array([1, 3])) == pytest.approx(-math.log(4 / 9) - math.log(1 / 9))


def test_perplexity_of_a_score_is_exp_mean_nll():
    score = UnigramScore(nll_sum=12.0, n_tokens=4, n_examples=2)
    assert score.loss == 3.0 and score.ppl == pytest.approx(math.exp(3.0))
    assert math.isnan(UnigramScore(0.0, 0, 0).ppl)


def test_scored_tokens_are_what_models_score():
    empty = np.zeros(0, dtype=np.int32)
    generate = GenerateExample(
        "d", 1, empty, empty, empty, empty, np.array([2, 7, 8, 3]), None, None, None
    )
    assert scored_tokens(generate).tolist() == [7, 8, 3]  # after <bos>, <eos> included
    lm = LMExample("d", 0, [np.array([5, 3]), np.array([6, 7, 3])])
    assert scored_tokens(lm).tolist() == [5, 3, 6, 7, 3]  # every sentence, <eos> included
    with pytest.raises(TypeError, match="SelectExample"):
        scored_tokens(SelectExample.__new__(SelectExample))
