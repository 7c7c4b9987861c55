"""Arrow shards: exact round trips, byte determinism, stale files, damaged files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.artifacts import MANIFEST_FILE, TokenizeRecord
from pipeline.config import GenerateParams, LMParams, SelectParams, VocabParams
from pipeline.data import shards
from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.encoding import EncodedDialogue, encode_dialogues, vocab_texts
from pipeline.data.examples import build_lm, build_select
from pipeline.data.records import (
    ExampleTable,
    GenerateExample,
    LMExample,
    SelectExample,
)
from pipeline.data.shards import (
    ShardTable,
    read_manifest,
    write_manifest,
    write_shards,
)
from pipeline.data.vocab import build_vocab
from pipeline.errors import DataError
from pipeline.names import Task
from tests.data.equality import examples_equal


def arr(*values: int, dtype: type = np.int32) -> np.ndarray:
    return np.array(values, dtype=dtype)


def generate_records(n: int = 7) -> list[GenerateExample]:
    """Hand-made records of varied lengths, with MultiWOZ extras."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 9))
        out.append(
            GenerateExample(
                f"dlg-{i}", i % 3,
                rng.integers(5, 50, length).astype(np.int32), np.zeros(length, np.int32),
                np.arange(length, dtype=np.int32), np.full(length, 1 + i % 2, np.int32),
                rng.integers(5, 50, 1 + i % 4).astype(np.int32),
                acts=arr(*range(i % 3)), belief_ids=arr(2, 7, 3), act_ids=arr(2, *range(i), 3),
            )
        )  # fmt: skip
    return out


def select_table(split: str = "train") -> ExampleTable:
    dialogues = [
        EncodedDialogue(f"d{i}", ("A", "B", "A"), tuple(arr(10 * i + t, 7) for t in range(3)))
        for i in range(5)
    ]
    params = SelectParams(n_candidates_train=4, n_candidates_eval=6)
    return build_select(dialogues, params, GenerateParams(), split, seed=0)


def advising_table() -> ExampleTable:
    profile = {"Courses": {"Prior": ["EECS280"], "Suggested": ["EECS281"]}}
    dialogues = [
        Dialogue(
            f"adv:{i}",
            (Turn("student", f"I took EECS 280 and {i}"), Turn("advisor", "ok")),
            {"candidates": [{"id": f"c{j}", "text": f"try eecs 281 {j}"} for j in range(3 + i)],
             "correct_ids": [f"c{i}"], "profile": profile},
        )
        for i in range(3)
    ]  # fmt: skip
    vocab = build_vocab(vocab_texts(dialogues), VocabParams(size=64))
    encoded = encode_dialogues(dialogues, vocab)
    return build_select(encoded, SelectParams(), GenerateParams(), "valid", seed=0)


def lm_table() -> ExampleTable:
    d = EncodedDialogue("doc", ("x",) * 7, tuple(arr(*range(5, 5 + k)) for k in range(7)))
    return build_lm([d], LMParams(sentences_per_document=3))


def write(root: Path, task: Task, tables: dict[str, ExampleTable | list], rows: int = 3) -> None:
    shards, pools = {}, {}
    for split, table in tables.items():
        files = write_shards(root, task, split, table, rows)
        shards[split] = files.shards
        if files.pool is not None:
            pools[split] = files.pool
    record = TokenizeRecord(
        corpus="test",
        vocab_hash="hash",
        vocab_size=50,
        vocab_words=47,
        shards={task.value: shards},
        target_tokens={task.value: {}},
        pools=pools,
    )
    write_manifest(root, record)


CASES = {
    "generate": (Task.GENERATE, lambda: generate_records()),
    "select": (Task.SELECT, lambda: select_table()),
    "select-knowledge": (Task.SELECT, lambda: advising_table()),
    "lm": (Task.LM, lambda: lm_table()),
}


