"""Results that outlive the cluster: ``python -m pipeline results push|pull|check [URL]``.

A run on a cluster leaves everything on the head's disk, which ``ray down`` (or KubeRay's
pod deletion) removes. ``push``, run in the project after ``make repro``, puts it in a
bucket the user owns, at ``URL`` (``s3://bucket/prefix``, ``gs://...``, or a local path;
default ``$HIERTX_RESULTS_URL``):

- ``URL/dvc/``: a DVC remote (``hiertx-results``, configured with ``dvc remote add
  --local``: in the git-ignored ``.dvc/config.local``, never committed) holding every
  DVC-cached output, weights included, sent by ``dvc push``;
- ``URL/results.tar.gz``: the bundle, one object holding what DVC does not cache:
  ``dvc.lock``, ``params.yaml``, every ``cache: false`` output of the stages (metrics,
  plots, the report, the downloaded corpora), the results document ``report.results``
  names (with its figures) and the MLflow stores the run wrote in the project (the
  fallback store ``runs/mlflow-fallback``, and ``mlflow.db`` with its ``mlartifacts/``
  where no server was configured). Its first member, ``MANIFEST``, records the git commit
  the run was made from, the tracked files that differed from it, and each file's sha256.

``pull``, in a clone of the project at that commit, fetches the bundle, checks the commit
(and each file's hash), lays the files down, runs ``dvc pull`` from the remote, and replays
the MLflow runs into ``$MLFLOW_TRACKING_URI`` (or the project's ``mlflow.db``) with
``sync-mlflow`` (:mod:`pipeline.tracking.sync`). ``check`` refuses, before a run starts,
what would make the push fail hours later: a URL no filesystem opens, a bucket that does
not exist or cannot be read, a scheme DVC has no plugin for.

The DVC objects go first and the bundle last, so a bundle in the bucket always has its
outputs there; the bundle is written as one object, so an interrupted push leaves the
previous bundle (or none), never part of one.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, DataError
from pipeline.tracking import store, sync

COMMAND = "results"
URL_ENV = "HIERTX_RESULTS_URL"
REMOTE = "hiertx-results"  # the DVC remote's name, in .dvc/config.local
BUNDLE = "results.tar.gz"
DVC_FOLDER = "dvc"
MANIFEST = "MANIFEST"  # the bundle's first member
MANIFEST_FORMAT = 1
# Where a custom S3 endpoint comes from (botocore's variables; a local S3 server, MinIO)
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# The DVC plugin each bucket scheme needs: (module, package to install)
DVC_PLUGINS = {"s3": ("dvc_s3", "dvc-s3"), "gs": ("dvc_gs", "dvc-gs"), "gcs": ("dvc_gs", "dvc-gs")}
PROJECT_STORE = ("mlflow.db", store.ARTIFACT_DIR)  # the default local tracking store
ALWAYS = ("dvc.lock", "params.yaml")


@dataclass(frozen=True)
class Place:
    """Where a project's results live: ``url``, opened with pyarrow's filesystem."""

    url: str
    fs: Any  # pyarrow.fs.FileSystem
    path: str  # ``url`` as a path of ``fs`` (bucket/prefix for a bucket)
    scheme: str  # "s3", "gs", ... or "" for a local path

    @property
    def dvc_url(self) -> str:
        return f"{self.url}/{DVC_FOLDER}"

    @property
    def bundle_url(self) -> str:
        return f"{self.url}/{BUNDLE}"

    @property
    def bundle_path(self) -> str:
        return f"{self.path}/{BUNDLE}"


def results_url(url: str | None) -> str:
    """``url``, else ``$HIERTX_RESULTS_URL``; neither is an error saying what to give."""
    chosen = (url or os.environ.get(URL_ENV, "")).strip()
    if not chosen:
        raise ConfigError(
            URL_ENV,
            "no results URL: give one (python -m pipeline results push s3://BUCKET/PREFIX) "
            f"or set {URL_ENV}",
        )
    return chosen.rstrip("/")


def open_place(url: str, create: bool = False) -> Place:
    """``url`` opened and checked: its filesystem opens it, its bucket exists, DVC has the
    plugin for its scheme. ``create``: a local folder is made if missing (a bucket never
    is: whose it is, where and what it costs is the user's choice)."""
    import pyarrow.fs

    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "file":
        url, scheme = url.removeprefix("file://"), ""
    if not scheme:
        url = str(Path(url).expanduser().resolve())
    try:
        fs, path = pyarrow.fs.FileSystem.from_uri(url)
    except (ValueError, OSError) as err:
        raise ConfigError(
            URL_ENV,
            f"cannot open {url}: {err}. Give a bucket URL (s3://BUCKET/PREFIX, "
            "gs://BUCKET/PREFIX) or a local folder",
        ) from None
    path = path.rstrip("/")
    place = Place(url, fs, path, scheme)
    if scheme:
        _check_plugin(place)
        _check_bucket(place)
    elif create:
        Path(path).mkdir(parents=True, exist_ok=True)
    return place


def _check_plugin(place: Place) -> None:
    import importlib.util

    module, package = DVC_PLUGINS.get(place.scheme, (None, None))
    if module is None:
        raise ConfigError(
            URL_ENV,
            f"{place.url}: hiertx keeps DVC remotes on s3:// or gs:// buckets or local "
            f"folders, not {place.scheme}://",
        )
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            URL_ENV,
            f"{place.url}: DVC needs its {package} plugin for {place.scheme}:// remotes: "
            f"pip install {package}",
        )


