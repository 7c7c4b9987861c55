"""The report's "Samples" section: a few test histories with the reference response and
every generation model's responses, one column per decoding (greedy, the seeded nucleus
sample, ...), so a reader sees what the ChatEval numbers stand for.

The responses are those the evaluate stage scored (``per_example.jsonl``: each example's
``reference`` and ``hypotheses`` by decoding, first seed of each run); the histories come
from the corpus' tokenized test split (``data/shards``), decoded by its vocabulary. The
examples are chosen without randomness: :data:`N_SAMPLES` spread evenly over the test
examples every generation run of the corpus was scored on, in evaluation order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.artifacts import ExampleResult, Layout
from pipeline.data.loader import load_vocab, open_split
from pipeline.data.splits import Split
from pipeline.names import Task
from pipeline.report.results import RunResult

N_SAMPLES = 3  # histories per corpus
MAX_TURNS = 4  # the last turns of a history shown; earlier ones are counted, not shown
MAX_WORDS = 30  # words shown of one turn or response; the rest is cut with "…"


@dataclass(frozen=True)
class Sample:
    """One test example: its history (turns, oldest first), the reference response and
    each run's response per decoding (``responses[run label][decoding]``)."""

    corpus: str
    id: str
    turns: tuple[str, ...] | None  # None: not found in the tokenized test split
    reference: str
    responses: dict[str, dict[str, str]]


def _first_seed(run: RunResult) -> dict[str, ExampleResult]:
    if not run.examples:
        return {}
    seed = run.examples[0].seed
    return {r.id: r for r in run.examples if r.seed == seed}


def choose_ids(runs: Sequence[RunResult], n: int = N_SAMPLES) -> list[str]:
    """``n`` example ids scored by every run with responses, spread evenly over the first
    run's evaluation order (the first and the last included)."""
    scored = [_first_seed(r) for r in runs]
    scored = [rows for rows in scored if any(row.hypotheses for row in rows.values())]
    if not scored:
        return []
    common = [i for i in scored[0] if all(i in rows for rows in scored[1:])]
    if len(common) <= n:
        return common
    picks = np.linspace(0, len(common) - 1, n).round().astype(int)
    return [common[i] for i in dict.fromkeys(picks.tolist())]


HistoryReader = Callable[[str, list[str]], dict[str, tuple[str, ...]]]


def shard_histories(root: Path) -> HistoryReader:
    """Reads the turns of test examples from ``<root>/data/shards/<corpus>`` (stops as
    soon as every id asked for is found: the evaluated examples come first)."""

    def read(corpus: str, ids: list[str]) -> dict[str, tuple[str, ...]]:
        shards = Layout(root).shards(corpus)
        dataset = open_split(shards, Task.GENERATE, Split.TEST)
        vocab = load_vocab(shards)
        wanted, found = set(ids), {}
        for index in range(len(dataset)):
            example = dataset[index]
            key = f"{example.dialogue_id}#{example.turn}"  # eval.collect.example_id
            if key not in wanted:
                continue
            turns: dict[int, list[int]] = {}
            for token, u in zip(example.input_ids, example.utt_index, strict=True):
                turns.setdefault(int(u), []).append(int(token))
            found[key] = tuple(vocab.decode(t) for _, t in sorted(turns.items()))
            if len(found) == len(wanted):
                break
        return found

    return read


def collect(
    runs: Sequence[RunResult], read_histories: HistoryReader, n: int = N_SAMPLES
) -> list[Sample]:
    """The samples of every corpus with generation runs (corpora in run order)."""
    samples = []
    generate = [r for r in runs if r.task is Task.GENERATE]
    for corpus in dict.fromkeys(r.corpus for r in generate):
        chosen = [r for r in generate if r.corpus == corpus]
        ids = choose_ids(chosen, n)
        if not ids:
            continue
        histories = read_histories(corpus, ids)
        scored = [(r.label, _first_seed(r)) for r in chosen]
        scored = [(label, rows) for label, rows in scored if all(i in rows for i in ids)]
        for i in ids:
            reference = next((rows[i].reference for _, rows in scored if rows[i].reference), "")
            responses = {label: dict(rows[i].hypotheses) for label, rows in scored}
            samples.append(Sample(corpus, i, histories.get(i), reference, responses))
    return samples


def _cut(text: str, words: int = MAX_WORDS) -> str:
    split = text.split()
    return " ".join(split[:words]) + (" …" if len(split) > words else "")


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell, visibly empty when empty."""
    text = _cut(text).replace("|", "\\|")
    return text if text else "*(empty)*"


def sample_markdown(sample: Sample) -> str:
    """One sample: its history as numbered turns, then a table of the responses."""
    lines = [f"#### {sample.corpus} test example `{sample.id}`", ""]
    if sample.turns is None:
        lines += ["History: not in the tokenized test split (re-run `dvc repro`).", ""]
    else:
        shown = sample.turns[-MAX_TURNS:]
        hidden = len(sample.turns) - len(shown)
        if hidden:
            lines += [f"History (last {len(shown)} of {len(sample.turns)} turns):", ""]
        else:
            lines += ["History:", ""]
        first = hidden + 1
        lines += [f"{first + k}. {_cut(turn) or '*(empty)*'}" for k, turn in enumerate(shown)]
        lines.append("")
    lines += [f"Reference: {_cell(sample.reference)}", ""]
    decodings = list(dict.fromkeys(d for by in sample.responses.values() for d in by))
    header = ["Model", *decodings]
    body = [
        [label, *[_cell(by[d]) if d in by else "-" for d in decodings]]
        for label, by in sample.responses.items()
    ]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def samples_markdown(samples: Sequence[Sample]) -> list[str]:
    """The "Samples" section (no lines when there is no generation run)."""
    if not samples:
        return []
    return [
        "## Samples",
        "",
        f"{N_SAMPLES} test histories per corpus, spread evenly over the evaluated examples "
        "(no randomness), with the reference and each generation model's responses "
        f"(first seed) for every decoding it was evaluated with. Turns: the last {MAX_TURNS} "
        f"of the history, oldest first; text cut after {MAX_WORDS} words (…). All of the "
        "evaluated examples: `data/eval/<run>/per_example.jsonl`; the first ones with "
        "histories: `data/eval/<run>/samples.md`.",
        "",
        *[sample_markdown(s) for s in samples],
    ]
