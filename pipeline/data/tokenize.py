"""The tokenize stage's work: raw corpus folder -> vocabulary + example shards + manifest.

``tokenize_corpus`` streams the corpus (``split_plan``): it plans the splits, builds the
vocabulary (and, for MultiWOZ, the act inventory) from the TRAINING split only, encodes
the dialogues a chunk at a time, builds the examples of each task the corpus's params ask
for, and writes them with ``shards.ShardWriter``; the manifest goes last. ``read_splits``
lists a corpus's dialogues by split in memory, for the stages that read a split whole
(evaluate's references).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pipeline.artifacts import (
    ACTS_FILE,
    MANIFEST_FILE,
    SOURCES_FILE,
    VOCAB_FILE,
    DownloadRecord,
    ShardFile,
    TokenizeRecord,
    TokenizeSettings,
)
from pipeline.config import CorpusParams, Params, SplitParams, TokenizeParams
from pipeline.data.acts import ActInventory
from pipeline.data.corpora import CorpusSpec, corpus_spec, read_corpus
from pipeline.data.coverage import check_every_split
from pipeline.data.dialogue import Dialogue
from pipeline.data.encoding import EncodedDialogue, EncodeOptions, encode_dialogues, vocab_texts
from pipeline.data.examples import (
    CandidatePool,
    SelectRule,
    build_generate,
    build_lm,
    build_select,
    own_candidates,
    response_rows,
    select_rows,
)
from pipeline.data.formats import ParseStats
from pipeline.data.records import ExampleTable, Packed
from pipeline.data.shards import ShardWriter, SplitFiles, write_manifest
from pipeline.data.special import MODEL_ONLY_TOKENS
from pipeline.data.split_plan import SplitPlan, plan_splits
from pipeline.data.splits import Split, assign_splits, held_out_split
from pipeline.data.vocab import Vocab, build_vocab
from pipeline.errors import ConfigError, DataError
from pipeline.names import Task
from pipeline.progress import Mode, Reporter


def read_splits(
    name: str, raw_dir: Path | None, params: TokenizeParams, stats: ParseStats
) -> dict[str, list[Dialogue]]:
    """The corpus's dialogues by split (train, valid, test order), at most
    ``max_dialogues`` per split."""
    corpus = params.corpora[name]
    spec = corpus_spec(name, corpus.source)
    root = raw_dir
    if spec.bundled is not None and (raw_dir is None or not raw_dir.is_dir()):
        root = None  # shipped in a package: the raw folder is optional
    options = spec.params_options(corpus)
    dialogues = read_corpus(
        name,
        root,
        None,
        params.on_error,
        stats=stats,
        split_params=corpus.split,
        **options,
    )
    if corpus.train_on == Split.VALID:
        dialogues = _valid_as_train(dialogues, corpus.split)
    elif corpus.resplit_train:
        dialogues = _resplit_train(dialogues, corpus.split)
    by_split: dict[str, list[Dialogue]] = {s.value: [] for s in Split}
    for d in dialogues:
        part = by_split.setdefault(str(d.meta.get("split", Split.TRAIN)), [])
        if corpus.max_dialogues is None or len(part) < corpus.max_dialogues:
            part.append(d)
    return by_split


def _resplit_train(dialogues: Iterable[Dialogue], split: SplitParams) -> list[Dialogue]:
    """``resplit_train``: the corpus's training dialogues alone, assigned to train, valid
    and test by ``split`` (seeded, by dialogue id)."""
    kept = [d for d in dialogues if d.meta.get("split", Split.TRAIN) == Split.TRAIN]
    assignment = assign_splits((d.id for d in kept), split)
    return [replace(d, meta={**d.meta, "split": assignment[d.id].value}) for d in kept]


def _valid_as_train(dialogues: Iterable[Dialogue], split: SplitParams) -> list[Dialogue]:
    """``train_on: valid``: the corpus's training dialogues are dropped, its validation
    dialogues become the training split but for a seeded ``split.valid`` fraction held out
    for validation; the test dialogues stay the corpus's own."""
    kept = [d for d in dialogues if d.meta.get("split") != Split.TRAIN]
    held_out = held_out_split(split)
    valid_ids = [d.id for d in kept if d.meta.get("split") == Split.VALID]
    assignment = assign_splits(valid_ids, held_out)
    return [
        d
        if d.meta.get("split") != Split.VALID
        else replace(d, meta={**d.meta, "split": assignment[d.id].value})
        for d in kept
    ]


