"""One history definition: what serving feeds a model is what training fed it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.config import GenerateParams, VocabParams
from pipeline.data.corpora import read_corpus
from pipeline.data.encoding import encode_dialogues, vocab_texts
from pipeline.data.examples import build_generate
from pipeline.data.vocab import build_vocab
from pipeline.serving import ServingSpec, generate_batch


@pytest.mark.parametrize(
    ("max_history", "max_utterances"), [(150, 10), (23, 10), (40, 2), (None, None), (None, 3)]
)
def test_serving_encodes_a_dialogue_exactly_as_training_did(max_history, max_utterances):
    """Every response turn of real chitchat dialogues: the history tokens, utterance
    indices, positions and speakers serving builds from the texts equal the training
    example's (cut mid-utterance by ``max_history``, or by ``max_utterances``)."""
    dialogues = list(itertools.islice(read_corpus("chitchat"), 6))
    vocab = build_vocab(vocab_texts(dialogues), VocabParams(size=500))
    params = GenerateParams(max_history=max_history, max_utterances=max_utterances)
    table = build_generate(encode_dialogues(dialogues, vocab), params)
    spec = ServingSpec("generate", max_history=max_history, max_utterances=max_utterances)
    by_id = {d.id: d for d in dialogues}
    checked = 0
    for i in range(len(table)):
        example = table[i]
        texts = [t.text for t in by_id[example.dialogue_id].turns[: example.turn]]
        served = generate_batch([texts], vocab, spec).history
        n = int(served.input_mask[0].sum())
        for column in ("input_ids", "utt_index", "utt_pos", "speaker"):
            got = getattr(served, column)[0, :n].numpy()
            np.testing.assert_array_equal(got, getattr(example, column), err_msg=column)
        checked += 1
    assert checked > 20


def test_no_limits_keep_the_whole_dialogue_so_far():
    """``max_history: null, max_utterances: null`` (the HT-Encoder authors' MultiWOZ
    setting): each history is every earlier turn, whole."""
    dialogues = list(itertools.islice(read_corpus("chitchat"), 6))
    vocab = build_vocab(vocab_texts(dialogues), VocabParams(size=500))
    encoded = encode_dialogues(dialogues, vocab)
    table = build_generate(encoded, GenerateParams(max_history=None, max_utterances=None))
    by_id = {d.id: d for d in encoded}
    longest = 0
    for i in range(len(table)):
        example = table[i]
        earlier = by_id[example.dialogue_id].utterances[: example.turn]
        assert len(example.input_ids) == sum(len(u) + 2 for u in earlier)  # <bos> .. <eos>
        assert int(example.utt_index.max()) + 1 == len(earlier)
        longest = max(longest, len(example.input_ids))
    assert longest > 150  # beyond the default cap, so the test can tell
