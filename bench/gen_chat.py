"""A made-up chat JSONL corpus of any size, for the tokenize benchmarks (issue 49).

Each line is one dialogue in the chat format of ``profiles/custom.yaml``: 4-12 turns,
user and assistant alternating, each of 3-25 words drawn from a Zipf distribution (s=1.1)
over a 60,000-word vocabulary. Seeded: the same arguments write the same bytes. Run:
``python -m bench.gen_chat OUT.jsonl --dialogues 100000``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

WORDS = 60_000
LETTERS = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))


def vocabulary(n: int, rng: np.random.Generator) -> list[str]:
    """``n`` distinct made-up words of 2-9 letters."""
    words: dict[str, None] = {}
    while len(words) < n:
        size = int(rng.integers(2, 10))
        words["".join(LETTERS[rng.integers(0, len(LETTERS), size)])] = None
    return list(words)


def write_corpus(path: Path, dialogues: int, seed: int = 0) -> None:
    """Write ``dialogues`` dialogues to ``path``."""
    rng = np.random.default_rng(seed)
    words = np.array(vocabulary(WORDS, rng))
    weights = 1.0 / np.arange(1, WORDS + 1) ** 1.1
    cdf = np.cumsum(weights / weights.sum())
    roles = ("user", "assistant")
    with path.open("w") as out:
        for i in range(dialogues):
            turns = int(rng.integers(4, 13))
            lengths = rng.integers(3, 26, turns)
            drawn = np.searchsorted(cdf, rng.random(int(lengths.sum())))
            texts = np.split(words[np.minimum(drawn, WORDS - 1)], np.cumsum(lengths)[:-1])
            messages = [{"role": roles[t % 2], "content": " ".join(texts[t])} for t in range(turns)]
            out.write(json.dumps({"id": f"d{i}", "messages": messages}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the JSONL file to write")
    parser.add_argument("--dialogues", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_corpus(args.out, args.dialogues, args.seed)


if __name__ == "__main__":
    main()
