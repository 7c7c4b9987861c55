"""Corpora of one's own, declared in params alone (``tokenize.corpora.<name>.source``): a
chat JSONL file (``formats.chat``) or a ConvLab-3 unified ``data.zip``
(``formats.convlab``), from a path, a ``file://`` or an ``https://`` URL.

Download. A local file (a path in the project, an absolute path, a ``file://`` URL) is
not copied: ``data/raw/<name>/`` holds a symbolic link to it (relative inside the project,
so a copied project reads its own file), its sha256 checked against the declared one and
recorded in ``SOURCES.json`` on every run. DVC hashes what a link points to, so editing the
file makes ``dvc repro`` re-run this corpus's download and tokenize stages and whatever
trains on it, and nothing else. A URL is fetched like a built-in corpus's files
(resumable, verified, a mirror tried first) and trusted on first use without a sha256.
``SOURCES.json`` records the declaration and which file holds which split, so
:func:`read_declared` (and ``read_corpus``) read the folder without the params.

Reading. A single chat file is split by dialogue with the corpus's seeded ``split``
params; a file per split gives its dialogues that split; a ConvLab file carries its own
splits. Generation targets: ConvLab corpora answer as the system (like MultiWOZ), chat
corpora every turn after the first, or one role's (``source.targets``). Errors name the
file as declared (``examples/chat.jsonl:137: messages[2].content: ...``); a file that holds
no dialogue (empty, or every record dropped) is an error naming it and the params key.

A format is its row of ``SourceFormat`` (``pipeline.config``: its traits, which config,
this module, ``corpora.declared_spec`` and the params check read) and its reader here,
:data:`READERS`: nothing else asks which format a corpus is in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse
from urllib.request import url2pathname

from pipeline.artifacts import SOURCES_FILE, DownloadRecord
from pipeline.config import FileSource, SourceFormat
from pipeline.data.dialogue import Dialogue
from pipeline.data.formats import ParseContext, chat, convlab
from pipeline.data.splits import Split, assign_splits
from pipeline.errors import DataError
from pipeline.names import one_per_name

# A format's reader: ``read(path, ctx, *, shown_as)``, the dialogues of one file, errors
# naming it ``shown_as`` (the file as declared).
Reader = Callable[..., Iterator[Dialogue]]
READERS: Mapping[SourceFormat, Reader] = one_per_name(
    SourceFormat,
    (
        (SourceFormat.CHAT_JSONL, chat.read_file),
        (SourceFormat.CONVLAB, convlab.read_file),
    ),
    "pipeline.data.declared.READERS",
)
WHOLE = "all"  # the split key of a single file holding every split


def source_key(name: str, split: str | None) -> str:
    """The params key of the declared file that holds ``split`` (None: the one file)."""
    return f"tokenize.corpora.{name}.source" + (f".splits.{split}" if split else "")


def is_local(location: str) -> bool:
    """A path or a ``file://`` URL (linked), not an ``http(s)://`` URL (fetched)."""
    return urlparse(location).scheme in ("", "file")


def local_path(location: str, root: Path) -> Path:
    """The file a local location names (a relative path is from the project ``root``)."""
    parsed = urlparse(location)
    path = Path(url2pathname(parsed.path)) if parsed.scheme == "file" else Path(location)
    return path if path.is_absolute() else root / path


def target_name(file: FileSource, split: str | None) -> str:
    """The file's name in ``data/raw/<name>/``: ``all.jsonl``, ``train.jsonl``, ``all.zip``
    (its split, and the declared file's suffix)."""
    suffix = PurePosixPath(urlparse(file.file).path).suffix or ".data"
    return f"{split or WHOLE}{suffix}"


def declared_record(root: Path | None) -> DownloadRecord:
    """The download record of the declared corpus in folder ``root``."""
    if root is None:
        raise DataError("<root>", "a declared corpus is read from its download folder")
    record = DownloadRecord.read(root / SOURCES_FILE)
    if record.declared is None:
        raise DataError(root / SOURCES_FILE, "not the download record of a declared corpus")
    return record


def read_files(root: Path | None, ctx: ParseContext) -> Iterator[tuple[str, Dialogue]]:
    """The dialogues of a declared corpus's files, file after file in file order, each with
    the split key of its file (``all``: the one file, whose dialogues carry their own split
    or are split by seed), read as they are consumed. A file without dialogues is an error
    naming it and the params key, raised once it is read."""
    record = declared_record(root)
    assert root is not None and record.declared is not None
    form = record.declared.format
    for part, file_name in record.split_files.items():
        shown = record.files[file_name].url
        key = f"{source_key(record.corpus, None if part == WHOLE else part)}.file"
        if _blank(root / file_name):
            raise _holds_none(shown, "the file is empty", key, form)
        found = 0
        for dialogue in READERS[form](root / file_name, ctx, shown_as=shown):
            found += 1
            yield part, dialogue
        if not found:
            skipped = ctx.stats.skipped.get(shown, 0)
            what = (
                f"no dialogue in the file: its {skipped} malformed records were skipped "
                "(tokenize.on_error: skip)"
                if skipped
                else "no dialogue with a turn in the file"
            )
            raise _holds_none(shown, what, key, form)


def split_by_seed(part: str, form: SourceFormat) -> bool:
    """Whether the dialogues of the file with split key ``part`` are split by the seeded
    split (one file of a format without splits of its own)."""
    return part == WHOLE and not form.traits.own_splits


def read_declared(root: Path | None, split: Split | None, ctx: ParseContext) -> Iterator[Dialogue]:
    """The dialogues of a declared corpus's download folder ``root`` (its ``SOURCES.json``
    says the format and files), of ``split`` or every split, each with ``meta["split"]``."""
    form = declared_record(root).declared.format  # type: ignore[union-attr]
    files: dict[str, list[Dialogue]] = {}
    for part, dialogue in read_files(root, ctx):
        files.setdefault(part, []).append(dialogue)
    by_split: dict[str, list[Dialogue]] = {}
    for part, dialogues in files.items():
        if part == WHOLE and form.traits.own_splits:
            for d in dialogues:
                by_split.setdefault(str(d.meta["split"]), []).append(d)
        elif split_by_seed(part, form):
            assignment = assign_splits((d.id for d in dialogues), ctx.split)
            for d in dialogues:
                by_split.setdefault(assignment[d.id].value, []).append(d)
        else:
            by_split.setdefault(part, []).extend(dialogues)
    for part in Split:
        if split is not None and part is not split:
            continue
        for d in by_split.get(part.value, []):
            yield Dialogue(d.id, d.turns, {**d.meta, "split": part.value})


def _blank(path: Path) -> bool:
    """Whether ``path`` holds nothing but whitespace (read up to its first other byte)."""
    with path.open("rb") as f:
        return not any(chunk.strip() for chunk in iter(lambda: f.read(1 << 20), b""))


def _holds_none(shown: str, what: str, key: str, form: SourceFormat) -> DataError:
    """The error of a declared file without dialogues: what is wrong, and the fix."""
    return DataError(
        shown,
        f"{what}: write its dialogues as {form.traits.layout}, or point {key} at the file "
        "that holds them",
    )
