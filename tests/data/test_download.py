"""Downloads against a real HTTP server on 127.0.0.1 (resume, 200-instead-of-206, checksum
mismatch, 404, retries), mirrors, and whole-corpus downloads from the real-corpora mirror."""

from __future__ import annotations

import hashlib
import json
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pipeline.config import DownloadParams
from pipeline.data.corpora import CorpusSpec, SourceFile
from pipeline.data.download import MIRROR_ENV, download_corpus, download_spec, fetch, sha256_file
from pipeline.data.formats import ptb
from pipeline.errors import DownloadError
from stages.check import main as check_stage
from stages.download import main as download_stage

PAYLOAD = bytes(range(256)) * 1200  # 300 KiB: several read chunks, so a cut lands mid-file
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
FAST = {"timeout": 5, "backoff": 0.0, "progress": False}  # every request bounded


@dataclass
class Route:
    payload: bytes = PAYLOAD
    status: int = 200
    cut_first: bool = False  # drop the connection half-way through the first response
    honour_range: bool = True
    fail_first: int = 0  # answer 503 this many times first
    hits: int = 0


@dataclass
class Server:
    base: str
    routes: dict[str, Route]
    log: list[tuple[str, str | None]] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"{self.base}{path}"


class _Handler(BaseHTTPRequestHandler):
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        state: Server = self.server.state  # type: ignore[attr-defined]
        state.log.append((self.path, self.headers.get("Range")))
        route = state.routes.get(self.path)
        if route is None or route.status == 404:
            self.send_error(404, "Not Found")
            return
        route.hits += 1
        if route.hits <= route.fail_first:
            self.send_error(503, "Busy")
            return
        body, status, start = route.payload, 200, 0
        range_header = self.headers.get("Range")
        if range_header and route.honour_range:
            start = int(range_header.removeprefix("bytes=").split("-")[0])
            body, status = route.payload[start:], 206
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if status == 206:
            self.send_header(
                "Content-Range", f"bytes {start}-{len(route.payload) - 1}/{len(route.payload)}"
            )
        self.end_headers()
        if route.cut_first and route.hits == 1:
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.wfile.write(body)


@pytest.fixture
def server() -> Iterator[Server]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    state = Server(f"http://127.0.0.1:{httpd.server_address[1]}", {})
    httpd.state = state  # type: ignore[attr-defined]
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_plain_download_verifies_and_leaves_no_part(server: Server, tmp_path: Path) -> None:
    server.routes["/f.bin"] = Route()
    dest = tmp_path / "f.bin"
    assert fetch(server.url("/f.bin"), dest, sha256=PAYLOAD_SHA, **FAST) == PAYLOAD_SHA
    assert dest.read_bytes() == PAYLOAD
    assert not (tmp_path / "f.bin.part").exists()


def test_resume_after_a_cut_uses_range(server: Server, tmp_path: Path) -> None:
    server.routes["/cut.bin"] = Route(cut_first=True)
    dest = tmp_path / "cut.bin"
    fetch(server.url("/cut.bin"), dest, sha256=PAYLOAD_SHA, retries=2, **FAST)
    assert dest.read_bytes() == PAYLOAD
    assert server.log == [("/cut.bin", None), ("/cut.bin", f"bytes={len(PAYLOAD) // 2}-")]


def test_server_answering_200_to_a_range_restarts(server: Server, tmp_path: Path) -> None:
    server.routes["/norange.bin"] = Route(cut_first=True, honour_range=False)
    dest = tmp_path / "norange.bin"
    fetch(server.url("/norange.bin"), dest, sha256=PAYLOAD_SHA, retries=2, **FAST)
    assert dest.read_bytes() == PAYLOAD  # not half + whole
    assert server.log[1][1] is not None  # it did ask for a range


def test_checksum_mismatch_deletes_and_names_both_digests(server: Server, tmp_path: Path) -> None:
    server.routes["/f.bin"] = Route()
    wrong = "0" * 64
    with pytest.raises(DownloadError) as err:
        fetch(server.url("/f.bin"), tmp_path / "f.bin", sha256=wrong, **FAST)
    assert wrong in str(err.value) and PAYLOAD_SHA in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_404_names_url_and_mirror_hint_without_retrying(server: Server, tmp_path: Path) -> None:
    url = server.url("/nope.zip")
    with pytest.raises(DownloadError) as err:
        fetch(url, tmp_path / "nope.zip", retries=3, **FAST)
    message = str(err.value)
    assert url in message and "404" in message
    assert MIRROR_ENV in message and "download.mirror" in message
    assert len(server.log) == 1
    assert list(tmp_path.iterdir()) == []


