"""A corpus's splits planned in one read, then its dialogues read again, never held whole.

:func:`plan_splits` reads the corpus once and keeps only each dialogue's id and split: the
split it ends in (the corpus's own, or the seeded one, after ``train_on``,
``resplit_train`` and ``max_dialogues``), or none (beyond ``max_dialogues``). The plan's
:meth:`SplitPlan.dialogues` reads the corpus again, as often as the tokenize stage needs
it, yielding each kept dialogue with its split; the dialogues of a split come in the order
``tokenize.read_splits`` lists them, so the examples built from them are the same. A
chat file of a million dialogues is then held as its ids (the seeded split ranks them),
not as a million parsed dialogues.

Reading is deterministic, so every read yields the same dialogues; malformed records are
raised or counted by the plan's read alone (``ParseStats``), and skipped again after.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.config import SplitParams, TokenizeParams
from pipeline.data import declared
from pipeline.data.corpora import corpus_spec, read_corpus
from pipeline.data.dialogue import Dialogue
from pipeline.data.formats import ParseContext, ParseStats
from pipeline.data.splits import Split, assign_splits, held_out_split
from pipeline.errors import DataError
from pipeline.names import OnError

# The split key of a dialogue whose split the seeded split draws once all ids are read.
_SEEDED = "\x00seeded"


@dataclass
class SplitPlan:
    """Which split each dialogue of corpus ``name`` goes to, by its place in a read.

    ``names``: the splits in ``read_splits`` order (train, valid, test, then any other the
    corpus names); ``route``: per dialogue read, the index of its split in ``names``, -1
    for one left out; ``ids``: the dialogue ids of each split, in order.
    """

    name: str
    root: Path | None
    params: TokenizeParams
    names: tuple[str, ...]
    route: np.ndarray
    ids: dict[str, list[str]] = field(default_factory=dict)

    def size(self, split: str) -> int:
        """How many dialogues ``split`` holds."""
        return len(self.ids.get(split, ()))

    def dialogues(self, splits: Iterable[str] | None = None) -> Iterator[tuple[str, Dialogue]]:
        """The corpus read again: each dialogue of ``splits`` (None: every split) with its
        split, in read order (a split's dialogues in their order)."""
        wanted = None if splits is None else {self.names.index(s) for s in splits}
        read = _read(self.name, self.root, self.params, ParseStats())  # counted by the plan
        for k, (_, dialogue) in enumerate(read):
            code = int(self.route[k])
            if code >= 0 and (wanted is None or code in wanted):
                yield self.names[code], dialogue


def plan_splits(
    name: str, root: Path | None, params: TokenizeParams, stats: ParseStats
) -> SplitPlan:
    """Read corpus ``name`` once (malformed records raised or counted in ``stats``) and
    plan its splits as ``tokenize.read_splits`` draws them."""
    corpus = params.corpora[name]
    spec = corpus_spec(name, corpus.source)
    if spec.bundled is not None and (root is None or not root.is_dir()):
        root = None  # shipped in a package: the raw folder is optional
    ids: list[str] = []
    keys: list[str | None] = []
    for key, dialogue in _read(name, root, params, stats):
        ids.append(dialogue.id)
        keys.append(key)
    seeded = [i for i, key in zip(ids, keys, strict=True) if key == _SEEDED]
    if seeded:
        drawn = assign_splits(seeded, corpus.split)
        keys = [drawn[i].value if k == _SEEDED else k for i, k in zip(ids, keys, strict=True)]
    if spec.declared is not None:  # a declared corpus yields the dialogues of a Split alone
        kept = {s.value for s in Split}
        keys = [k if k in kept else None for k in keys]
        dropped = [k is None for k in keys]
    else:
        dropped = [False] * len(keys)
    final = _final_splits(ids, keys, dropped, corpus.train_on, corpus.resplit_train, corpus.split)
    names = [s.value for s in Split]
    route = np.full(len(ids), -1, dtype=np.int16)
    by_split: dict[str, list[str]] = {s: [] for s in names}
    for k, split in enumerate(final):
        if split is None:
            continue
        if split not in by_split:
            names.append(split)
            by_split[split] = []
        part = by_split[split]
        if corpus.max_dialogues is None or len(part) < corpus.max_dialogues:
            part.append(ids[k])
            route[k] = names.index(split)
    return SplitPlan(name, root, params, tuple(names), route, by_split)


def _final_splits(
    ids: list[str],
    keys: list[str | None],
    dropped: list[bool],
    train_on: str | None,
    resplit: bool,
    split_params: SplitParams,
) -> list[str | None]:
    """Each dialogue's split after ``train_on: valid`` or ``resplit_train`` (None: left
    out), as ``tokenize._valid_as_train`` and ``tokenize._resplit_train`` give them; a
    dialogue without a split is a training one."""
    final: list[str | None] = [None if gone else (k or Split.TRAIN.value) for k, gone in
                               zip(keys, dropped, strict=True)]  # fmt: skip
    if train_on == Split.VALID:
        valid = [i for i, k in zip(ids, final, strict=True) if k == Split.VALID]
        drawn = assign_splits(valid, held_out_split(split_params))
        out: list[str | None] = []
        for i, k, key in zip(ids, final, keys, strict=True):
            if k is None or key == Split.TRAIN:
                out.append(None)
            else:
                out.append(drawn[i].value if k == Split.VALID else k)
        return out
    if resplit:
        kept = [i for i, k in zip(ids, final, strict=True) if k == Split.TRAIN]
        drawn = assign_splits(kept, split_params)
        return [
            drawn[i].value if k == Split.TRAIN else None for i, k in zip(ids, final, strict=True)
        ]
    return final


def _read(
    name: str, root: Path | None, params: TokenizeParams, stats: ParseStats
) -> Iterator[tuple[str | None, Dialogue]]:
    """One read of the corpus: each dialogue with the split its source gives it (None:
    none; :data:`_SEEDED`: drawn by the seeded split), in the order of its files."""
    corpus = params.corpora[name]
    spec = corpus_spec(name, corpus.source)
    if spec.declared is None:
        options = spec.params_options(corpus)
        dialogues = read_corpus(
            name, root, None, params.on_error, stats=stats, split_params=corpus.split, **options
        )
        for dialogue in dialogues:
            split = dialogue.meta.get("split")
            yield (None if split is None else str(split)), dialogue
        return
    if root is None or not root.is_dir():
        where = root if root is not None else "<root>"
        raise DataError(where, f"no such folder; run `python -m stages.download {name}` first")
    form = declared.declared_record(root).declared.format  # type: ignore[union-attr]
    ctx = ParseContext(OnError(params.on_error), stats, corpus.split)
    for part, dialogue in declared.read_files(root, ctx):
        if declared.split_by_seed(part, form):
            yield _SEEDED, dialogue
        elif part == declared.WHOLE:
            yield str(dialogue.meta["split"]), dialogue
        else:
            yield part, dialogue
