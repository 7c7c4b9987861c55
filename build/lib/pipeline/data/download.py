"""Fetching corpus files: from a local mirror or over HTTP(S), resumable and verified.

``fetch`` gets one file: a mirror (a folder or ``file://`` URL laid out like the test
mirror) is searched first, then the URL is streamed into ``<dest>.part`` with retries and
exponential backoff, resuming a cut transfer with a ``Range`` request (a server that
answers 200 instead of 206 is read from the start). The sha256 is checked before the
file is renamed into place, so ``dest`` only ever holds a complete, verified file.

``download_corpus`` fetches and extracts every file of a registry corpus into
``<dest_dir>/<corpus>/`` and writes ``SOURCES.json`` (url, sha256, bytes per file). A
mirror comes from the ``download.mirror`` param or the ``HIERTX_MIRROR`` environment
variable, which overrides it. Files without a pinned sha256 are trusted on first use:
their digest is recorded in ``SOURCES.json`` (with a warning) and later fetches must match.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse
from urllib.request import url2pathname

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from pipeline.artifacts import SOURCES_FILE, DownloadRecord, VerifiedFile
from pipeline.config import CorpusSource, DownloadParams, FileSource
from pipeline.data import declared
from pipeline.data.archive import extract
from pipeline.data.corpora import CorpusSpec, SourceFile, corpus_spec
from pipeline.errors import DataError, DownloadError

MIRROR_ENV = "HIERTX_MIRROR"
_CHUNK = 1 << 16
# Client errors other than these will not go away by asking again.
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_USER_AGENT = "hiertx-download/0.1"


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _mirror_hint(url: str) -> str:
    name = PurePosixPath(urlparse(url).path).name
    return (
        f"If this machine cannot reach it, put {name} in a mirror folder (laid out like "
        f"the test mirror, or flat) and set download.mirror in params.yaml or the "
        f"environment variable {MIRROR_ENV} (which overrides the param) to that folder "
        f"or a file:// URL."
    )


def _mirror_dir(mirror: str | Path) -> Path:
    text = str(mirror)
    if text.startswith("file:"):
        return Path(url2pathname(urlparse(text).path))
    return Path(text)


def mirror_candidates(mirror: str | Path, url: str, mirror_path: str | None) -> list[Path]:
    """Where a mirror may hold the file of ``url``: ``<mirror>/<mirror_path>``, then
    ``<mirror>/<file name>``."""
    root = _mirror_dir(mirror)
    names = [mirror_path] if mirror_path else []
    names.append(PurePosixPath(urlparse(url).path).name)
    return [root / name for name in names]


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Progress]:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=True, disable=not enabled) as progress:
        yield progress


class _Incomplete(Exception):
    """A transfer ended early; the ``.part`` file keeps what came."""


def _stream_once(url: str, part: Path, timeout: float, progress: Progress) -> None:
    """One request: append to ``part`` from where it stops (or restart on a 200).

    Raises ``_Incomplete`` when the connection ends before the announced length.
    """
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": _USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        resumed = offset > 0 and response.status == 206
        if resumed and not response.headers.get("Content-Range", "").startswith(f"bytes {offset}-"):
            part.unlink()
            raise _Incomplete("the server resumed at another offset; starting over")
        if not resumed:
            offset = 0  # the server ignored the Range: start over
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length is not None else None
        task = progress.add_task(
            PurePosixPath(urlparse(url).path).name, total=total, completed=offset
        )
        received = offset
        try:
            with part.open("ab" if resumed else "wb") as f:
                while chunk := response.read(_CHUNK):
                    f.write(chunk)
                    received += len(chunk)
                    progress.update(task, completed=received)
        finally:
            progress.remove_task(task)
    if total is not None and received < total:
        raise _Incomplete(f"connection closed after {received} of {total} bytes")


def _http_fetch(
    url: str, part: Path, retries: int, timeout: float, backoff: float, progress: bool
) -> None:
    attempts = retries + 1
    last = ""
    with _progress_bar(progress) as bar:
        for attempt in range(attempts):
            if attempt:
                time.sleep(backoff * 2 ** (attempt - 1))
            try:
                _stream_once(url, part, timeout, bar)
                return
            except urllib.error.HTTPError as err:
                last = f"HTTP {err.code} {err.reason}"
                if err.code == 416:  # our .part is not a prefix the server knows: start over
                    part.unlink(missing_ok=True)
                elif err.code not in _RETRY_STATUS:
                    raise DownloadError(
                        f"cannot download {url}: {last}. {_mirror_hint(url)}"
                    ) from None
            except (urllib.error.URLError, http.client.HTTPException, OSError, _Incomplete) as err:
                last = str(getattr(err, "reason", None) or err) or type(err).__name__
    raise DownloadError(
        f"cannot download {url} after {attempts} attempts (last: {last}). {_mirror_hint(url)}"
    )


def fetch(
    url: str,
    dest: str | Path,
    sha256: str | None = None,
    mirror: str | Path | None = None,
    retries: int = 4,
    timeout: float = 60,
    progress: bool = True,
    *,
    mirror_path: str | None = None,
    backoff: float = 1.0,
) -> str:
    """Fetch ``url`` to ``dest`` and return the file's sha256 (hex).

    With ``mirror``, ``<mirror>/<mirror_path>`` then ``<mirror>/<file name>`` are tried
    first; ``file://`` URLs are copied. Otherwise HTTP(S) with ``retries`` retries
    (``backoff``, ``2*backoff``, ... seconds apart) and a ``timeout`` per request.
    A digest other than ``sha256`` deletes the download and raises ``DownloadError``
    naming both digests; so does a URL that cannot be fetched, with the mirror hint.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    searched = mirror_candidates(mirror, url, mirror_path) if mirror is not None else []
    found = next((p for p in searched if p.is_file()), None)
    scheme = urlparse(url).scheme
    if found is None and scheme == "file":
        found = Path(url2pathname(urlparse(url).path))
        if not found.is_file():
            raise DownloadError(f"cannot download {url}: no such file")
    if found is not None:
        shutil.copyfile(found, part)
    elif scheme in ("http", "https"):
        try:
            _http_fetch(url, part, retries, timeout, backoff, progress)
        except DownloadError as err:
            if searched:
                tried = ", ".join(str(p) for p in searched)
                raise DownloadError(f"{err} (the mirror had none of: {tried})") from None
            raise
    else:
        raise DownloadError(f"cannot download {url}: unsupported URL scheme {scheme!r}")
    actual = sha256_file(part)
    if sha256 is not None and actual != sha256.lower():
        part.unlink()
        source = found or url
        raise DownloadError(
            f"checksum mismatch for {source}: expected sha256 {sha256.lower()}, got {actual}; "
            f"the partial file was deleted. The source changed or is corrupt: fetch it again "
            f"or check the mirror copy."
        )
    os.replace(part, dest)
    return actual


