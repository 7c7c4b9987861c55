"""The report's Samples section: real test histories of a tiny tokenized corpus, the
reference and each model's responses per decoding, chosen without randomness."""

from __future__ import annotations

import numpy as np

from pipeline.artifacts import ExampleResult, Layout
from pipeline.data.loader import load_vocab, open_split
from pipeline.data.splits import Split
from pipeline.names import Task
from pipeline.report import samples
from pipeline.report.results import RunResult


def _run(model: str, ids: list[str], answer) -> RunResult:
    rows = tuple(
        ExampleResult(
            seed=0,
            id=i,
            nll_sum=1.0,
            n_tokens=1,
            history_tokens=1,
            reference=f"the reference of {i}",
            hypotheses={"greedy": answer(k, "greedy"), "topp0.9": answer(k, "topp0.9")},
        )
        for k, i in enumerate(ids)
    )
    return RunResult(f"{model}-chitchat", model, "chitchat", Task.GENERATE, False, {}, (), rows,
                     0, {})  # fmt: skip


def _test_ids(root) -> tuple[list[str], dict[str, list[str]]]:
    shards = Layout(root).shards("chitchat")
    dataset, vocab = open_split(shards, Task.GENERATE, Split.TEST), load_vocab(shards)
    ids, turns = [], {}
    for index in range(len(dataset)):
        e = dataset[index]
        key = f"{e.dialogue_id}#{e.turn}"
        ids.append(key)
        by_turn: dict[int, list[int]] = {}
        for token, u in zip(e.input_ids, e.utt_index, strict=True):
            by_turn.setdefault(int(u), []).append(int(token))
        turns[key] = [vocab.decode(t) for _, t in sorted(by_turn.items())]
    return ids, turns


def test_samples_show_histories_references_and_every_decoding(shards_project):
    ids, turns = _test_ids(shards_project)
    assert len(ids) > samples.N_SAMPLES
    long = " ".join(f"w{i}" for i in range(samples.MAX_WORDS + 5))
    transformer = _run("transformer", ids, lambda k, d: "i don't know" if d == "greedy" else long)
    unet = _run("unet", ids, lambda k, d: f"a | b {k}" if d == "greedy" else "")
    found = samples.collect([transformer, unet], samples.shard_histories(shards_project))

    # the first, the last and evenly between (numpy rounds half to even): no randomness
    middle = int(np.round((len(ids) - 1) / 2))
    assert [s.id for s in found] == [ids[0], ids[middle], ids[-1]]
    first = found[0]
    assert first.turns == tuple(turns[first.id]) and first.reference == f"the reference of {ids[0]}"
    assert first.responses["transformer"] == {"greedy": "i don't know", "topp0.9": long}

    text = "\n".join(samples.samples_markdown(found))
    assert text.startswith("## Samples")
    assert f"#### chitchat test example `{ids[0]}`" in text
    assert f"Reference: the reference of {ids[0]}" in text
    assert "| Model | greedy | topp0.9 |" in text
    cut = " ".join(long.split()[: samples.MAX_WORDS]) + " …"
    assert f"| transformer | i don't know | {cut} |" in text
    assert "| unet | a \\| b 0 | *(empty)* |" in text  # a pipe cannot break the table
    # the history's turns, numbered, the last MAX_TURNS of them
    shown = turns[first.id][-samples.MAX_TURNS :]
    number = len(turns[first.id]) - len(shown) + 1
    assert f"{number}. {shown[0].split()[0]}" in text


def test_only_examples_every_model_was_scored_on(shards_project):
    ids, _ = _test_ids(shards_project)
    a = _run("transformer", ids[:6], lambda k, d: "x")
    b = _run("unet", ids[2:], lambda k, d: "y")
    chosen = samples.choose_ids([a, b], 3)
    assert chosen == [ids[2], ids[4], ids[5]] and samples.choose_ids([a, b], 10) == ids[2:6]


def test_no_section_without_generation_runs():
    assert samples.samples_markdown([]) == []


def test_a_history_missing_from_the_shards_is_said():
    sample = samples.Sample("chitchat", "gone#1", None, "hi", {"gpt": {"greedy": "x"}})
    assert "not in the tokenized test split" in samples.sample_markdown(sample)