@pytest.mark.parametrize("case", CASES)
def test_shards_round_trip_exactly(tmp_path: Path, case: str) -> None:
    task, make = CASES[case]
    examples = list(make())
    write(tmp_path, task, {"train": examples}, rows=2)
    table = ShardTable(tmp_path, task, "train")
    assert len(table) == len(examples)
    assert len(read_manifest(tmp_path).shards[task.value]["train"]) == -(-len(examples) // 2)
    for i, (written, read) in enumerate(zip(examples, table, strict=True)):
        assert examples_equal(written, read), i
        assert examples_equal(table[i], written)
    assert examples_equal(table[-1], examples[-1])
    with pytest.raises(IndexError):
        table[len(examples)]


def test_optional_fields_stay_absent(tmp_path: Path) -> None:
    plain = [GenerateExample("a", 1, arr(2, 3), arr(0, 0), arr(0, 1), arr(1, 1), arr(2, 5, 3))]
    write(tmp_path, Task.GENERATE, {"valid": plain})
    (row,) = ShardTable(tmp_path, Task.GENERATE, "valid")
    assert row.acts is None and row.belief_ids is None
    assert "acts" not in ShardTable(tmp_path, Task.GENERATE, "valid").columns


def test_select_shards_store_candidates_once(tmp_path: Path) -> None:
    table = select_table("valid")
    write(tmp_path, Task.SELECT, {"valid": table}, rows=100)
    pool = read_manifest(tmp_path).pools["valid"]
    assert pool.rows == len(table)  # one pool row per response, not one per candidate
    columns = ShardTable(tmp_path, Task.SELECT, "valid").columns
    assert "candidate_ids" in columns and "candidate_refs" not in columns


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_same_examples_give_the_same_bytes(tmp_path: Path) -> None:
    for name in ("a", "b"):
        for case, (task, make) in CASES.items():
            write_shards(tmp_path / name, task, case, make(), 2)
    first, second = files_of(tmp_path / "a"), files_of(tmp_path / "b")
    assert first == second
    assert sum(name.endswith("pool.arrow") for name in first) == 2 and len(first) > 10


def test_rewriting_a_split_removes_its_stale_shards(tmp_path: Path) -> None:
    files = write_shards(tmp_path, Task.GENERATE, "train", generate_records(7), 2)
    assert len(files.shards) == 4
    write_shards(tmp_path, Task.GENERATE, "valid", generate_records(2), 2)
    files = write_shards(tmp_path, Task.GENERATE, "train", generate_records(3), 2)
    names = sorted(p.name for p in (tmp_path / "generate").iterdir())
    assert names == ["train-00000.arrow", "train-00001.arrow", "valid-00000.arrow"]
    assert [f.rows for f in files.shards] == [2, 1]


@pytest.fixture
def written(tmp_path: Path) -> Path:
    write(tmp_path, Task.GENERATE, {"train": generate_records()})
    return tmp_path


def test_truncated_shard_names_the_file(written: Path) -> None:
    shard = written / "generate" / "train-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:-40])
    table = ShardTable(written, Task.GENERATE, "train")
    with pytest.raises(DataError) as err:
        table[0]
    assert str(shard) in str(err.value) and "truncated" in str(err.value)


def test_garbled_shard_names_the_file(written: Path) -> None:
    shard = written / "generate" / "train-00000.arrow"
    shard.write_bytes(bytes(len(shard.read_bytes())))  # same size, all zeros
    with pytest.raises(DataError) as err:
        ShardTable(written, Task.GENERATE, "train")[0]
    assert str(shard) in str(err.value)


def test_missing_shard_manifest_and_split(written: Path) -> None:
    with pytest.raises(DataError, match="no generate examples for split 'test'"):
        ShardTable(written, Task.GENERATE, "test")
    with pytest.raises(DataError, match="no lm examples"):
        ShardTable(written, Task.LM, "train")
    (written / "generate" / "train-00002.arrow").unlink()
    with pytest.raises(DataError, match=r"train-00002\.arrow: shard missing"):
        ShardTable(written, Task.GENERATE, "train")[0]
    (written / MANIFEST_FILE).unlink()
    with pytest.raises(DataError, match="no manifest"):
        ShardTable(written, Task.GENERATE, "train")


def test_a_changed_byte_is_caught_by_the_hash_before_arrow_reads_it(written: Path) -> None:
    ShardTable(written, Task.GENERATE, "train")[0]  # verified once, then cached
    shard = written / "generate" / "train-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        ShardTable(written, Task.GENERATE, "train")[0]
    assert str(err.value).startswith(f"{shard}: sha256 differs from the manifest")


def test_changed_values_that_arrow_accepts_are_caught_naming_file_and_stage(
    written: Path,
) -> None:
    """Same size, valid Arrow (one dialogue id's text changed): only the hash sees it."""
    shard = written / "generate" / "train-00000.arrow"
    data = shard.read_bytes()
    assert data.count(b"dlg-1") == 1
    shard.write_bytes(data.replace(b"dlg-1", b"dlg-9"))
    with pytest.raises(DataError) as err:
        ShardTable(written, Task.GENERATE, "train")[0]
    message = str(err.value)
    assert message.startswith(f"{shard}: sha256 differs from the manifest")
    assert f"dvc repro -f tokenize@test (or delete {written} and run dvc repro)" in message


def test_each_shard_is_hashed_once_per_process_while_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, Task.SELECT, {"train": select_table()})
    hashed: list[str] = []
    real = shards._sha256
    monkeypatch.setattr(shards, "_sha256", lambda path: hashed.append(path.name) or real(path))
    assert len(ShardTable(tmp_path, Task.SELECT, "train")) > 0
    list(ShardTable(tmp_path, Task.SELECT, "train"))
    files = sorted(p.name for p in (tmp_path / "select").iterdir())
    assert sorted(hashed) == files and "train-pool.arrow" in files  # rows and pool, once
    list(ShardTable(tmp_path, Task.SELECT, "train"))
    assert sorted(hashed) == files  # already verified in this process
    # rewritten (other rows per shard: other bytes and hashes): hashed again
    write(tmp_path, Task.SELECT, {"train": select_table()}, rows=2)
    hashed.clear()
    list(ShardTable(tmp_path, Task.SELECT, "train"))
    rows = {p.name for p in (tmp_path / "select").iterdir()} - {"train-pool.arrow"}
    assert set(hashed) >= rows and len(rows) > 2