def test_transient_errors_are_retried_then_given_up(server: Server, tmp_path: Path) -> None:
    server.routes["/busy.bin"] = Route(fail_first=2)
    fetch(server.url("/busy.bin"), tmp_path / "busy.bin", retries=2, **FAST)
    assert len(server.log) == 3

    server.routes["/down.bin"] = Route(fail_first=100)
    with pytest.raises(DownloadError, match="after 3 attempts"):
        fetch(server.url("/down.bin"), tmp_path / "down.bin", retries=2, **FAST)


def test_unreachable_host_fails_after_bounded_attempts(tmp_path: Path) -> None:
    url = "http://127.0.0.1:9/closed.bin"  # discard port: nothing listens
    with pytest.raises(DownloadError, match=r"after 2 attempts.*HIERTX_MIRROR"):
        fetch(url, tmp_path / "closed.bin", retries=1, **FAST)


def test_mirror_folder_and_file_url(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    (mirror / "corpus").mkdir(parents=True)
    (mirror / "corpus" / "deep.bin").write_bytes(b"deep")
    (mirror / "flat.bin").write_bytes(b"flat")
    unreachable = "http://127.0.0.1:9/files"  # never contacted: the mirror has the files
    out = tmp_path / "out"
    fetch(
        f"{unreachable}/deep.bin", out / "a", mirror=mirror, mirror_path="corpus/deep.bin", **FAST
    )
    fetch(
        f"{unreachable}/flat.bin",
        out / "b",
        mirror=mirror.as_uri(),
        mirror_path="x/flat.bin",
        **FAST,
    )
    assert (out / "a").read_bytes() == b"deep"
    assert (out / "b").read_bytes() == b"flat"
    # A file:// URL is a local copy too.
    fetch(
        (mirror / "flat.bin").as_uri(),
        out / "c",
        sha256=hashlib.sha256(b"flat").hexdigest(),
        **FAST,
    )
    assert (out / "c").read_bytes() == b"flat"


def test_mirror_miss_falls_back_to_the_url(server: Server, tmp_path: Path) -> None:
    server.routes["/f.bin"] = Route()
    (tmp_path / "mirror").mkdir()
    fetch(
        server.url("/f.bin"),
        tmp_path / "f.bin",
        sha256=PAYLOAD_SHA,
        mirror=tmp_path / "mirror",
        **FAST,
    )
    assert len(server.log) == 1
    with pytest.raises(DownloadError, match="the mirror had none of"):
        fetch(server.url("/gone.bin"), tmp_path / "g.bin", mirror=tmp_path / "mirror", **FAST)


def test_bad_mirror_copy_is_a_checksum_error(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "f.bin").write_bytes(b"tampered")
    with pytest.raises(DownloadError, match="checksum mismatch"):
        fetch(
            "http://127.0.0.1:9/f.bin",
            tmp_path / "out" / "f.bin",
            sha256=PAYLOAD_SHA,
            mirror=tmp_path / "m",
            **FAST,
        )
    assert list((tmp_path / "out").iterdir()) == []


def _manifest(shared: Path) -> dict[str, str]:
    rows = [line.split("\t") for line in (shared / "MANIFEST.tsv").read_text().splitlines()[1:]]
    return {row[0]: row[2] for row in rows}


def test_download_ptb_from_the_real_mirror(shared_data: Path, tmp_path: Path) -> None:
    params = DownloadParams(mirror=str(shared_data))
    folder = download_corpus("ptb", tmp_path / "raw", params, progress=False)
    assert folder == tmp_path / "raw" / "ptb"
    sources = json.loads((folder / "SOURCES.json").read_text())
    manifest = _manifest(shared_data)
    for part in ("train", "valid", "test"):
        entry = sources["files"][f"ptb.{part}.txt"]
        assert (
            entry["sha256"]
            == manifest[f"ptb/ptb.{part}.txt"]
            == sha256_file(folder / f"ptb.{part}.txt")
        )
        assert entry["pinned"] is True
        assert entry["bytes"] == (shared_data / "ptb" / f"ptb.{part}.txt").stat().st_size

    # A rerun skips verified files; a corrupted one is fetched again.
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.glob("ptb.*.txt")}
    (folder / "ptb.test.txt").write_text("corrupt")
    download_corpus("ptb", tmp_path / "raw", params, progress=False)
    assert (folder / "ptb.train.txt").stat().st_mtime_ns == stamps["ptb.train.txt"]
    assert sha256_file(folder / "ptb.test.txt") == manifest["ptb/ptb.test.txt"]