def _check_bucket(place: Place) -> None:
    import pyarrow.fs

    bucket = place.path.split("/", 1)[0]
    try:
        info = place.fs.get_file_info(bucket)
    except OSError as err:
        raise ConfigError(
            URL_ENV, f"cannot reach bucket {bucket} of {place.url}: {err}. Check the credentials"
        ) from None
    if info.type == pyarrow.fs.FileType.NotFound:
        raise ConfigError(
            URL_ENV,
            f"bucket {bucket} of {place.url} does not exist (or these credentials cannot see "
            f"it): create it first ({place.scheme}://{bucket}), or give another",
        )


# --------------------------------------------------------------------------- git and DVC


def git_commit(root: Path) -> str:
    """The commit the project's clone is at (``HEAD``)."""
    from scmrepo.exceptions import SCMError
    from scmrepo.git import Git

    try:
        with Git(str(root)) as scm:
            return str(scm.get_rev())
    except SCMError as err:
        raise DataError(root, f"not a git clone with a commit ({err})") from None


def changed_files(root: Path) -> list[str]:
    """Tracked files that differ from ``HEAD`` (staged or not)."""
    from scmrepo.git import Git

    with Git(str(root)) as scm:
        staged, unstaged, _ = scm.status(untracked_files="no")
    paths = set(unstaged)
    for group in staged.values():
        paths.update(group)
    return sorted(paths)


def dvc(root: Path, *args: str) -> None:
    """``dvc ARGS`` in ``root`` with this Python's DVC (its plugins), output shown."""
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root)
    if done.returncode != 0:
        raise DataError(root, f"dvc {' '.join(args)} failed (exit {done.returncode}; above)")


def configure_remote(root: Path, place: Place) -> None:
    """The ``hiertx-results`` remote at ``URL/dvc`` in ``.dvc/config.local`` (git-ignored:
    a cluster's project stays as git has it), with a custom S3 endpoint where botocore's
    variables name one. Credentials stay where the cloud's tools keep them."""
    dvc(root, "remote", "add", "--local", "--force", REMOTE, place.dvc_url)
    endpoint = next((os.environ[v] for v in ENDPOINT_ENVS if os.environ.get(v)), None)
    if place.scheme == "s3" and endpoint:
        dvc(root, "remote", "modify", "--local", REMOTE, "endpointurl", endpoint)


def uncached_outputs(root: Path) -> list[str]:
    """Every file of every ``cache: false`` output of the project's stages that exists,
    relative to ``root``: what ``dvc push`` leaves out."""
    from dvc.repo import Repo

    found: set[str] = set()
    with Repo(str(root)) as repo:
        for stage in repo.index.stages:
            for out in stage.outs:
                if out.use_cache:
                    continue
                found.update(_files(root, Path(out.fs_path)))
    return sorted(found)


def _files(root: Path, path: Path) -> Iterator[str]:
    if path.is_file():
        yield path.relative_to(root).as_posix()
    elif path.is_dir():
        for child in sorted(path.rglob("*")):
            if child.is_file() and not child.is_symlink():
                yield child.relative_to(root).as_posix()


def mlflow_stores(root: Path) -> list[str]:
    """The files of the MLflow stores the run wrote inside the project: the fallback store,
    and the default local store where it exists."""
    found: list[str] = []
    for top in (store.FALLBACK_DIR.as_posix(), *PROJECT_STORE):
        found.extend(f for f in _files(root, root / top) if not f.endswith(".lock"))
    return found


def results_document(root: Path) -> list[str]:
    """The committed results document the report stage writes besides its DVC outputs
    (``report.results``, e.g. ``results/STUDY.md``) and its figures' folder
    (``results/study/``), where params name one."""
    import yaml

    params = root / "params.yaml"
    loaded = yaml.safe_load(params.read_text()) if params.is_file() else None
    report = loaded.get("report") if isinstance(loaded, dict) else None
    document = report.get("results") if isinstance(report, dict) else None
    if not isinstance(document, str) or not document:
        return []
    path = root / document
    return [*_files(root, path), *_files(root, path.parent / path.stem.lower())]