def test_manifest_round_trip_and_version_check(written: Path) -> None:
    manifest = read_manifest(written)
    assert manifest.counts == {"generate": {"train": 7}}
    assert manifest.rows("generate", "train") == 7 and manifest.rows("lm", "train") == 0
    path = written / MANIFEST_FILE
    path.write_text(path.read_text().replace('"schema_version": 2', '"schema_version": 99'))
    with pytest.raises(DataError, match="schema version 99"):
        read_manifest(written)
    path.write_text("[]")
    with pytest.raises(DataError, match="not a TokenizeRecord"):
        read_manifest(written)


def test_lm_and_select_records_from_plain_tuples(tmp_path: Path) -> None:
    """Records built by hand (tuples, not builder tables) store and read back the same."""
    lm = [LMExample("x", 0, (arr(5, 3), arr(6, 7, 3))), LMExample("y", 2, (arr(8, 3),))]
    select = [
        SelectExample("s", 1, arr(2, 9, 3), arr(0, 0, 0), arr(0, 1, 2), arr(2, 2, 2),
                      (arr(2, 5, 3), arr(2, 6, 6, 3)), arr(0, 1, dtype=np.int8)),
        SelectExample("t", 2, arr(2, 3), arr(0, 0), arr(0, 1), arr(1, 1),
                      (arr(2, 3),), arr(1, dtype=np.int8)),
    ]  # fmt: skip
    write(tmp_path / "lm", Task.LM, {"test": lm})
    write(tmp_path / "sel", Task.SELECT, {"test": select})
    for root, task, records in (
        (tmp_path / "lm", Task.LM, lm),
        (tmp_path / "sel", Task.SELECT, select),
    ):
        read = list(ShardTable(root, task, "test"))
        assert all(examples_equal(a, b) for a, b in zip(records, read, strict=True))
