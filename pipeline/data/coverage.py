"""Every split of every task a corpus is tokenized for has examples, or tokenize stops.

The runs of a task train on its train split, keep the weights of their best validation and
are scored on test by the evaluate stage. A corpus that leaves one of them empty (a chat
file of one dialogue split 80/10/10, a split fraction of 0, a validation file whose
dialogues give no example) trained a model on step 0's weights and exported them as its
result, so tokenize refuses it, before the manifest that downstream stages read is written.
The refusal names the file, the task, the counts, what each empty split is for, and what
fills it: for a corpus split here by seed (``tokenize.corpora.<name>.split``), how many
dialogues the split needs (``splits.fewest_dialogues``) or the fractions that fill it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipeline.config import CorpusParams, SplitParams
from pipeline.data.splits import (
    Split,
    assign_splits,
    fewest_dialogues,
    held_out_split,
    split_sizes,
)
from pipeline.errors import DataError

# What the runs of a task do with each split, as a refusal says it.
_USES = {
    Split.TRAIN: "a training run needs train examples to learn from",
    Split.VALID: "a training run needs valid examples to choose its weights",
    Split.TEST: "evaluate needs test examples",
}


def check_every_split(
    name: str,
    corpus: CorpusParams,
    counts: dict[str, dict[str, int]],
    by_split: Mapping[str, Sequence[str]],
    raw: Path | None,
) -> None:
    """Refuse a task of corpus ``name`` without examples in a split (``counts``: examples
    by task and split, as the tokenize record counts them; ``by_split``: the ids of the
    dialogues each split was built from; ``raw``: the corpus's download folder). The
    ``DataError`` names the corpus's file, the task, the counts, what each empty split is
    needed for and the fix."""
    dialogues = {split: len(found) for split, found in by_split.items()}
    for task, rows in counts.items():
        empty = [split for split in Split if rows.get(split.value, 0) == 0]
        if not empty:
            continue
        have = ", ".join(f"{rows.get(split.value, 0):,} {split.value}" for split in Split)
        needs = " and ".join(_USES[split] for split in empty)
        seeded = _seeded_split(corpus, by_split)
        fixes = [_fill(name, task, split, dialogues, seeded) for split in empty]
        if any(min(other.values(), default=0) > 0 for other in counts.values()):
            fixes.append(f"drop {task} from tokenize.corpora.{name}.tasks")
        fix = "; or ".join(dict.fromkeys(fixes))
        where = _file_of(name, corpus, empty[0], raw)
        raise DataError(where, f"{task} has {have} examples; {needs}: {fix}")


def _fill(
    name: str,
    task: str,
    split: Split,
    dialogues: dict[str, int],
    seeded: tuple[SplitParams, tuple[str, ...]] | None,
) -> str:
    """What gives ``split`` examples of ``task``: dialogues that yield some, more dialogues
    for a seeded split (``seeded``: its params and the splits it draws) that rounds it to
    none, or a split fraction above 0."""
    key = f"tokenize.corpora.{name}.split"
    found = dialogues.get(split.value, 0)
    if found > 0:
        return (
            f"its {found:,} {split.value} dialogues give no {task} example: add "
            f"{split.value} dialogues that do"
        )
    if seeded is None or split.value not in seeded[1]:
        return f"the corpus has no {split.value} dialogues: add some to its {split.value} data"
    params, splits = seeded
    held = [s for s in splits if s != Split.TRAIN]
    if split.value in held and getattr(params, split.value) == 0:
        return f"{key}.{split.value} is 0: set it above 0"
    pool = sum(dialogues.get(s, 0) for s in splits)
    sends = " and ".join(f"{getattr(params, s):.0%} to {s}" for s in held)
    fix = (
        f"add dialogues (the corpus has {pool:,}; {key} sends {sends}, which gives each "
        f"split one from {fewest_dialogues(params):,} dialogues on)"
    )
    # the one fraction for every held-out split that gives each of them one of ``pool``
    share = math.ceil(100 / max(pool, 1)) / 100
    sizes = split_sizes(pool, params.model_copy(update=dict.fromkeys(held, share)))
    drawn = dict(zip((s.value for s in Split), sizes, strict=True))
    if share * len(held) < 1 and all(drawn[s] > 0 for s in splits):
        fix += f", or set {key}.{' and .'.join(held)} to {share:g}"
    return fix


def _seeded_split(
    corpus: CorpusParams, by_split: Mapping[str, Sequence[str]]
) -> tuple[SplitParams, tuple[str, ...]] | None:
    """The params of the seeded split that drew the corpus's splits, and the splits it
    drew; None for a corpus that brings its own splits. A built-in corpus says nothing of
    how it splits: it split by seed if its dialogues lie where the seeded split puts them."""
    every = tuple(split.value for split in Split)
    if corpus.resplit_train:
        return corpus.split, every
    if corpus.train_on == Split.VALID:
        return held_out_split(corpus.split), (Split.TRAIN.value, Split.VALID.value)
    source = corpus.source
    if source is not None:
        own = source.file is None or source.format.traits.own_splits
        return None if own else (corpus.split, every)
    where = {i: split for split, found in by_split.items() for i in found}
    try:
        drawn = assign_splits(where, corpus.split)
    except ValueError:  # a dialogue id twice: not the seeded split's
        return None
    return (corpus.split, every) if all(drawn[i] == s for i, s in where.items()) else None


def _file_of(name: str, corpus: CorpusParams, split: Split, raw: Path | None) -> str | Path:
    """Where a corpus's ``split`` comes from: the file its declaration names for it (or its
    one file), or the corpus's download folder."""
    if corpus.source is not None:
        files = corpus.source.files()
        declared = files.get(split.value) or files.get(None)
        if declared is not None:
            return declared.file
    return raw if raw is not None else name