# --------------------------------------------------------------------------- corpora


def _read_sources(folder: Path) -> dict[str, VerifiedFile]:
    """What an earlier run verified; nothing (so every file is checked again) when the
    record is absent or unreadable."""
    path = folder / SOURCES_FILE
    if not path.is_file():
        return {}
    try:
        return dict(DownloadRecord.read(path).files)
    except DataError as err:
        warnings.warn(f"{err}; re-verifying every file", stacklevel=3)
        return {}


def resolve_mirror(params: DownloadParams) -> str | None:
    """The mirror to use: ``$HIERTX_MIRROR`` if set, else the ``download.mirror`` param."""
    return os.environ.get(MIRROR_ENV) or params.mirror


def _fetch_source(
    file: SourceFile,
    folder: Path,
    recorded: VerifiedFile | None,
    params: DownloadParams,
    progress: bool,
) -> VerifiedFile:
    dest = folder / file.path
    tofu = recorded.sha256 if recorded and recorded.url == file.url else None
    expected = file.sha256 or tofu
    fresh = False
    if not (dest.is_file() and expected is not None and sha256_file(dest) == expected.lower()):
        if expected is None:
            warnings.warn(
                f"{file.url} has no pinned sha256: trusting it on first use and recording its "
                f"digest in {folder / SOURCES_FILE}",
                stacklevel=4,
            )
        fetch(
            file.url,
            dest,
            sha256=expected,
            mirror=resolve_mirror(params),
            retries=params.retries,
            timeout=params.timeout_s,
            progress=progress,
            mirror_path=file.mirror_path,
        )
        fresh = True
    digest = expected.lower() if expected else sha256_file(dest)
    extracted: tuple[str, ...] = ()
    if file.extract:
        previous = tuple(recorded.extracted) if recorded and not fresh else ()
        if previous and all((dest.parent / name).exists() for name in previous):
            extracted = previous
        else:
            extracted = tuple(extract(dest, dest.parent))
    return VerifiedFile(
        url=file.url,
        sha256=digest,
        bytes=dest.stat().st_size,
        pinned=file.sha256 is not None,
        extracted=list(extracted),
    )


