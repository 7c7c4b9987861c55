"""Safe, atomic extraction of downloaded zip and tar(.gz) archives.

Every member is checked before anything is written: absolute paths, ``..`` components,
links leaving the target, device files and FIFOs are refused (zip symlinks are refused
outright: zipfile would write them as plain files). Members are unpacked into a fresh
temporary folder beside the target and moved into place only when all of them are out,
so a failure leaves the target as it was and nothing is ever written outside it.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
import zipfile
from pathlib import Path

from pipeline.errors import DataError


def _check_name(archive: Path, name: str) -> None:
    """Refuse member names that could land outside the extraction folder."""
    normalized = name.replace("\\", "/")
    if normalized.startswith("/") or (len(normalized) > 1 and normalized[1] == ":"):
        raise DataError(archive, f"refusing member {name!r}: absolute path")
    if ".." in normalized.split("/"):
        raise DataError(archive, f"refusing member {name!r}: '..' in its path")


def _inside(link_target: str) -> bool:
    """Whether a path relative to the extraction root stays inside it (lexically)."""
    normalized = posixpath.normpath(link_target)
    return not (posixpath.isabs(normalized) or normalized == ".." or normalized.startswith("../"))


def _extract_zip(archive: Path, into: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        members = zf.infolist()
        for info in members:
            _check_name(archive, info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise DataError(archive, f"refusing member {info.filename!r}: symbolic link")
        for info in members:
            zf.extract(info, into)


def _extract_tar(archive: Path, into: Path) -> None:
    with tarfile.open(archive) as tf:
        members = tf.getmembers()
        for member in members:
            _check_name(archive, member.name)
            if member.issym():
                target = posixpath.join(posixpath.dirname(member.name), member.linkname)
                if posixpath.isabs(member.linkname) or not _inside(target):
                    raise DataError(
                        archive,
                        f"refusing symlink {member.name!r} -> {member.linkname!r}: leaves target",
                    )
            elif member.islnk():
                if posixpath.isabs(member.linkname) or not _inside(member.linkname):
                    raise DataError(
                        archive,
                        f"refusing hard link {member.name!r} -> {member.linkname!r}: leaves target",
                    )
            elif not (member.isfile() or member.isdir()):
                raise DataError(archive, f"refusing member {member.name!r}: device file or FIFO")
        if hasattr(tarfile, "data_filter"):
            # The "data" filter (Python >= 3.11.4, PEP 706) re-checks every member against
            # the real file system.
            tf.extractall(into, members=members, filter="data")
        else:  # an older 3.11: the member checks above are the defence
            tf.extractall(into, members=members)


def _escaping_links(root: Path) -> list[str]:
    real_root = root.resolve()
    return [
        str(path.relative_to(root))
        for path in root.rglob("*")
        if path.is_symlink() and not path.resolve().is_relative_to(real_root)
    ]


def _move_into(source: Path, target: Path) -> None:
    """Move each top-level entry of ``source`` into the existing ``target``, replacing it."""
    for entry in sorted(source.iterdir()):
        destination = target / entry.name
        if destination.is_dir() and not destination.is_symlink():
            # os.replace cannot overwrite a non-empty folder: swap it out, then delete it.
            stale = Path(tempfile.mkdtemp(prefix=f".{entry.name}.old.", dir=target))
            os.replace(destination, stale / entry.name)
            os.replace(entry, destination)
            shutil.rmtree(stale)
        else:
            os.replace(entry, destination)


def extract(archive: str | Path, target: str | Path) -> list[str]:
    """Unpack a zip or tar(.gz/.bz2/.xz) ``archive`` into the folder ``target``.

    ``target`` is created if missing; top-level entries already in it that the archive
    also holds are replaced. Returns the archive's top-level entry names. Raises
    ``DataError`` (naming the archive and member) for an unsafe or unreadable archive.
    """
    archive, target = Path(archive), Path(target)
    if not archive.is_file():
        raise DataError(archive, "no such archive")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.extract.", dir=target.parent))
    try:
        if zipfile.is_zipfile(archive):
            _extract_zip(archive, staging)
        elif tarfile.is_tarfile(archive):
            _extract_tar(archive, staging)
        else:
            raise DataError(archive, "not a zip or tar archive")
        escaping = _escaping_links(staging)
        if escaping:
            raise DataError(archive, f"refusing links that leave the target: {escaping}")
        entries = sorted(p.name for p in staging.iterdir())
        if target.exists():
            _move_into(staging, target)
        else:
            os.replace(staging, target)
        return entries
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as err:
        raise DataError(archive, f"cannot extract: {err}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