def bundle_files(root: Path) -> list[str]:
    """What the bundle carries (module docstring), relative to ``root``."""
    files = {f for f in ALWAYS if (root / f).is_file()}
    files.update(uncached_outputs(root))
    files.update(results_document(root))
    files.update(mlflow_stores(root))
    return sorted(files)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- push


def push(root: Path, url: str | None) -> dict[str, Any]:
    """Push the project's results to ``url`` (module docstring); returns the manifest."""
    root = root.resolve()
    place = open_place(results_url(url), create=True)
    if not (root / "dvc.lock").is_file():
        raise DataError(
            root / "dvc.lock", "no dvc.lock: nothing has run here to push (make repro first)"
        )
    commit = git_commit(root)
    files = bundle_files(root)
    manifest = {
        "format": MANIFEST_FORMAT,
        "git_commit": commit,
        # tracked files the run changed beyond its own outputs (which differ by design) and
        # the .gitignore entries DVC adds for outputs (dvc pull adds them again)
        "uncommitted": [
            f for f in changed_files(root) if f not in files and Path(f).name != ".gitignore"
        ],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "dvc_remote": place.dvc_url,
        "files": {f: sha256(root / f) for f in files},
    }
    configure_remote(root, place)
    dvc(root, "push", "--remote", REMOTE)
    _write_bundle(place, root, manifest)
    return manifest


def _write_bundle(place: Place, root: Path, manifest: dict[str, Any]) -> None:
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    with (
        place.fs.open_output_stream(place.bundle_path) as out,
        tarfile.open(fileobj=out, mode="w|gz") as tar,
    ):
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
        for name in manifest["files"]:
            tar.add(root / name, arcname=name, recursive=False)


# --------------------------------------------------------------------------- pull


def pull(root: Path, url: str | None) -> dict[str, Any]:
    """Bring the results at ``url`` into the clone at ``root`` (module docstring); returns
    the manifest. The MLflow runs are replayed by :func:`replay_mlflow` afterwards."""
    root = root.resolve()
    place = open_place(results_url(url))
    import pyarrow.fs

    if place.fs.get_file_info(place.bundle_path).type != pyarrow.fs.FileType.File:
        raise ConfigError(
            URL_ENV,
            f"no results at {place.url} (no {BUNDLE}): push them first, on the cluster after "
            f"make repro: python -m pipeline results push {place.url}",
        )
    commit = git_commit(root)
    with tempfile.TemporaryDirectory(prefix="hiertx-results-") as tmp:
        manifest = _read_bundle(place, Path(tmp), commit)
        _refuse_overwriting_stores(root, manifest)
        for name in manifest["files"]:
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(Path(tmp, name), target)
    configure_remote(root, place)
    dvc(root, "pull", "--remote", REMOTE, *locked_stages(root))
    return manifest


def locked_stages(root: Path) -> list[str]:
    """The stages ``dvc.lock`` records, by the names ``dvc pull`` takes (``train@key``):
    those the run finished. A bare ``dvc pull`` also tries every stage of ``dvc.yaml`` that
    never ran (a failed run, a run of some stages) and fails on their missing outputs."""
    import yaml

    lock = yaml.safe_load((root / "dvc.lock").read_text()) or {}
    return list(lock.get("stages") or {})


def _read_bundle(place: Place, into: Path, commit: str) -> dict[str, Any]:
    """The bundle unpacked into ``into`` after its manifest's commit was checked against
    ``commit``; every file checked against its hash."""
    with (
        place.fs.open_input_stream(place.bundle_path) as stream,
        tarfile.open(fileobj=stream, mode="r|gz") as tar,
    ):
        first = tar.next()
        reader = tar.extractfile(first) if first and first.name == MANIFEST else None
        if reader is None:
            raise DataError(place.bundle_url, f"not a hiertx results bundle (no {MANIFEST})")
        manifest = json.loads(reader.read())
        made_from = manifest.get("git_commit")
        if made_from != commit:
            raise ConfigError(
                "git commit",
                f"the results at {place.url} were made from commit {made_from}, this clone "
                f"is at {commit}: check that commit out (git fetch; git checkout "
                f"{made_from}), then pull again",
            )
        while (member := tar.next()) is not None:  # on from the manifest: a stream
            _extract_member(tar, member, into, place.bundle_url)
    for name, digest in manifest["files"].items():
        path = into / name
        if not path.is_file() or sha256(path) != digest:
            raise DataError(place.bundle_url, f"{name} is missing or damaged in the bundle")
    return manifest


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, into: Path, url: str) -> None:
    """``member`` of the bundle written under ``into``. A bundle holds plain files and
    folders at relative paths inside the project; anything else (a link, a device, an
    absolute or ``..`` path) is refused. Python's "data" filter (3.11.4+, PEP 706) checks
    the member once more where it exists."""
    parts = Path(member.name).parts
    if not (member.isfile() or member.isdir()) or member.name.startswith("/") or ".." in parts:
        raise DataError(url, f"{member.name}: not a plain file inside the project")
    if hasattr(tarfile, "data_filter"):
        tar.extract(member, into, filter="data")
    else:
        tar.extract(member, into)


