"""Smoke run of ``bench.bench_lm_recipe`` on a toy PTB made here (no number is asserted:
the script must run end to end and write its table)."""

from __future__ import annotations

import random
from pathlib import Path

from bench import bench_lm_recipe


def toy_ptb(folder: Path) -> Path:
    """Mikolov's layout: one sentence a line, spaces around, ``<unk>`` and ``N``."""
    rng = random.Random(0)
    words = [
        "the",
        "a",
        "fund",
        "rose",
        "N",
        "%",
        "in",
        "<unk>",
        "market",
        "stock",
        "said",
        "it",
        "of",
        "to",
        "and",
        "year",
    ]
    folder.mkdir()
    for split, n in (("train", 120), ("valid", 30), ("test", 30)):
        lines = [" ".join(rng.choices(words, k=rng.randint(3, 9))) for _ in range(n)]
        (folder / f"ptb.{split}.txt").write_text("".join(f" {line} \n" for line in lines))
    return folder


def test_both_recipes_train_through_the_project_loop_and_the_table_is_written(tmp_path, capsys):
    out = tmp_path / "LM_RECIPE.md"
    # 3 epochs of 1 step, the last averaged: the cosine's 2 planned steps outlast its 1 of
    # warm-up (2 epochs would give it 1 of each, which the train stage refuses)
    argv = ["--ptb", str(toy_ptb(tmp_path / "ptb")), "--fraction", "0.5", "--epochs", "3",
            "--seeds", "2", "--d-model", "16", "--layers", "1", "--heads", "2", "--jobs", "0",
            "--out", str(out)]  # fmt: skip
    assert bench_lm_recipe.main(argv) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "the first 60 training sentences (50% of PTB's" in text and "3 epochs" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows] == [
        "| recipe",
        "| today",
        "| recipe",
        "| recipe - today",
    ]
    assert "load average at start" in text and "command: `" in text
