"""The tokenize stage's work: raw corpus folder -> vocabulary + example shards + manifest.

``tokenize_corpus`` reads the corpus (``read_corpus``), builds the vocabulary (and, for
MultiWOZ, the act inventory) from the TRAINING split only, encodes every split once, builds
the examples of each task the corpus's params ask for, and writes them with
``shards.write_shards``; the manifest goes last.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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
from pipeline.data.examples import build_generate, build_lm, build_select
from pipeline.data.formats import ParseStats
from pipeline.data.records import ExampleTable
from pipeline.data.shards import write_manifest, write_shards
from pipeline.data.special import MODEL_ONLY_TOKENS
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


def encode_options(spec: CorpusSpec, corpus: CorpusParams, train: list[Dialogue]) -> EncodeOptions:
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
    per step (reading, vocabulary, each split's encoding and each task's examples), or a
    bar on a terminal (``pipeline.progress``).
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
    bar = Reporter(
        f"tokenize {name}",
        2 + len(Split) * (1 + len(tasks)),
        show=progress,
        every_s=0,  # a line per step: a dozen at most, each long on a large corpus
        info="reading the corpus",
    )
    with bar:
        by_split = read_splits(name, raw, params, stats)
        bar.update(total=2 + len(by_split) * (1 + len(tasks)))
        train = by_split.get(Split.TRAIN, [])
        if not train:
            where = raw if raw is not None else name
            raise DataError(where, "no training dialogues: the vocabulary is built from train")
        _advance(bar, "building the vocabulary")
        options = encode_options(corpus_spec(name, corpus.source), corpus, train)
        vocab = _vocabulary(train, options, corpus, out)
        written = _Written.empty(tasks)
        for split, dialogues in by_split.items():
            _advance(bar, f"encoding {split} ({len(dialogues):,} dialogues)")
            encoded = encode_dialogues(dialogues, vocab, options)
            generated = None
            for task in tasks:
                _advance(bar, f"{task.value} examples of {split}")
                try:
                    examples = build_examples(task, encoded, corpus, split, generated)
                except ConfigError as err:
                    raise err.under(f"tokenize.corpora.{name}") from None
                generated = examples if task is Task.GENERATE else generated
                written.add(
                    task,
                    split,
                    examples,
                    write_shards(out, task, split, examples, params.shard_rows),
                )
        _advance(bar, "")  # the last step done: the reporter's final line says so
    for stale in set(Task) - set(tasks):
        for path in (out / stale.value).glob("*.arrow"):
            path.unlink()
    manifest = written.record(name, vocab, options.inventory, stats, raw, params, corpus)
    check_every_split(name, corpus, manifest.counts, by_split, raw)
    write_manifest(out, manifest)
    return manifest


def _advance(bar: Reporter, next_step: str) -> None:
    bar.update(info=next_step)
    bar.advance()


def _vocabulary(
    train: list[Dialogue], options: EncodeOptions, corpus: CorpusParams, out: Path
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

    def add(self, task: Task, split: str, examples: ExampleTable, files: Any) -> None:
        self.target_tokens[task.value][split] = examples.scored_tokens()
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