def test_mirror_env_overrides_the_param(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(MIRROR_ENV, shared_data.as_uri())
    spec = CorpusSpec(
        "ptb-valid",
        ptb.read,
        (SourceFile("http://127.0.0.1:9/data/ptb.valid.txt", None, "ptb/ptb.valid.txt"),),
        "one PTB file",
    )
    params = DownloadParams(mirror=str(empty), retries=0, timeout_s=5)
    with pytest.warns(UserWarning, match="trusting it on first use"):
        folder = download_spec(spec, tmp_path / "raw", params, progress=False)
    assert (folder / "ptb.valid.txt").read_bytes() == (
        shared_data / "ptb" / "ptb.valid.txt"
    ).read_bytes()


def test_trust_on_first_use_records_extracts_and_then_verifies(
    server: Server, tmp_path: Path
) -> None:
    archive = tmp_path / "corpus.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("corpus/data.txt", "hello")
    server.routes["/corpus.zip"] = Route(payload=archive.read_bytes())
    spec = CorpusSpec(
        "toy",
        ptb.read,
        (SourceFile(server.url("/corpus.zip"), None, "toy/corpus.zip", extract=True),),
        "toy",
    )
    params = DownloadParams(retries=0, timeout_s=5)
    raw = tmp_path / "raw"
    with pytest.warns(UserWarning, match="no pinned sha256"):
        folder = download_spec(spec, raw, params, progress=False)
    assert (folder / "corpus" / "data.txt").read_text() == "hello"
    entry = json.loads((folder / "SOURCES.json").read_text())["files"]["corpus.zip"]
    assert entry["sha256"] == sha256_file(archive) and entry["pinned"] is False
    assert entry["extracted"] == ["corpus"]

    download_spec(spec, raw, params, progress=False)  # present and verified: no request
    assert len(server.log) == 1

    # Upstream changed: the recorded digest catches it.
    (folder / "corpus.zip").unlink()
    server.routes["/corpus.zip"] = Route(payload=b"something else")
    with pytest.raises(
        DownloadError, match=r"(?s)corpus 'toy': 1 of 1 files failed.*checksum mismatch"
    ):
        download_spec(spec, raw, params, progress=False)


def test_chitchat_copies_the_package_file(tmp_path: Path) -> None:
    folder = download_corpus("chitchat", tmp_path, DownloadParams(), progress=False)
    sources = json.loads((folder / "SOURCES.json").read_text())
    entry = sources["files"]["dataset.json"]
    assert entry["url"].startswith("pypi:chitchat-dataset==")
    assert entry["sha256"] == sha256_file(folder / "dataset.json")
    assert sources["package"] == "chitchat-dataset"


def test_stage_downloads_ptb(
    shared_data: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # the stages' data/sources/ is in the working folder
    params = tmp_path / "params.yaml"
    raw = {
        "corpora": ["ptb"],
        "download": {"mirror": str(shared_data)},
        "tokenize": {"corpora": {"ptb": {}}},
    }
    params.write_text(yaml.safe_dump(raw))
    download = ["ptb", "--params", str(params), "--out", str(tmp_path / "raw")]
    # the corpus's source is the check stage's record: without it, nothing is fetched
    assert download_stage(download) == 1
    assert "data/sources/ptb.json: missing: run the check stage" in capsys.readouterr().err
    assert not (tmp_path / "raw").exists()
    assert check_stage(["--params", str(params)]) == 0
    capsys.readouterr()
    assert download_stage(download) == 0
    assert "ptb: 3 files" in capsys.readouterr().out
    assert download_stage(["ptb", "--params", str(tmp_path / "missing.yaml")]) == 1
    assert "not found" in capsys.readouterr().err


def test_corpus_download_reports_every_failed_file(server: Server, tmp_path: Path) -> None:
    server.routes["/ok.txt"] = Route(payload=b"fine")
    files = tuple(
        SourceFile(server.url(f"/{name}"), None, f"toy/{name}")
        for name in ("a.txt", "ok.txt", "b.txt")
    )
    spec = CorpusSpec("toy", ptb.read, files, "toy")
    with pytest.warns(UserWarning), pytest.raises(DownloadError) as err:
        download_spec(spec, tmp_path, DownloadParams(retries=0, timeout_s=5), progress=False)
    message = str(err.value)
    assert "2 of 3 files failed" in message
    assert server.url("/a.txt") in message and server.url("/b.txt") in message
    sources = json.loads((tmp_path / "toy" / "SOURCES.json").read_text())
    assert list(sources["files"]) == ["ok.txt"]  # what did arrive is recorded


def test_skipped_splits_are_not_fetched(server: Server, tmp_path: Path) -> None:
    server.routes["/valid.txt"] = Route(payload=b"v")
    files = tuple(
        SourceFile(server.url(f"/{part}.txt"), None, f"toy/{part}.txt", split=part)
        for part in ("train", "valid")
    )
    params = DownloadParams.model_validate({"retries": 0, "skip": {"chitchat": ["train"]}})
    spec = CorpusSpec("chitchat", ptb.read, files, "a corpus with a file per split")
    with pytest.warns(UserWarning, match="trusting it on first use"):
        folder = download_spec(spec, tmp_path, params, progress=False)
    assert sorted(p.name for p in folder.glob("*.txt")) == ["valid.txt"]
    assert [path for path, _ in server.log] == ["/valid.txt"]