def encode_options(
    spec: CorpusSpec, corpus: CorpusParams, train: Iterable[Dialogue]
) -> EncodeOptions:
    """Corpus-specific encoding: which speaker answers (``spec.responder``) and, for corpora
    with dialogue acts, the act inventory of the training dialogues."""
    if spec.acts:
        inventory = ActInventory.from_dialogues(train)
        return EncodeOptions(spec.responder, inventory, corpus.generate.delexicalize)
    return EncodeOptions(spec.responder)


def build_examples(
    task: Task,
    encoded: list[EncodedDialogue],
    corpus: CorpusParams,
    split: str,
    generated: ExampleTable | None = None,
) -> ExampleTable:
    """The ``task`` examples of one split (select reuses the histories of ``generated``)."""
    if task is Task.GENERATE:
        return build_generate(encoded, corpus.generate)
    if task is Task.SELECT:
        seed = corpus.split.seed
        return build_select(encoded, corpus.select, corpus.generate, split, seed, generated)
    return build_lm(encoded, corpus.lm)


def _sources(raw_dir: Path | None) -> DownloadRecord | None:
    path = raw_dir / SOURCES_FILE if raw_dir is not None else None
    if path is None or not path.is_file():
        return None
    return DownloadRecord.read(path)


def tokenize_corpus(
    name: str,
    raw_dir: str | Path | None,
    out_dir: str | Path,
    params: TokenizeParams | Params,
    progress: bool | Mode = False,
) -> TokenizeRecord:
    """Tokenize corpus ``name`` from ``raw_dir`` into ``out_dir`` (see ``shards.py``).

    ``params``: the ``tokenize`` section (or all of params.yaml). The vocabulary and act
    inventory come from the training split only; every split gets the examples of every
    task in ``tokenize.corpora.<name>.tasks``. Malformed records raise, or are skipped and
    counted (by file and by reason) with ``tokenize.on_error: skip``. ``raw_dir`` may be
    None (or missing) for a corpus shipped in a package (chitchat). ``progress``: a line
    per step (reading, vocabulary, examples), or a bar on a terminal (``pipeline.progress``).

    The corpus is streamed, never held whole: one read plans the splits
    (``split_plan``), one counts the training vocabulary, one encodes
    ``tokenize.chunk_dialogues`` dialogues at a time and writes their generate and lm
    examples and the select candidate pools; with select, one more writes the select
    examples, whose negatives are drawn from their split's whole pool. The examples are
    those of the split built whole, whatever the chunk size.
    """
    if isinstance(params, Params):
        params = params.tokenize
    if name not in params.corpora:
        raise ConfigError(f"tokenize.corpora.{name}", "no settings for this corpus in params.yaml")
    corpus = params.corpora[name]
    raw = Path(raw_dir) if raw_dir is not None else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # an interrupted run leaves no manifest
    tasks = tuple(sorted(dict.fromkeys(corpus.tasks), key=list(Task).index))  # generate first
    stats = ParseStats()
    steps = 3 + (Task.SELECT in tasks)
    bar = Reporter(
        f"tokenize {name}", steps, show=progress, every_s=0, info="reading the corpus"
    )  # a line per step: a few, each long on a large corpus
    with bar:
        plan = plan_splits(name, raw, params, stats)
        if not plan.size(Split.TRAIN):
            where = raw if raw is not None else name
            raise DataError(where, "no training dialogues: the vocabulary is built from train")
        _advance(bar, f"building the vocabulary ({plan.size(Split.TRAIN):,} train dialogues)")
        spec = corpus_spec(name, corpus.source)
        options = encode_options(spec, corpus, _only_dialogues(plan, Split.TRAIN))
        vocab = _vocabulary(_only_dialogues(plan, Split.TRAIN), options, corpus, out)
        sizes = ", ".join(f"{plan.size(s):,} {s}" for s in plan.names)
        _advance(bar, f"encoding {sizes} dialogues: {', '.join(t.value for t in tasks)}")
        writers = {
            (task, split): ShardWriter(out, task, split, params.shard_rows)
            for split in plan.names
            for task in tasks
        }
        encoder = _Encoder(plan, vocab, options, params.chunk_dialogues)
        try:
            pools = _write_examples(encoder, corpus, tasks, writers)
            if Task.SELECT in tasks:
                _advance(bar, "select examples")
                _write_select(encoder, corpus, pools, writers, name)
        except ConfigError as err:
            raise err.under(f"tokenize.corpora.{name}") from None
        written = _Written.empty(tasks)
        for (task, split), writer in writers.items():
            written.add(task, split, writer.target_tokens, writer.close())
        _advance(bar, "")  # the last step done: the reporter's final line says so
    for stale in set(Task) - set(tasks):
        for path in (out / stale.value).glob("*.arrow"):
            path.unlink()
    manifest = written.record(name, vocab, options.inventory, stats, raw, params, corpus)
    check_every_split(name, corpus, manifest.counts, plan.ids, raw)
    write_manifest(out, manifest)
    return manifest