def _refuse_overwriting_stores(root: Path, manifest: dict[str, Any]) -> None:
    """An MLflow store already in the clone holds runs of its own: never replaced."""
    tops = {name.split("/", 2)[0] for name in manifest["files"]}
    clashes = [top for top in PROJECT_STORE if top in tops and (root / top).exists()]
    fallback = store.FALLBACK_DIR.as_posix()
    carried = any(name.startswith(f"{fallback}/") for name in manifest["files"])
    if carried and (root / store.FALLBACK_DIR).exists():
        clashes.append(fallback)
    if clashes:
        raise ConfigError(
            "--root",
            f"{root} already has the MLflow store {', '.join(clashes)}, which the results "
            "would replace: pull into a fresh clone (or move it away first)",
        )


def replay_mlflow(root: Path, manifest: dict[str, Any]) -> int:
    """Replay the bundle's MLflow runs into the configured store with ``sync-mlflow``: the
    fallback store's, and the project store's where the configured store is another.
    Returns ``sync-mlflow``'s exit status (0: nothing to replay)."""
    names = manifest["files"]
    sources = []
    if f"{store.FALLBACK_DIR.as_posix()}/mlflow.db" in names:
        sources.append(None)  # sync-mlflow's default: the fallback store
    project_store = store.resolve_uri(f"{store.SQLITE}{PROJECT_STORE[0]}", root)
    if PROJECT_STORE[0] in names and store.tracking_uri(root) != project_store:
        sources.append(project_store)
    status = 0
    for source in sources:
        args = argparse.Namespace(root=str(root), to=None, source=source)
        status = max(status, sync.run_command(args))
    return status


# --------------------------------------------------------------------------- command


ACTIONS = {
    "push": (
        "push the results after make repro",
        "Push the project's results after make repro: dvc push to the DVC remote at URL/dvc, "
        "then the bundle (dvc.lock, params.yaml, the uncached outputs, the project's MLflow "
        "stores) to URL/results.tar.gz, with a manifest naming the git commit.",
    ),
    "pull": (
        "bring pushed results into a clone",
        "Bring pushed results into a clone at the run's commit: the bundle's files laid "
        "down, dvc pull from URL/dvc, the MLflow runs replayed with sync-mlflow into "
        "$MLFLOW_TRACKING_URI (or the project's mlflow.db).",
    ),
    "check": (
        "check before a run that results can be pushed",
        "Check, before a run, that results can be pushed to URL: it opens, its bucket "
        "exists, DVC has the plugin for it.",
    ),
}


def add_parser(commands: Any) -> None:
    """The ``results`` subcommand of ``python -m pipeline``."""
    sub = commands.add_parser(
        COMMAND,
        help="push a run's results to a bucket, or pull them into a clone",
        description=__doc__,
    )
    actions = sub.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, (short, text) in ACTIONS.items():
        action = actions.add_parser(name, help=short, description=textwrap.fill(text, 88))
        action.add_argument(
            "url",
            nargs="?",
            help=f"s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or a folder (default: ${URL_ENV})",
        )
        action.add_argument("--root", default=".", help="project folder (holds dvc.lock)")


def run_command(args: argparse.Namespace) -> int:
    """``python -m pipeline results ACTION``: 0, or sync-mlflow's status after a pull."""
    root = Path(args.root)
    if args.action == "check":
        place = open_place(results_url(args.url), create=True)
        print(f"{COMMAND}: {place.url} is ready for results")
        return 0
    if args.action == "push":
        url = results_url(args.url)
        manifest = push(root, url)
        print(
            f"{COMMAND}: pushed {len(manifest['files'])} files of commit "
            f"{manifest['git_commit'][:12]} to {url}/{BUNDLE}, DVC outputs to {url}/{DVC_FOLDER}"
        )
        print(f"  on your machine, in a clone at that commit: make pull-results REMOTE={url}")
        return 0
    manifest = pull(root, args.url)
    print(
        f"{COMMAND}: laid down {len(manifest['files'])} files of commit "
        f"{manifest['git_commit'][:12]} (pushed from {manifest['host']} at "
        f"{manifest['created']}) and pulled the DVC outputs"
    )
    if manifest.get("uncommitted"):
        print(
            f"note: the run's project differed from that commit in: "
            f"{', '.join(manifest['uncommitted'])}",
            file=sys.stderr,
        )
    return replay_mlflow(root.resolve(), manifest)
