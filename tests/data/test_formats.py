"""Corpus parsers on the real corpora (PTB, PersonaChat, MultiWOZ, chitchat) and on spec-built
fixtures (Cornell, DSTC7); malformed input names file and line; skip mode counts."""

from __future__ import annotations

import json
import shutil
import zipfile
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

from pipeline.config import SplitParams
from pipeline.data.corpora import read_corpus
from pipeline.data.dialogue import Dialogue
from pipeline.data.formats import ParseStats
from pipeline.errors import ConfigError, DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CORNELL = FIXTURES / "cornell"
DSTC7 = FIXTURES / "dstc7"


def _read(
    name: str, root: Path | str | None, split: str | None = None, **kw: object
) -> tuple[list[Dialogue], ParseStats]:
    stats = ParseStats()
    return list(read_corpus(name, root, split, stats=stats, **kw)), stats


# --------------------------------------------------------------------------- PTB


@pytest.mark.parametrize(
    ("split", "sentences"), [("train", 42_068), ("valid", 3_370), ("test", 3_761)]
)
def test_ptb_sentence_counts(shared_data: Path, split: str, sentences: int) -> None:
    docs, stats = _read("ptb", shared_data / "ptb", split)
    assert stats.turns == sum(len(d.turns) for d in docs) == sentences
    assert len(docs) == -(-sentences // 10)
    assert all(len(d.turns) == 10 for d in docs[:-1]) and 1 <= len(docs[-1].turns) <= 10
    assert {d.meta["split"] for d in docs} == {split}
    first = docs[0].turns[0]
    assert first.speaker == "narrator" and first.text == first.text.strip() and first.text


def test_ptb_document_size_and_ids(shared_data: Path) -> None:
    docs, _ = _read("ptb", shared_data / "ptb", "valid", sentences_per_document=7)
    assert len(docs) == -(-3_370 // 7)
    assert docs[1].id == "ptb.valid.1"
    lines = (shared_data / "ptb" / "ptb.valid.txt").read_text().splitlines()
    assert [t.text for t in docs[1].turns] == [line.strip() for line in lines[7:14]]


# --------------------------------------------------------------------------- PersonaChat


def test_personachat_validation_counts(shared_data: Path) -> None:
    dialogues, stats = _read("personachat", shared_data / "personachat", "valid")
    assert len(dialogues) == 1_000
    exchanges = sum(1 for d in dialogues for t in d.turns if t.speaker == "self")
    assert exchanges == 7_801
    assert stats.turns == 2 * 7_801  # no __SILENCE__ in this file: two turns per exchange
    first = dialogues[0]
    assert first.meta["split"] == "valid"
    assert first.meta["persona"][0] == "i read twenty books a year."
    assert [t.speaker for t in first.turns[:4]] == ["partner", "self", "partner", "self"]
    assert first.turns[0].text == "hello what are doing today ?"
    assert "candidates" not in first.meta
    assert all(3 <= len(d.meta["persona"]) <= 5 for d in dialogues)


PERSONA_WITH_CANDIDATES = (
    "1 your persona: i like tea.\n"
    "2 partner's persona: i own a boat.\n"
    "3 __SILENCE__\thi there !\t\tbye .|hi there !|what ?\n"
    "4 hello , do you like tea ?\tyes , green tea .\t\tno .|yes , green tea .\n"
    "1 your persona: i run.\n"
    "2 how are you ?\tfine .\t\tfine .|bad .\n"
)


def test_personachat_candidates_both_personas_and_silence(tmp_path: Path) -> None:
    (tmp_path / "train_both_original.txt").write_text(PERSONA_WITH_CANDIDATES)
    (tmp_path / "train_both_original_no_cands.txt").write_text("1 your persona: ignored.\n")
    dialogues, _ = _read("personachat", tmp_path, "train", variant="both_original")
    assert [d.id for d in dialogues] == ["train_both_original:0", "train_both_original:1"]
    first = dialogues[0]
    assert first.meta["persona"] == ["i like tea."] and first.meta["partner_persona"] == [
        "i own a boat."
    ]
    assert [(t.speaker, t.text) for t in first.turns] == [
        ("self", "hi there !"),
        ("partner", "hello , do you like tea ?"),
        ("self", "yes , green tea ."),
    ]
    assert first.meta["candidates"] == [
        ["bye .", "hi there !", "what ?"],
        ["no .", "yes , green tea ."],
    ]


def test_personachat_malformed_line(tmp_path: Path) -> None:
    bad = tmp_path / "valid_self_original.txt"
    bad.write_text(
        "1 your persona: i like tea.\n2 hello\tyes\nthree\tno number\n3 no tab here\n4 ok\tfine\n"
    )
    with pytest.raises(DataError) as err:
        list(read_corpus("personachat", tmp_path, "valid"))
    assert err.value.path == str(bad) and err.value.line == 3
    assert f"{bad}:3" in str(err.value)
    dialogues, stats = _read("personachat", tmp_path, "valid", on_error="skip")
    assert stats.skipped == {str(bad): 2}
    assert stats.skip_messages()[0].startswith(f"skipped 2 malformed records in {bad}")
    assert [t.text for t in dialogues[0].turns] == ["hello", "yes", "ok", "fine"]


# --------------------------------------------------------------------------- MultiWOZ


@cache
def _multiwoz(root: Path) -> tuple[list[Dialogue], ParseStats]:
    return _read("multiwoz", root, "test")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["convlab1", "convlab2"])
def test_multiwoz_test_counts_acts_and_belief(shared_data: Path, variant: str) -> None:
    dialogues, stats = _multiwoz(shared_data / "multiwoz" / variant)
    assert len(dialogues) == 1_000
    assert stats.turns == sum(len(d.turns) for d in dialogues) == 14_744
    assert len({d.id for d in dialogues}) == 1_000
    for d in dialogues:
        assert d.meta["split"] == "test" and isinstance(d.meta["goal"], dict)
        assert [t.speaker for t in d.turns] == ["user", "system"] * (len(d.turns) // 2)
        for turn in d.turns:
            assert (turn.belief is not None) == (turn.speaker == "system")
            assert turn.acts is not None
    turns = [t for d in dialogues for t in d.turns]
    with_acts = sum(1 for t in turns if t.acts)
    assert with_acts > 0.9 * len(turns)
    beliefs = [t.belief for t in turns if t.belief]
    assert len(beliefs) > 0.9 * len(turns) / 2
    values = {v for b in beliefs for v in b.values()}
    assert "" not in values and "not mentioned" not in values
    keys = {k for b in beliefs for k in b}
    assert {"hotel-area", "hotel-book people", "restaurant-food", "train-destination"} <= keys
    first = next(d for d in dialogues if d.id == "SNG0073")
    # ConvLab-2 (2.1) normalised some values ("fen ditton" -> "fenditton").
    place, college = SNG0073_VALUES[variant]
    assert first.turns[0].acts == {"Taxi-Inform": [["Dest", place], ["Depart", college]]}
    assert first.turns[0].belief is None
    assert first.turns[1].acts == {"Taxi-Request": [["Leave", "?"], ["Arrive", "?"]]}
    assert first.turns[1].belief == {
        "taxi-destination": place,
        "taxi-departure": college.replace(" 's", "'s"),
    }


SNG0073_VALUES = {
    "convlab1": ("pizza hut fen ditton", "saint john 's college"),
    "convlab2": ("pizza hut fenditton", "saint johns college"),
}


def test_multiwoz_official_layout(shared_data: Path, tmp_path: Path) -> None:
    # Rebuild the official release layout (data.json without inline acts + dialogue_acts.json
    # + list files) from real ConvLab dialogues and check both layouts read the same.
    with zipfile.ZipFile(shared_data / "multiwoz" / "convlab1" / "val.json.zip") as zf:
        convlab = json.loads(zf.read("val.json"))
    ids = list(convlab)[:6]
    data, acts = {}, {}
    for did in ids:
        log = [{k: v for k, v in turn.items() if k != "dialog_act"} for turn in convlab[did]["log"]]
        data[f"{did}.json"] = {"goal": convlab[did]["goal"], "log": log}
        system = convlab[did]["log"][1::2]
        acts[did] = {str(i + 1): (t["dialog_act"] or "No Annotation") for i, t in enumerate(system)}
    folder = tmp_path / "MULTIWOZ2 2"
    folder.mkdir()
    (folder / "data.json").write_text(json.dumps(data))
    (folder / "dialogue_acts.json").write_text(json.dumps(acts))
    (folder / "valListFile.json").write_text(f"{ids[0]}.json\n{ids[1]}.json\n")
    (folder / "testListFile.json").write_text(f"{ids[2]}.json\n")

    convlab_dir = tmp_path / "convlab"
    convlab_dir.mkdir()
    (convlab_dir / "val.json").write_text(json.dumps({did: convlab[did] for did in ids}))
    reference = {d.id: d for d in _read("multiwoz", convlab_dir, "valid")[0]}

    dialogues, _ = _read("multiwoz", tmp_path / "MULTIWOZ2 2")
    by_split = Counter(d.meta["split"] for d in dialogues)
    assert by_split == {"train": 3, "valid": 2, "test": 1}
    assert [d.id for d in read_corpus("multiwoz", folder, "test")] == [ids[2]]
    for d in dialogues:
        ref = reference[d.id]
        assert [t.text for t in d.turns] == [t.text for t in ref.turns]
        assert [t.belief for t in d.turns] == [t.belief for t in ref.turns]
        assert [t.acts for t in d.turns[1::2]] == [t.acts for t in ref.turns[1::2]]
        assert all(t.acts is None for t in d.turns[0::2])  # 2.0 has no user acts


def test_multiwoz_ambiguous_or_missing_root(shared_data: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="several MultiWOZ"):
        list(read_corpus("multiwoz", shared_data / "multiwoz", "test"))
    with pytest.raises(DataError, match="no MultiWOZ files here"):
        list(read_corpus("multiwoz", tmp_path, "test"))


def test_multiwoz_malformed_dialogue_is_named(tmp_path: Path) -> None:
    good = {
        "log": [
            {"text": "hi", "metadata": {}},
            {"text": "hello", "metadata": {"hotel": {"semi": {"area": "east"}}}},
        ]
    }
    (tmp_path / "test.json").write_text(json.dumps({"A1": good, "B2": {"goal": {}}, "C3": good}))
    with pytest.raises(DataError, match="dialogue 'B2'"):
        list(read_corpus("multiwoz", tmp_path, "test"))
    dialogues, stats = _read("multiwoz", tmp_path, "test", on_error="skip")
    assert [d.id for d in dialogues] == ["A1", "C3"]
    assert dialogues[0].turns[1].belief == {"hotel-area": "east"}
    assert stats.skipped_total == 1


# --------------------------------------------------------------------------- chitchat


@pytest.mark.slow
def test_chitchat_counts_and_seeded_split() -> None:
    dialogues, stats = _read("chitchat", None)
    assert len(dialogues) == 7_168
    assert stats.empty_texts == 33
    assert stats.single_turn == sum(1 for d in dialogues if len(d.turns) == 1) >= 3_150
    for d in dialogues:
        assert all(t.text for t in d.turns)
        assert all(a.speaker != b.speaker for a, b in zip(d.turns, d.turns[1:], strict=False))
    sizes = Counter(d.meta["split"] for d in dialogues)
    assert sizes == {"train": 7_168 - 2 * 717, "valid": 717, "test": 717}

    valid = list(read_corpus("chitchat", split="valid"))
    assert {d.id for d in valid} == {d.id for d in dialogues if d.meta["split"] == "valid"}


def test_chitchat_turns_join_messages_of_one_sender(tmp_path: Path) -> None:
    msg = lambda text, sender: {"text": text, "sender": sender, "timestamp": "t"}  # noqa: E731
    data = {
        "c1": {
            "messages": [
                [msg("Hi", "a"), msg("", "a"), msg("there", "a")],
                [msg("yo", "b")],
                [msg(" ", "a")],
                [msg("ok", "b")],
            ],
            "start": "s",
        },
        "c2": {"messages": [[msg("alone", "a")]], "prompt": "p"},
    }
    (tmp_path / "dataset.json").write_text(json.dumps(data))
    dialogues, stats = _read("chitchat", tmp_path)
    turns = {d.id: [(t.speaker, t.text) for t in d.turns] for d in dialogues}
    assert turns == {"c1": [("a", "Hi there"), ("b", "yo ok")], "c2": [("a", "alone")]}
    assert stats.empty_texts == 2 and stats.single_turn == 1


def test_chitchat_split_params_reach_the_split(tmp_path: Path) -> None:
    data = {f"c{i}": {"messages": [[{"text": f"m{i}", "sender": "a"}]]} for i in range(40)}
    (tmp_path / "dataset.json").write_text(json.dumps(data))

    def valid_ids(params: SplitParams) -> set[str]:
        return {d.id for d in read_corpus("chitchat", tmp_path, "valid", split_params=params)}

    assert len(valid_ids(SplitParams(seed=1, valid=0.25))) == 10
    assert valid_ids(SplitParams(seed=1)) != valid_ids(SplitParams(seed=2))


def test_chitchat_malformed(tmp_path: Path) -> None:
    path = tmp_path / "dataset.json"
    path.write_text(
        '{"c1": {"messages": [[{"text": "hi", "sender": "a"}]]},\n "c2": {"messages": 5}}'
    )
    with pytest.raises(DataError, match="conversation 'c2'") as err:
        list(read_corpus("chitchat", tmp_path))
    assert err.value.path == str(path)
    _, stats = _read("chitchat", tmp_path, on_error="skip")
    assert stats.skipped == {str(path): 1} and stats.dialogues == 1
    path.write_text('{"c1": {"messages": []},\n "c2": oops}')
    with pytest.raises(DataError) as err:
        list(read_corpus("chitchat", tmp_path))
    assert err.value.line == 2 and "invalid JSON" in str(err.value)


# --------------------------------------------------------------------------- Cornell


def test_cornell_fixture() -> None:
    dialogues, stats = _read("cornell", CORNELL)
    assert len(dialogues) == 17
    by_id = {d.id: d for d in dialogues}
    # Empty lines dropped, consecutive lines of one character joined, \r inside kept.
    assert [(t.speaker, t.text) for t in by_id["m0-L20"].turns] == [
        ("u0", "Is anyone there?"),
        ("u1", "Just me."),
        ("u0", "Good.\rVery good."),
    ]
    assert [t.text for t in by_id["m0-L30"].turns] == [
        "We should go.",
        "Now?",
        "Right now. Before they come back.",
        "Okay.",
    ]
    # Lines stored out of order come back in conversation order; ISO-8859-1 decoded.
    assert [t.text for t in by_id["m1-L107"].turns] == [
        "Where do we meet?",
        "The café opens at six.",
        "Then we leave at dawn.",
    ]
    assert by_id["m1-L104"].turns[1].text == "Señor Ruiz says no."
    assert by_id["m1-L100"].turns[3].text == "I don\x92t think he will talk."
    assert by_id["m1-L100"].meta["characters"] == {"u4": "NORA", "u5": "HUGO"}
    assert by_id["m1-L100"].meta["movie"] == "m1"
    assert stats.empty_texts == 2
    sizes = Counter(d.meta["split"] for d in dialogues)
    assert sizes == {"train": 13, "valid": 2, "test": 2}
    test_ids = [d.id for d in read_corpus("cornell", CORNELL, "test")]
    assert test_ids == [d.id for d in dialogues if d.meta["split"] == "test"]


def _cornell_copy(tmp_path: Path) -> Path:
    root = tmp_path / "cornell"
    shutil.copytree(CORNELL, root)
    return root / "cornell movie-dialogs corpus"


def test_cornell_bad_line_names_file_and_line(tmp_path: Path) -> None:
    folder = _cornell_copy(tmp_path)
    lines = folder / "movie_lines.txt"
    content = lines.read_bytes().split(b"\n")
    content.insert(2, b"L999 +++$+++ only three +++$+++ fields")
    lines.write_bytes(b"\n".join(content))
    with pytest.raises(DataError) as err:
        list(read_corpus("cornell", tmp_path))
    assert err.value.path == str(lines) and err.value.line == 3
    dialogues, stats = _read("cornell", tmp_path, on_error="skip")
    assert len(dialogues) == 17 and stats.skipped == {str(lines): 1}


@pytest.mark.parametrize(
    "ids_field",
    ["['L40', 'L41'", "__import__('os').system('touch PWNED')", "[]", "['L998', 'L999']"],
)
def test_cornell_bad_conversation(
    tmp_path: Path, ids_field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    folder = _cornell_copy(tmp_path)
    convs = folder / "movie_conversations.txt"
    with convs.open("ab") as f:
        f.write(f"u0 +++$+++ u1 +++$+++ m0 +++$+++ {ids_field}\n".encode())
    with pytest.raises(DataError) as err:
        list(read_corpus("cornell", tmp_path))
    assert err.value.path == str(convs) and err.value.line == 18
    assert not (tmp_path / "PWNED").exists()  # parsed as a literal, never evaluated
    _, stats = _read("cornell", tmp_path, on_error="skip")
    assert stats.skipped_total == 1


# --------------------------------------------------------------------------- DSTC7


def test_dstc7_subtasks_and_files() -> None:
    dialogues, stats = _read("dstc7", DSTC7)
    by_id = {d.id: d for d in dialogues}
    assert set(by_id) == {
        "advising.scenario-1.train:601",
        "ubuntu_dev_subtask_3:301",
        "ubuntu_dev_subtask_4:401",
        "ubuntu_dev_subtask_4:402",
        "ubuntu_dev_subtask_4:403",
        "ubuntu_test_subtask_1:501",
        "ubuntu_train_subtask_1:101",
        "ubuntu_train_subtask_1:102",
    }  # the _augmented variant is not read by default
    s1 = by_id["ubuntu_train_subtask_1:101"].meta
    assert (s1["subtask"], s1["split"], len(s1["candidates"])) == (1, "train", 100)
    assert s1["correct_ids"] == ["A37"] and s1["responses"] == ["try sudo apt-get install -f"]
    assert s1["candidates"][37] == {"id": "A37", "text": "try sudo apt-get install -f"}
    assert len(by_id["ubuntu_train_subtask_1:101"].turns) == 3  # the blank message is dropped
    assert stats.empty_texts == 1
    assert by_id["ubuntu_dev_subtask_3:301"].meta["correct_ids"] == ["D2", "D4", "D7"]
    assert by_id["ubuntu_dev_subtask_3:301"].meta["split"] == "valid"
    assert by_id["ubuntu_dev_subtask_4:401"].meta["correct_ids"] == ["E3"]
    assert by_id["ubuntu_dev_subtask_4:402"].meta["correct_ids"] == []  # answer not offered
    assert by_id["ubuntu_dev_subtask_4:402"].meta["responses"] == [
        "boot an older kernel from the menu"
    ]
    assert by_id["ubuntu_dev_subtask_4:403"].meta["correct_ids"] == []  # spelled NONE
    assert by_id["ubuntu_test_subtask_1:501"].meta["correct_ids"] == ["H6"]  # from the .tsv
    advising = by_id["advising.scenario-1.train:601"]
    assert advising.meta["profile"]["Courses"]["Prior"][0]["offering"] == "EECS280-000"
    assert [t.speaker for t in advising.turns] == ["student", "advisor", "student"]
    assert "profile" not in s1


def test_dstc7_filters() -> None:
    train = [d.id for d in read_corpus("dstc7", DSTC7, "train", dataset="ubuntu", subtask=1)]
    assert train == ["ubuntu_train_subtask_1:101", "ubuntu_train_subtask_1:102"]
    augmented = [d.id for d in read_corpus("dstc7", DSTC7, "train", variant="augmented")]
    assert augmented == ["ubuntu_train_subtask_1_augmented:201"]
    assert {d.meta["dataset"] for d in read_corpus("dstc7", DSTC7, dataset="advising")} == {
        "advising"
    }
    with pytest.raises(DataError, match="no DSTC7 file"):
        read_corpus("dstc7", DSTC7, "test", subtask=4).__next__()


def test_dstc7_malformed_examples(tmp_path: Path) -> None:
    examples = json.loads((DSTC7 / "ubuntu_dev_subtask_3.json").read_text())
    broken = dict(examples[0], **{"example-id": 302})
    del broken["messages-so-far"]
    wrong = dict(
        examples[0],
        **{
            "example-id": 303,
            "options-for-correct-answers": [{"candidate-id": "Z1", "utterance": "?"}],
        },
    )
    path = tmp_path / "ubuntu_dev_subtask_3.json"
    path.write_text(json.dumps([examples[0], broken, wrong]))
    with pytest.raises(DataError, match=r"example 1 \(id 302\)") as err:
        list(read_corpus("dstc7", tmp_path))
    assert err.value.path == str(path)
    dialogues, stats = _read("dstc7", tmp_path, on_error="skip")
    assert [d.id for d in dialogues] == ["ubuntu_dev_subtask_3:301"]
    assert stats.skipped == {str(path): 2}
    path.write_text(json.dumps([wrong]))  # subtask 3's answers must be among the options
    with pytest.raises(DataError, match=r"\['Z1'\] not among the candidates"):
        list(read_corpus("dstc7", tmp_path))


# --------------------------------------------------------------------------- read_corpus


def test_read_corpus_argument_errors(tmp_path: Path) -> None:
    # a name that is not built in is a declared corpus, read from its download folder
    with pytest.raises(DataError, match="ubuntu is no built-in corpus"):
        read_corpus("ubuntu")
    with pytest.raises(DataError, match=r"SOURCES\.json: missing: run the download stage"):
        read_corpus("ubuntu", tmp_path)
    with pytest.raises(ConfigError, match="unknown split"):
        read_corpus("ptb", tmp_path, "training")
    with pytest.raises(ConfigError, match="on_error"):
        read_corpus("ptb", tmp_path, on_error="ignore")
    with pytest.raises(ConfigError, match=r"read_corpus\.variant"):
        read_corpus("ptb", tmp_path, variant="x")
    with pytest.raises(DataError, match="needs root"):
        read_corpus("ptb")
    with pytest.raises(DataError, match=r"stages\.download cornell"):
        read_corpus("cornell", tmp_path / "missing")
    # split_params is for seeded splits only; official-split corpora ignore it.
    assert read_corpus("ptb", tmp_path, split_params=SplitParams()) is not None