def _only_dialogues(plan: SplitPlan, split: str) -> Iterator[Dialogue]:
    """The dialogues of one split, read again."""
    return (dialogue for _, dialogue in plan.dialogues([split]))


@dataclass
class _Encoder:
    """The corpus read again and encoded a chunk at a time: ``chunks`` yields each split's
    dialogues, ``size`` at a time, encoded (a split's chunks in order, the splits'
    chunks interleaved as the dialogues come)."""

    plan: SplitPlan
    vocab: Vocab
    options: EncodeOptions
    size: int

    def chunks(self) -> Iterator[tuple[str, list[EncodedDialogue]]]:
        held: dict[str, list[Dialogue]] = {split: [] for split in self.plan.names}
        for split, dialogue in self.plan.dialogues():
            part = held[split]
            part.append(dialogue)
            if len(part) >= self.size:
                yield split, encode_dialogues(part, self.vocab, self.options)
                part.clear()
        for split, part in held.items():
            if part:
                yield split, encode_dialogues(part, self.vocab, self.options)


@dataclass
class _SplitPool:
    """One split's select candidates as the encoding read collects them: the sampled
    pool's rows, a text id for each and the dialogue of each; whether any dialogue
    brings its own candidates."""

    rows: list[Packed]
    texts: list[np.ndarray]
    dialogues: list[np.ndarray]
    seen: int = 0
    own: bool = False
    sampled: bool = False
    knowledge: bool = True
    candidate_knowledge: bool = True

    def flags(self, dialogues: list[EncodedDialogue]) -> list[EncodedDialogue]:
        """``dialogues`` without their knowledge flags where some dialogue of the split has
        none: a split built whole keeps a flag column only if every dialogue has one."""
        if not self.knowledge:
            dialogues = [replace(d, knowledge=None) for d in dialogues]
        if not self.candidate_knowledge:
            dialogues = [replace(d, candidate_knowledge=None) for d in dialogues]
        return dialogues

    def pool(self, writer: ShardWriter) -> CandidatePool:
        """The split's pool: its rows written as the split's select pool by ``writer`` and
        read back memory-mapped (the select rows refer to them, by index), a text id of
        each row (ids of equal digests are equal), and the dialogue of each row."""
        rows = writer.write_pool(_concat_packed(self.rows))
        self.rows.clear()
        digests = np.concatenate(self.texts) if self.texts else np.zeros((0, 2), np.uint64)
        _, text_of = np.unique(digests, axis=0, return_inverse=True)
        dialogue = np.concatenate(self.dialogues) if self.dialogues else np.zeros(0, np.int64)
        return CandidatePool.of(rows, text_of.reshape(-1).astype(np.int64), dialogue)


