"""Example builders: histories, targets, negatives, LM documents, MultiWOZ and DSTC7 extras."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.config import GenerateParams, LMParams, SelectParams, VocabParams
from pipeline.data.acts import ActInventory, delexicalize, serialize_acts, serialize_belief
from pipeline.data.corpora import read_corpus
from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.encoding import (
    EncodedDialogue,
    EncodeOptions,
    encode_dialogues,
    knowledge_flags,
    profile_courses,
    vocab_texts,
)
from pipeline.data.examples import (
    build_generate,
    build_lm,
    build_prompts,
    build_select,
    request_dialogue,
)
from pipeline.data.records import (
    KNOWLEDGE_PRIOR,
    KNOWLEDGE_SUGGESTED,
    ExampleTable,
    GenerateExample,
)
from pipeline.data.special import BOS_ID, EOS_ID, SPEAKER_OTHER, SPEAKER_SELF
from pipeline.data.vocab import build_vocab
from pipeline.errors import ConfigError
from tests.batches import chitchat_dialogues
from tests.data.equality import examples_equal

B, E = BOS_ID, EOS_ID


def dialogue(did: str, speakers: str, *utterances: list[int], responder: str | None = None):
    return EncodedDialogue(
        did, tuple(speakers), tuple(np.array(u, dtype=np.int32) for u in utterances), responder
    )


# Speakers A B A B; utterance lengths 3, 2, 4, 1.
ABAB = dialogue("d", "ABAB", [10, 11, 12], [20, 21], [30, 31, 32, 33], [40])


def only(table: ExampleTable, turn: int) -> GenerateExample:
    (example,) = [e for e in table if e.turn == turn]
    return example


def test_generate_history_layout_on_a_hand_made_dialogue() -> None:
    table = build_generate([ABAB], GenerateParams(max_history=100, max_response=30))
    assert [e.turn for e in table] == [1, 2, 3]
    e = only(table, 3)
    assert e.input_ids.tolist() == [B, 10, 11, 12, E, B, 20, 21, E, B, 30, 31, 32, 33, E]
    assert e.utt_index.tolist() == [0] * 5 + [1] * 4 + [2] * 6
    assert e.utt_pos.tolist() == [*range(5), *range(4), *range(6)]
    # The response (turn 3) is B's: B's own turn is SELF, A's turns OTHER.
    assert e.speaker.tolist() == [SPEAKER_OTHER] * 5 + [SPEAKER_SELF] * 4 + [SPEAKER_OTHER] * 6
    assert e.target_ids.tolist() == [B, 40, E]
    assert e.dialogue_id == "d"


def test_history_truncation_keeps_the_most_recent_tokens_and_rebases_positions() -> None:
    e = only(build_generate([ABAB], GenerateParams(max_history=8)), 3)
    # The 15-token history loses its oldest 7: turn 1 keeps only "21 <eos>".
    assert e.input_ids.tolist() == [21, E, B, 30, 31, 32, 33, E]
    assert e.utt_index.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert e.utt_pos.tolist() == [0, 1, *range(6)]
    assert e.speaker.tolist() == [SPEAKER_SELF] * 2 + [SPEAKER_OTHER] * 6
    e = only(build_generate([ABAB], GenerateParams(max_history=7)), 3)
    assert e.input_ids.tolist() == [E, B, 30, 31, 32, 33, E]
    assert e.utt_index.tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert e.utt_pos.tolist() == [0, *range(6)]


def test_a_request_is_answered_after_its_last_turn_as_training_answers_a_turn() -> None:
    """``request_dialogue``: turns alternate back from the other party's last one, "self"
    answers; ``build_prompts``: the history of the response after the last turn is the
    one ``build_generate`` gives the same turn, and the target is ``<bos>`` alone."""
    request = request_dialogue("r", ["a b", "c", "d e f"])
    assert [t.speaker for t in request.turns] == ["other", "self", "other"]
    assert request.meta == {"response_speaker": "self"}
    assert [t.text for t in request_dialogue("r", []).turns] == [""]  # one empty turn
    three = dialogue("d", "ABA", *ABAB.utterances[:3])
    for params in (GenerateParams(max_history=100), GenerateParams(max_history=8)):
        (prompt,) = build_prompts([three], params)
        trained = only(build_generate([ABAB], params), 3)
        for column in ("input_ids", "utt_index", "utt_pos", "speaker"):
            assert getattr(prompt, column).tolist() == getattr(trained, column).tolist(), column
        assert prompt.target_ids.tolist() == [B] and prompt.turn == 3


def test_max_utterances_and_max_response() -> None:
    e = only(build_generate([ABAB], GenerateParams(max_utterances=1, max_response=3)), 3)
    assert e.input_ids.tolist() == [B, 30, 31, 32, 33, E]
    assert e.utt_index.tolist() == [0] * 6
    e = only(build_generate([ABAB], GenerateParams(max_response=4)), 2)
    assert e.target_ids.tolist() == [B, 30, 31, E]  # <bos> + 2 words + <eos>


def test_responder_empty_turns_and_single_turn_dialogues() -> None:
    system = dialogue("s", "usus", [1], [2], [3], [4], responder="s")
    assert [e.turn for e in build_generate([system], GenerateParams())] == [1, 3]
    gap = dialogue("g", "ABA", [1], [], [3])
    assert [e.turn for e in build_generate([gap], GenerateParams())] == [2]
    assert len(build_generate([dialogue("one", "A", [1, 2])], GenerateParams())) == 0


def reference_history(d: EncodedDialogue, t: int, p: GenerateParams) -> tuple[list[int], ...]:
    """A plain per-example implementation of the history contract."""
    ids, index, pos, spk = [], [], [], []
    turns = range(max(0, t - p.max_utterances), t)
    for n, u in enumerate(turns):
        tokens = [B, *d.utterances[u].tolist(), E]
        ids += tokens
        index += [n] * len(tokens)
        pos += list(range(len(tokens)))
        spk += [SPEAKER_SELF if d.speakers[u] == d.speakers[t] else SPEAKER_OTHER] * len(tokens)
    cut = max(0, len(ids) - p.max_history)
    ids, index, pos, spk = ids[cut:], index[cut:], pos[cut:], spk[cut:]
    first = index[0]
    shift = pos[0]
    index = [i - first for i in index]
    pos = [q - shift if i == 0 else q for q, i in zip(pos, index, strict=True)]
    return ids, index, pos, spk


@pytest.mark.parametrize(("max_history", "max_utterances"), [(150, 10), (23, 3), (7, 50)])
def test_generate_matches_a_plain_reference_on_real_chitchat(max_history, max_utterances) -> None:
    texts = [t for d in chitchat_dialogues(40) for t in d]
    vocab = build_vocab(texts, VocabParams(size=500))
    dialogues = [
        Dialogue(str(i), tuple(Turn("AB"[k % 2], t) for k, t in enumerate(d)))
        for i, d in enumerate(chitchat_dialogues(40))
    ]
    encoded = encode_dialogues(dialogues, vocab)
    params = GenerateParams(max_history=max_history, max_utterances=max_utterances)
    table = build_generate(encoded, params)
    assert len(table) == sum(len(d.turns) - 1 for d in dialogues)
    by_id = {d.id: d for d in encoded}
    for e in table:
        d = by_id[e.dialogue_id]
        ids, index, pos, spk = reference_history(d, e.turn, params)
        assert e.input_ids.tolist() == ids
        assert (e.utt_index.tolist(), e.utt_pos.tolist(), e.speaker.tolist()) == (index, pos, spk)
        words = d.utterances[e.turn][: params.max_response - 2].tolist()
        assert e.target_ids.tolist() == [B, *words, E]


# --------------------------------------------------------------------------- select


def six_dialogues() -> list[EncodedDialogue]:
    """Six 4-turn dialogues, every utterance distinct (dialogue i, turn t -> [100 i + t])."""
    return [dialogue(f"d{i}", "ABAB", *([100 * i + t] for t in range(4))) for i in range(6)]


def own_texts(d: EncodedDialogue) -> set[tuple[int, ...]]:
    return {(B, *u.tolist(), E) for u in d.utterances}


def test_select_negatives_come_from_other_dialogues_and_are_deterministic() -> None:
    dialogues = six_dialogues()
    params = SelectParams(n_candidates_train=5, n_candidates_eval=8)
    table = build_select(dialogues, params, GenerateParams(), "train", seed=3)
    assert len(table) == 6 * 3
    positions = set()
    by_id = {d.id: d for d in dialogues}
    for e in table:
        cands = [tuple(c.tolist()) for c in e.candidate_ids]
        assert len(cands) == 5 == len(set(cands))  # distinct texts
        assert e.labels.sum() == 1
        at = int(np.flatnonzero(e.labels)[0])
        positions.add(at)
        d = by_id[e.dialogue_id]
        assert cands[at] == (B, *d.utterances[e.turn].tolist(), E)
        for k, c in enumerate(cands):
            if k != at:
                assert c not in own_texts(d)  # from another dialogue
        generated = only(build_generate([d], GenerateParams()), e.turn)
        assert e.input_ids.tolist() == generated.input_ids.tolist()
    assert len(positions) > 2  # the truth is not always in the same place
    again = build_select(dialogues, params, GenerateParams(), "train", seed=3)
    assert all(examples_equal(a, b) for a, b in zip(table, again, strict=True))
    other_seed = build_select(dialogues, params, GenerateParams(), "train", seed=4)
    assert not all(examples_equal(a, b) for a, b in zip(table, other_seed, strict=True))
    evaluation = build_select(dialogues, params, GenerateParams(), "valid", seed=3)
    assert {len(e.candidate_ids) for e in evaluation} == {8}


def test_select_reuses_generate_histories_only_when_they_match() -> None:
    dialogues = six_dialogues()
    params = SelectParams(n_candidates_train=3)
    generated = build_generate(dialogues, GenerateParams(max_history=4))
    reused = build_select(dialogues, params, GenerateParams(max_history=4), "train", 0, generated)
    plain = build_select(dialogues, params, GenerateParams(max_history=4), "train", 0)
    assert all(examples_equal(a, b) for a, b in zip(reused, plain, strict=True))
    other = build_generate(dialogues[:3], GenerateParams())
    mismatched = build_select(dialogues, params, GenerateParams(max_history=4), "train", 0, other)
    assert all(examples_equal(a, b) for a, b in zip(mismatched, plain, strict=True))


def test_select_refuses_more_candidates_than_the_split_can_give() -> None:
    with pytest.raises(ConfigError) as err:
        build_select(six_dialogues(), SelectParams(n_candidates_eval=19), GenerateParams(),
                     "test", seed=0)  # fmt: skip
    assert err.value.key == "select.n_candidates_eval"
    with pytest.raises(ConfigError) as err:  # one dialogue: no other dialogue to draw from
        build_select(six_dialogues()[:1], SelectParams(n_candidates_train=2), GenerateParams(),
                     "train", seed=0)  # fmt: skip
    assert err.value.key == "select.n_candidates_train"


# --------------------------------------------------------------------------- lm


def test_lm_documents_chunk_sentences_and_cut_them() -> None:
    d = dialogue("doc", "AAAAAA", [1, 2, 3, 4], [5], [], [6, 7], [8], [9, 10, 11])
    table = build_lm([d], LMParams(sentences_per_document=2, max_sentence=3))
    docs = [[s.tolist() for s in e.sentences] for e in table]
    assert docs == [[[1, 2, E], [5, E]], [[6, 7, E], [8, E]], [[9, 10, E]]]
    assert [e.turn for e in table] == [0, 3, 5]  # index of each document's first sentence


# --------------------------------------------------------------------------- MultiWOZ


def woz_dialogue() -> Dialogue:
    acts = {"Hotel-Inform": [["Name", "Cambridge Lodge"], ["Area", "east"], ["Parking", "yes"]]}
    return Dialogue(
        "PMUL1",
        (
            Turn("user", "I need a hotel in the east.", {"Hotel-Inform": [["Area", "east"]]}),
            Turn("system", "Cambridge Lodge is in the East, yes.", acts,
                 {"hotel-area": "east", "hotel-book people": "2"}),
            Turn("user", "Thanks, bye.", {"general-bye": [["none", "none"]]}),
            Turn("system", "Goodbye.", {"general-bye": [["none", "none"]]}, {"hotel-area": "east"}),
        ),
        {"split": "train"},
    )  # fmt: skip


def test_act_inventory_serialisation_and_delexicalisation() -> None:
    inventory = ActInventory.from_dialogues([woz_dialogue()])
    assert inventory.names == (
        "domain:general", "domain:hotel", "act:bye", "act:inform",
        "slot:area", "slot:name", "slot:parking",
    )  # fmt: skip
    assert inventory.placeholders == ("[hotel_area]", "[hotel_name]", "[hotel_parking]")
    turn = woz_dialogue().turns[1]
    assert inventory.indices(turn.acts).tolist() == [1, 3, 4, 5, 6]
    # Parts unseen in training (domain taxi, slot car) are dropped; "inform" is known.
    unseen = {"Taxi-Inform": [["Car", "red"]], "Hotel-Bye": []}
    assert inventory.indices(unseen).tolist() == [1, 2, 3]
    assert serialize_belief(turn.belief) == "hotel area east ; hotel book people 2"
    assert serialize_acts(turn.acts) == (
        "hotel inform name Cambridge Lodge ; hotel inform area east ; hotel inform parking yes"
    )
    assert serialize_acts({"general-bye": [["none", "none"]]}) == "general bye"
    # Values match whole words in any case; "yes" is too generic to replace.
    assert delexicalize(turn.text, turn.acts) == "[hotel_name] is in the [hotel_area], yes."
    assert delexicalize("eastern lodge", turn.acts) == "eastern lodge"


def test_multiwoz_generate_examples_carry_acts_belief_and_placeholders() -> None:
    dialogues = [woz_dialogue()]
    inventory = ActInventory.from_dialogues(dialogues)
    options = EncodeOptions("system", inventory, delexicalize=True)
    vocab = build_vocab(vocab_texts(dialogues, options), VocabParams(size=100),
                        reserved=inventory.placeholders)  # fmt: skip
    encoded = encode_dialogues(dialogues, vocab, options)
    table = build_generate(encoded, GenerateParams())
    assert [e.turn for e in table] == [1, 3]  # system turns only
    e = table[0]
    assert vocab.decode(e.target_ids) == "[hotel_name] is in the [hotel_area] , yes ."
    assert e.acts.tolist() == [1, 3, 4, 5, 6]
    assert vocab.decode(e.belief_ids) == "hotel area east ; hotel book people 2"
    assert vocab.decode(e.act_ids).startswith("hotel inform name cambridge lodge ;")
    assert e.belief_ids[0] == B and e.belief_ids[-1] == E
    # The user turn in the history is not delexicalised.
    assert vocab.decode(e.input_ids) == "i need a hotel in the east ."


def test_real_multiwoz_dialogues(shared_data) -> None:
    root = shared_data / "multiwoz" / "convlab1"
    dialogues = list(itertools.islice(read_corpus("multiwoz", root, "valid"), 25))
    inventory = ActInventory.from_dialogues(dialogues)
    assert {"domain:hotel", "act:inform", "slot:area"} <= set(inventory.names)
    options = EncodeOptions("system", inventory, delexicalize=True)
    vocab = build_vocab(vocab_texts(dialogues, options), VocabParams(size=1500),
                        reserved=inventory.placeholders)  # fmt: skip
    table = build_generate(encode_dialogues(dialogues, vocab, options), GenerateParams())
    assert len(table) == sum(len(d.turns) // 2 for d in dialogues)
    assert all(e.turn % 2 == 1 for e in table)
    text = " ".join(vocab.decode(e.target_ids) for e in table)
    assert "[restaurant_name]" in text or "[hotel_name]" in text or "[train_id]" in text
    assert sum(len(e.acts) for e in table) > 0


# --------------------------------------------------------------------------- DSTC7


def advising_dialogue(correct: list[str]) -> Dialogue:
    profile = {"Courses": {"Prior": [{"offering": "EECS280-000"}], "Suggested": ["EECS281"]}}
    candidates = [{"id": f"C{i}", "text": f"reply {i}"} for i in range(8)]
    candidates[2]["text"] = "take eecs281 or EECS 280"
    return Dialogue(
        "adv:1",
        (Turn("student", "I took EECS 280."), Turn("advisor", "Good."),
         Turn("student", "What next?")),
        {"candidates": candidates, "correct_ids": correct, "profile": profile},
    )  # fmt: skip


def test_profile_courses_and_knowledge_flags() -> None:
    prior, suggested = profile_courses(advising_dialogue([]).meta["profile"])
    assert (prior, suggested) == ({"eecs280"}, {"eecs281"})
    flags = knowledge_flags(["take", "eecs281", "or", "eecs", "280"], prior, suggested)
    assert flags.tolist() == [0, KNOWLEDGE_SUGGESTED, 0, KNOWLEDGE_PRIOR, KNOWLEDGE_PRIOR]


def test_dstc7_keeps_its_own_candidates_labels_and_knowledge() -> None:
    dialogues = [advising_dialogue(["C2"])]
    vocab = build_vocab(vocab_texts(dialogues), VocabParams(size=64))
    encoded = encode_dialogues(dialogues, vocab)
    params = SelectParams(n_candidates_train=3, n_candidates_eval=2)
    (valid,) = build_select(encoded, params, GenerateParams(), "valid", seed=0)
    assert len(valid.candidate_ids) == 8  # its own candidates, all of them off train
    assert valid.labels.tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert valid.turn == 3
    # The advisor answers: the student's turns are OTHER.
    assert valid.speaker.tolist()[0] == SPEAKER_OTHER
    assert SPEAKER_SELF in valid.speaker.tolist()
    flags = valid.candidate_knowledge[2].tolist()
    assert flags == [0, 0, KNOWLEDGE_SUGGESTED, 0, KNOWLEDGE_PRIOR, KNOWLEDGE_PRIOR, 0]
    context = valid.context_knowledge.tolist()
    assert context[:6] == [0, 0, 0, KNOWLEDGE_PRIOR, KNOWLEDGE_PRIOR, 0]  # <bos> i took eecs 280
    (train,) = build_select(encoded, params, GenerateParams(), "train", seed=0)
    assert len(train.candidate_ids) == 3 and train.labels.sum() == 1
    kept = [c.tolist() for c in train.candidate_ids]
    assert valid.candidate_ids[2].tolist() in kept
    (none,) = build_select(encode_dialogues([advising_dialogue([])], vocab), params,
                           GenerateParams(), "valid", seed=0)  # fmt: skip
    assert none.labels.sum() == 0  # subtask 4: the answer may be none of them


def test_example_table_round_trips_records_and_slices() -> None:
    table = build_select(six_dialogues(), SelectParams(n_candidates_train=3), GenerateParams(),
                         "train", seed=1)  # fmt: skip
    rebuilt = ExampleTable.from_examples(list(table))
    assert len(rebuilt) == len(table)
    assert all(examples_equal(a, b) for a, b in zip(table, rebuilt, strict=True))
    part = table[4:9]
    assert (
        len(part) == 5 and examples_equal(part[0], table[4]) and examples_equal(part[-1], table[8])
    )
    with pytest.raises(IndexError):
        table[len(table)]