def _copy_bundled(spec: CorpusSpec, folder: Path) -> dict[str, VerifiedFile]:
    assert spec.bundled is not None
    source = spec.bundled()
    dest = folder / source.name
    digest = sha256_file(source)
    if not (dest.is_file() and sha256_file(dest) == digest):
        part = dest.with_name(dest.name + ".part")
        shutil.copyfile(source, part)
        os.replace(part, dest)
    version = metadata.version(spec.package) if spec.package else "unknown"
    url = f"pypi:{spec.package}=={version}"
    return {
        source.name: VerifiedFile(url=url, sha256=digest, bytes=dest.stat().st_size, pinned=True)
    }


def download_spec(
    spec: CorpusSpec,
    dest_dir: str | Path,
    params: DownloadParams,
    progress: bool = True,
    root: str | Path = ".",
) -> Path:
    """``download_corpus`` for a spec that need not be in the registry (``root``: the
    project, which a declared corpus's relative paths start from)."""
    folder = Path(dest_dir) / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    record = DownloadRecord(corpus=spec.name, package=spec.package)
    if spec.declared is not None:
        files, split_files = _declared_files(spec, folder, params, progress, Path(root))
        record = record.model_copy(update={"declared": spec.declared, "split_files": split_files})
    elif spec.bundled is not None:
        files = _copy_bundled(spec, folder)
    else:
        recorded = _read_sources(folder)
        files = dict(recorded)
        failures: list[str] = []
        skipped = set(params.skip.get(spec.name, ()))
        for file in spec.files:
            if file.split in skipped:
                continue
            # Go on past a failure, so an offline user learns every missing file at once.
            try:
                verified = _fetch_source(file, folder, recorded.get(file.path), params, progress)
            except DownloadError as err:
                failures.append(str(err))
                continue
            files[file.path] = verified
            # Written after each file, so an interrupted run keeps what it verified.
            record.model_copy(update={"files": files}).write(folder / SOURCES_FILE)
        if failures:
            listed = "".join(f"\n  - {failure}" for failure in failures)
            count = f"{len(failures)} of {len(spec.files)}"
            raise DownloadError(f"corpus {spec.name!r}: {count} files failed:{listed}")
    record.model_copy(update={"files": files}).write(folder / SOURCES_FILE)
    return folder


def link_local(
    name: str, split: str | None, file: FileSource, folder: Path, root: Path
) -> VerifiedFile:
    """Link ``folder/<target>`` to a declared local file and verify it (module docstring)."""
    where = declared.source_key(name, split)
    path = declared.local_path(file.file, root)
    if not path.is_file():
        raise DownloadError(f"{where}.file: no such file {path} (relative paths are from {root})")
    actual = sha256_file(path)
    if file.sha256 is not None and actual != file.sha256:
        raise DownloadError(
            f"{where}.sha256: {file.file} has sha256 {actual}, not the declared {file.sha256}: "
            "the file changed; update the sha256 if the change is yours"
        )
    resolved = path.resolve()
    inside = resolved.is_relative_to(root.resolve())
    target = os.path.relpath(resolved, folder.resolve()) if inside else str(resolved)
    link = folder / declared.target_name(file, split)
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    return VerifiedFile(
        url=file.file, sha256=actual, bytes=path.stat().st_size, pinned=file.sha256 is not None
    )


def _declared_files(
    spec: CorpusSpec, folder: Path, params: DownloadParams, progress: bool, root: Path
) -> tuple[dict[str, VerifiedFile], dict[str, str]]:
    """A declared corpus's files: local ones linked, URLs fetched (``data.declared``);
    and which file holds which split."""
    recorded = _read_sources(folder)
    files: dict[str, VerifiedFile] = {}
    split_files: dict[str, str] = {}
    for file in spec.files:
        if declared.is_local(file.url):
            source = FileSource(file=file.url, sha256=file.sha256)
            files[file.path] = link_local(spec.name, file.split, source, folder, root)
        else:
            files[file.path] = _fetch_source(
                file, folder, recorded.get(file.path), params, progress
            )
        split_files[file.split or declared.WHOLE] = file.path
    return files, split_files


def download_corpus(
    name: str,
    dest_dir: str | Path,
    params: DownloadParams,
    progress: bool = True,
    source: CorpusSource | None = None,
) -> Path:
    """Fetch, verify and extract every file of corpus ``name`` into ``<dest_dir>/<name>/``
    (``source``: its declaration, for a corpus of one's own; relative paths in it are from
    the working folder, the project root where stages run).

    Files already there and matching their (pinned or recorded) sha256 are not fetched
    again. ``chitchat`` copies the installed package's ``dataset.json`` (no network).
    Returns the corpus folder, which ``read_corpus(name, root=...)`` reads.
    """
    return download_spec(corpus_spec(name, source), dest_dir, params, progress)