def _concat_packed(parts: list[Packed]) -> Packed:
    """The rows of ``parts`` one after another, as one Packed."""
    if not parts:
        return Packed(np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64))
    values = np.concatenate([p.values[p.offsets[0] : p.offsets[-1]] for p in parts])
    lengths = np.concatenate([p.lengths for p in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Packed(values, offsets)


def _digests(rows: Packed) -> np.ndarray:
    """A 128-bit digest of each row's tokens (``[n, 2]`` uint64): equal rows, equal
    digests; unequal rows collide with odds of about n**2 / 2**129."""
    out = np.empty((len(rows), 2), dtype=np.uint64)
    for k in range(len(rows)):
        out[k] = np.frombuffer(hashlib.blake2b(rows[k].tobytes(), digest_size=16).digest(), "<u8")
    return out


def _write_examples(
    encoder: _Encoder,
    corpus: CorpusParams,
    tasks: tuple[Task, ...],
    writers: dict[tuple[Task, str], ShardWriter],
) -> dict[str, _SplitPool]:
    """The encoding read: each chunk's generate and lm examples written, and the select
    pools of the splits collected."""
    pools = {split: _SplitPool([], [], []) for split in encoder.plan.names}
    for split, encoded in encoder.chunks():
        for task in tasks:
            if task is not Task.SELECT:
                writers[task, split].add(build_examples(task, encoded, corpus, split))
                continue
            pool = pools[split]
            sampled = [d for d in encoded if d.candidates is None]
            own = [d for d in encoded if d.candidates is not None and d.utterances]
            pool.own |= bool(own)
            pool.knowledge &= all(d.knowledge is not None for d in own)
            pool.candidate_knowledge &= all(d.candidate_knowledge is not None for d in own)
            pool.sampled |= bool(sampled)
            rows, dialogue = response_rows(sampled, corpus.select.max_candidate)
            pool.rows.append(rows)
            pool.texts.append(_digests(rows))
            pool.dialogues.append(dialogue + pool.seen)
            pool.seen += len(sampled)
    return pools


def _write_select(
    encoder: _Encoder,
    corpus: CorpusParams,
    pools: dict[str, _SplitPool],
    writers: dict[tuple[Task, str], ShardWriter],
    name: str,
) -> None:
    """The select read: each chunk's select examples, negatives drawn from the split's
    whole pool (written first, then memory-mapped), or a corpus's own candidates."""
    drawn: dict[str, CandidatePool] = {}
    for split, pool in pools.items():
        if pool.own and pool.sampled:
            raise DataError(
                name, f"the {split} split mixes dialogues with their own candidates and "
                "without: select examples are built for one kind or the other",
            )  # fmt: skip
        if pool.sampled:
            drawn[split] = pool.pool(writers[Task.SELECT, split])
    start = dict.fromkeys(pools, 0)
    for split, encoded in encoder.chunks():
        rule = SelectRule(corpus.select, corpus.generate, split, corpus.split.seed)
        writer = writers[Task.SELECT, split]
        if split not in drawn:
            own = pools[split].flags([d for d in encoded if d.utterances])
            if own:
                writer.add(own_candidates(own, rule), own_pool=True)
            continue
        sampled = [d for d in encoded if d.candidates is None]
        table = select_rows(sampled, rule, drawn[split], start[split])
        start[split] += len(table)
        writer.add(table)


def _advance(bar: Reporter, next_step: str) -> None:
    bar.update(info=next_step)
    bar.advance()


def _vocabulary(
    train: Iterable[Dialogue], options: EncodeOptions, corpus: CorpusParams, out: Path
) -> Vocab:
    """The vocabulary of the training dialogues (and their act inventory), saved in ``out``."""
    inventory = options.inventory
    reserved = inventory.placeholders if options.delexicalize and inventory else ()
    vocab = build_vocab(vocab_texts(train, options), corpus.vocab, reserved)
    vocab.save(out / VOCAB_FILE)
    if inventory is not None:
        inventory.save(out / ACTS_FILE)
    return vocab


@dataclass
class _Written:
    """The shards a tokenize run wrote, by task and split, and what the manifest says."""

    shards: dict[str, dict[str, list[ShardFile]]]
    target_tokens: dict[str, dict[str, int]]
    pools: dict[str, ShardFile]

    @classmethod
    def empty(cls, tasks: tuple[Task, ...]) -> _Written:
        return cls({t.value: {} for t in tasks}, {t.value: {} for t in tasks}, {})

    def add(self, task: Task, split: str, target_tokens: int, files: SplitFiles) -> None:
        self.target_tokens[task.value][split] = target_tokens
        self.shards[task.value][split] = files.shards
        if files.pool is not None:
            self.pools[split] = files.pool

    def record(
        self,
        name: str,
        vocab: Vocab,
        inventory: ActInventory | None,
        stats: ParseStats,
        raw: Path | None,
        params: TokenizeParams,
        corpus: CorpusParams,
    ) -> TokenizeRecord:
        return TokenizeRecord(
            corpus=name,
            vocab_hash=vocab.content_hash,
            vocab_size=len(vocab),
            vocab_words=sum(t not in MODEL_ONLY_TOKENS for t in vocab.tokens),
            shards=self.shards,
            target_tokens=self.target_tokens,
            pools=self.pools,
            n_acts=len(inventory) if inventory is not None else None,
            act_names=list(inventory.names) if inventory is not None else None,
            skipped={
                "malformed_records": stats.skipped_total,
                "empty_texts": stats.empty_texts,
                "single_turn_dialogues": stats.single_turn,
            },
            skipped_by_reason=dict(sorted(stats.by_reason.items())),
            warnings=stats.skip_messages(),
            sources=_sources(raw),
            params=TokenizeSettings(
                on_error=params.on_error, shard_rows=params.shard_rows, corpus=corpus
            ),
        )
