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


def test_arms_and_layouts_train_through_the_project_loop_and_the_report_is_written(
    tmp_path: Path,
) -> None:
    ptb, work, out = toy_ptb(tmp_path / "ptb"), tmp_path / "work", tmp_path / "LM_RECIPE.md"
    common = ["--ptb", str(ptb), "--work", str(work), "--fraction", "0.5", "--valid-fraction",
              "0.5", "--epochs", "2", "--seeds", "0", "--d-model", "16", "--layers", "1",
              "--heads", "2", "--batch-size", "4", "--jobs", "0"]  # fmt: skip
    assert bench_lm_recipe.main(["run", *common, "--layout", "documents"]) == 0
    assert bench_lm_recipe.main(["run", *common, "--layout", "stream", "--arms", "recipe"]) == 0
    runs = bench_lm_recipe.read_runs(work)
    assert [(r.arm, r.layout) for r in runs] == [
        ("plain", "documents"),
        ("recipe", "documents"),
        ("recipe", "stream"),
    ]
    assert all(sorted(r.curve) == [1, 2] for r in runs)  # validated after every epoch
    plain, recipe = (r.summary["knobs"] for r in runs[:2])
    # only the regularisers differ between the arms
    assert {k for k in plain if plain[k] != recipe[k]} == {"model"}
    assert plain["model"] == {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 64}
    assert recipe["model"]["qkv_dropout"] == 0.2 and recipe["model"]["d_model"] == 16
    summaries = {path.stat().st_mtime_ns for path in (work / "runs").glob("*.json")}
    assert bench_lm_recipe.main(["run", *common, "--layout", "documents"]) == 0  # all done
    assert {path.stat().st_mtime_ns for path in (work / "runs").glob("*.json")} == summaries
    # a run not finished (its curve so far, no summary yet) is reported as such
    partial = (work / "runs" / "recipe-stream-s0.jsonl").read_text().splitlines()
    (work / "runs" / "plain-stream-s1.jsonl").write_text("\n".join(partial[:-1]) + "\n")
    assert bench_lm_recipe.main(["report", "--work", str(work), "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")]
    assert rows[:5] == ["| run", "| plain, documents, seed 0", "| recipe, documents, seed 0",
                        "| plain, stream, seed 1", "| recipe, stream, seed 0"]  # fmt: skip
    assert "| plain, stream, seed 1 | 1, unfinished |" in text
    assert "load average at start" in text and out.with_suffix(".png").is_file()
    # --section replaces the runs section alone: the written reading around it stays
    out.write_text("# Head\n\n## Runs\n\nold\n\n## Reading\n\nkept\n")
    assert (
        bench_lm_recipe.main(["report", "--work", str(work), "--out", str(out), "--section"]) == 0
    )
    kept = out.read_text()
    assert kept.startswith("# Head\n\n## Runs (written by") and kept.endswith(
        "## Reading\n\nkept\n"
    )
    assert "old" not in kept and "| plain, documents, seed 0" in kept
