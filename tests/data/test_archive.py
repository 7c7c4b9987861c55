"""Archive extraction: zip and tar unpack atomically; unsafe members are refused and nothing
is written outside (or, on refusal, inside) the target."""

from __future__ import annotations

import io
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from pipeline.data.archive import extract
from pipeline.errors import DataError


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _tar(path: Path, members: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> Path:
    data = data or {}
    with tarfile.open(path, "w:gz") as tf:
        for info in members:
            payload = data.get(info.name)
            if payload is not None:
                info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload) if payload is not None else None)
    return path


def _file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def _snapshot(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_zip_and_tar_extract_into_a_new_target(tmp_path: Path) -> None:
    archive = _zip(
        tmp_path / "a.zip", {"corpus/x.txt": b"x", "corpus/sub/y.txt": b"y", "top.txt": b"t"}
    )
    assert extract(archive, tmp_path / "out") == ["corpus", "top.txt"]
    assert (tmp_path / "out" / "corpus" / "sub" / "y.txt").read_bytes() == b"y"

    inner_link = _link("d/link.txt", "x.txt")  # a link that stays inside is fine
    tar = _tar(tmp_path / "b.tgz", [_file("d/x.txt"), inner_link], {"d/x.txt": b"hello"})
    assert extract(tar, tmp_path / "out2") == ["d"]
    assert (tmp_path / "out2" / "d" / "link.txt").read_bytes() == b"hello"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_existing_target_keeps_other_entries_and_replaces_same_names(tmp_path: Path) -> None:
    target = tmp_path / "raw"
    (target / "corpus").mkdir(parents=True)
    (target / "corpus" / "stale.txt").write_text("old")
    (target / "keep.txt").write_text("keep")
    archive = _zip(tmp_path / "a.zip", {"corpus/new.txt": b"new"})
    extract(archive, target)
    assert (target / "keep.txt").read_text() == "keep"
    assert (target / "corpus" / "new.txt").read_bytes() == b"new"
    assert not (target / "corpus" / "stale.txt").exists()
    assert _snapshot(target) == {"keep.txt", "corpus", "corpus/new.txt"}


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ({"ok.txt": b"1", "../evil.txt": b"x"}, "'..'"),
        ({"a/../../evil.txt": b"x"}, "'..'"),
        ({"/tmp/hiertx-evil.txt": b"x"}, "absolute"),
    ],
)
def test_malicious_zip_is_refused(tmp_path: Path, members: dict[str, bytes], reason: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    archive = _zip(work / "bad.zip", members)
    with pytest.raises(DataError, match=reason) as err:
        extract(archive, work / "out")
    assert "bad.zip" in str(err.value)
    assert _snapshot(tmp_path) == {"work", "work/bad.zip"}
    assert not Path("/tmp/hiertx-evil.txt").exists()


def test_zip_symlink_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "link.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        info = zipfile.ZipInfo("link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "../../outside")
    with pytest.raises(DataError, match="symbolic link"):
        extract(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ([_file("../evil.txt")], "'..'"),
        ([_file("/tmp/hiertx-evil.txt")], "absolute"),
        ([_link("link", "../../outside")], "leaves target"),
        ([_link("d/link", "../../outside")], "leaves target"),
        ([_link("link", "/etc/passwd")], "leaves target"),
        ([_file("x.txt"), _link("hard", "../x.txt", tarfile.LNKTYPE)], "hard link"),
        ([_link("dev", "", tarfile.CHRTYPE)], "device"),
        ([_link("fifo", "", tarfile.FIFOTYPE)], "device"),
    ],
)
def test_malicious_tar_is_refused(
    tmp_path: Path, members: list[tarfile.TarInfo], reason: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    archive = _tar(work / "bad.tar.gz", members, {"x.txt": b"x", "../evil.txt": b"x"})
    with pytest.raises(DataError, match=reason):
        extract(archive, work / "out")
    assert _snapshot(tmp_path) == {"work", "work/bad.tar.gz"}
    assert not Path("/tmp/hiertx-evil.txt").exists()


def test_symlink_then_write_through_it_is_refused(tmp_path: Path) -> None:
    # The classic two-step escape: a link to the outside, then a file "inside" the link.
    archive = _tar(
        tmp_path / "two.tgz", [_link("esc", ".."), _file("esc/evil.txt")], {"esc/evil.txt": b"x"}
    )
    with pytest.raises(DataError, match="leaves target"):
        extract(archive, tmp_path / "out" / "deeper")
    assert not (tmp_path / "out" / "evil.txt").exists()


def test_not_an_archive(tmp_path: Path) -> None:
    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"this is not an archive" * 10)
    with pytest.raises(DataError, match="not a zip or tar archive"):
        extract(junk, tmp_path / "out")
    assert _snapshot(tmp_path) == {"junk.zip"}
