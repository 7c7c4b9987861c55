"""The Ray cluster a stage runs on, and the storage its runs checkpoint to.

:func:`ray_cluster` joins only the cluster the user named:

1. ``$RAY_ADDRESS``: a cluster's address (``infra/local_cluster.sh``, a KubeRay job, any
   driver started with ``ray job submit``), or ``auto``, Ray's name for the instance
   ``ray start`` recorded on this machine (the head of a ``ray up`` cluster, where the
   project's launcher configs export ``RAY_ADDRESS=auto``);
2. otherwise a private single-node cluster bound to 127.0.0.1 with a GCS port it picks,
   exported to every Ray process it starts (Ray's own helpers, such as Train's
   placement-group cleaner, otherwise auto-detect "the" cluster and fail when another one
   runs on the same machine).

An address on 127.0.0.1 is joined on loopback (Ray would swap it for this machine's network
address, where a node started with ``--node-ip-address=127.0.0.1`` does not listen).

A Ray instance that merely runs on the machine is never joined without ``RAY_ADDRESS``: on
a shared workstation or a CI runner it may be anyone's (another user's, another test's),
and a training placed there would run on, and be lost with, a cluster nobody meant. The
private cluster's line names such an instance and how to join it (``RAY_ADDRESS=auto``).

The first line a stage prints about Ray says which (:data:`JOINED`). Token authentication
follows Ray's own rule: ``RAY_ADDRESS=auto`` joins as ``ray.init(address="auto")`` does,
which turns token auth on when ``~/.ray/auth_token`` exists (``ray start`` enables it when
a token exists, Ray >= 2.59); an explicit address needs ``RAY_AUTH_MODE=token`` and its
token (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``) set, as ``infra/local_cluster.sh``
does.

Storage: runs and checkpoints live under ``train.placement.storage_path``, else
``$HIERTX_STORAGE_PATH``, else ``<project>/runs/ray``. A multi-node run needs a path every
node reads (NFS, ``s3://``, ``gs://``): a worker that restarts on another node resumes
from there. A URI is opened with ``pyarrow.fs.FileSystem.from_uri``, as Ray Train opens it,
in-process runs included (``train.scale.num_workers: 0``); :func:`check_storage` refuses
one of a scheme pyarrow has no filesystem for, or with no bucket, before any compute, and
:func:`open_storage` one pyarrow cannot open (credentials, region, endpoint), naming the
setting it came from.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline import machine
from pipeline.config import PlacementParams
from pipeline.errors import ConfigError

STORAGE_ENV = "HIERTX_STORAGE_PATH"
STORAGE_KEY = "train.placement.storage_path"
# The schemes pyarrow.fs.FileSystem.from_uri opens (Ray Train's storage_path takes the same).
STORAGE_SCHEMES = ("s3", "gs", "gcs", "file", "hdfs", "viewfs", "abfs", "abfss")
ADDRESS_ENV = "RAY_ADDRESS"
AUTO = "auto"  # RAY_ADDRESS=auto: the instance `ray start` recorded on this machine
DEFAULT_STORAGE = Path("runs") / "ray"
JOINED = "ray:"  # the prefix of the line that says which cluster a stage runs on
# How long a training waits for its workers' resources before Ray Train gives the attempt
# up and tries again (unless set already). Ray's default, 60 s, logs a failure a minute for
# every training queued behind others on a full cluster; queueing is how it fills.
QUEUE_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
QUEUE_TIMEOUT_S = "1800"


def storage_path(placement: PlacementParams, root: str | Path) -> str:
    """Where runs and checkpoints live: params, ``$HIERTX_STORAGE_PATH``, or
    ``<root>/runs/ray``; local paths are made absolute (Ray workers run elsewhere)."""
    path = (
        placement.storage_path or os.environ.get(STORAGE_ENV) or str(Path(root) / DEFAULT_STORAGE)
    )
    if "://" in path:
        return path
    return str(Path(path).expanduser().resolve())


def storage_key(storage: str) -> str:
    """The setting ``storage`` (or a run's folder under it) came from, for errors:
    ``$HIERTX_STORAGE_PATH`` when it holds that value, else ``train.placement.storage_path``."""
    env = os.environ.get(STORAGE_ENV, "").rstrip("/")
    under = storage == env or storage.startswith(f"{env}/")
    return f"${STORAGE_ENV}" if env and under else STORAGE_KEY


def check_storage(storage: str) -> None:
    """Refuse a storage URI no run can write to, without reaching it: a scheme pyarrow has
    no filesystem for (``http://``, ``ftp://``, a typo), or no bucket or host (``s3://``).
    A local path passes."""
    if "://" not in storage:
        return
    scheme, rest = storage.split("://", 1)
    key = storage_key(storage)
    if scheme.lower() not in STORAGE_SCHEMES:
        raise ConfigError(
            key,
            f"{storage}: {scheme}:// is no filesystem checkpoints can be written to; give "
            "s3://<bucket>/<prefix>, gs://<bucket>/<prefix> or an absolute path (one every "
            f"node mounts, for a multi-node run); the schemes: {', '.join(STORAGE_SCHEMES)}",
        )
    if scheme.lower() != "file" and not rest.split("/", 1)[0]:
        raise ConfigError(key, f"{storage} names no bucket: give {scheme}://<bucket>/<prefix>")


def open_storage(storage: str) -> tuple[Any, str]:
    """The pyarrow filesystem of the storage URI ``storage`` and the path in it, opened as
    Ray Train opens it, its bucket reached (S3, GCS): a ``ConfigError`` naming the setting
    when pyarrow cannot open it, the store does not answer, or the bucket does not exist
    (a run would fail at its first checkpoint)."""
    check_storage(storage)
    import pyarrow.fs

    key = storage_key(storage)
    try:
        fs, path = pyarrow.fs.FileSystem.from_uri(storage)
        bucket = path.split("/", 1)[0]
        found = fs.get_file_info(bucket) if fs.type_name in ("s3", "gcs") else None
    except (ValueError, OSError) as err:  # pyarrow: ArrowInvalid (a ValueError), network
        raise ConfigError(
            key,
            f"pyarrow cannot open {storage} ({err}): check the URI, the credentials and the "
            "region (AWS_ACCESS_KEY_ID, AWS_DEFAULT_REGION, GOOGLE_APPLICATION_CREDENTIALS), "
            "or the endpoint (AWS_ENDPOINT_URL), or give a local path",
        ) from None
    if found is not None and found.type == pyarrow.fs.FileType.NotFound:
        scheme = storage.split("://", 1)[0]
        raise ConfigError(
            key,
            f"{storage}: the bucket {scheme}://{bucket} does not exist: create it, or name "
            "one that does",
        )
    return fs, path


def use_gpu(placement: PlacementParams) -> bool:
    """Whether workers take a GPU: as params say, else when this machine has one."""
    return machine.has_gpu() if placement.use_gpu is None else placement.use_gpu


def running_instance() -> str | None:
    """The address of the Ray instance ``ray start`` recorded on this machine (the one
    ``RAY_ADDRESS=auto`` and a plain ``ray.init()`` join), or None: none was started, or it
    has stopped. Whose it is, nothing says: :func:`ray_cluster` joins it only when asked."""
    from ray._private import services, utils

    address = utils.read_ray_address()
    if not address:
        return None
    services.find_gcs_addresses.cache_clear()
    return address if address in services.find_gcs_addresses() else None


def remote_nodes() -> list[str]:
    """The addresses of the cluster's live nodes that are not this machine (Ray must be
    initialised): where a worker cannot write to a file on this machine's disk."""
    return sorted({address for _, address in _remote()})


def _remote() -> list[tuple[str, str]]:
    import ray

    here = {"127.0.0.1", "localhost", socket.gethostname()}
    with contextlib.suppress(OSError):  # a host without a resolvable name
        here |= set(socket.gethostbyname_ex(socket.gethostname())[2])
    return [
        (n["NodeID"], n["NodeManagerAddress"])
        for n in ray.nodes()
        if n.get("Alive") and n["NodeManagerAddress"] not in here
    ]


def unshared(folder: Path) -> list[str]:
    """The addresses of the remote nodes that do not see ``folder`` as this machine does
    (Ray must be initialised). Measured, not guessed: a probe file with a random token is
    written there and a task pinned to each remote node reads it back."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = _remote()
    if not nodes:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    probe = folder / f".hiertx-probe-{token}"
    probe.write_text(token)
    try:
        read = ray.remote(num_cpus=0)(_read_text)
        answers = {
            address: read.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
            ).remote(str(probe))
            for node_id, address in nodes
        }
        return sorted(a for a, ref in answers.items() if ray.get(ref, timeout=300) != token)
    finally:
        probe.unlink(missing_ok=True)


def require_shared(folder: Path, key: str, what: str, fix: str) -> None:
    """A :class:`ConfigError` under ``key`` when remote nodes do not see ``folder``
    (:func:`unshared`): ``what`` they would miss there, ``fix`` what to do."""
    if blind := unshared(folder):
        nodes = ", ".join(blind[:3]) + (" ..." if len(blind) > 3 else "")
        raise ConfigError(key, f"{what} {folder}, which Ray workers on {nodes} do not see: {fix}")


PROJECT_ON_SHARED_FS = (
    "keep the project on a filesystem every node mounts at the same path (NFS or EFS; a "
    "shared volume in KubeRay; infra/README.md)"
)


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def free_port() -> int:
    """A port free on 127.0.0.1 now, and none of the fixed ports Ray's components take by
    default: Ray refuses a port given to two of them (a dashboard port drawn at random once
    hit 52365, its agent's default, and the private cluster did not start)."""
    from ray._private import ray_constants

    defaults = {
        ray_constants.DEFAULT_PORT,
        ray_constants.DEFAULT_DASHBOARD_PORT,
        ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT,
    }
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in defaults:
            return port


def _say(line: str) -> None:
    print(f"{JOINED} {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def ray_cluster(num_cpus: int | None = None) -> Iterator[None]:
    """Join the cluster ``$RAY_ADDRESS`` names, or start a private one, for the block
    (module docstring). Reuses an already initialised Ray."""
    import ray

    if ray.is_initialized():
        yield
        return
    address = os.environ.get(ADDRESS_ENV)
    queue = {QUEUE_TIMEOUT_ENV: os.environ.get(QUEUE_TIMEOUT_ENV, QUEUE_TIMEOUT_S)}
    if not address:
        with environment(queue), _private_cluster(num_cpus):
            yield
        return
    how = f"(${ADDRESS_ENV})"
    if address == AUTO:
        if not (found := running_instance()):
            raise ConfigError(
                ADDRESS_ENV,
                f"{AUTO} joins the Ray instance `ray start` left on this machine, and none "
                f"runs here: start one (`ray start --head`), name a cluster's address, or "
                f"unset {ADDRESS_ENV} for a private cluster",
            )
        how = f"(${ADDRESS_ENV}={AUTO}: the Ray instance `ray start` left on this machine)"
        address = found
    on_loopback = _loopback() if _is_loopback(address) else contextlib.nullcontext()
    with environment(queue), on_loopback:
        # "auto" as Ray reads it: Ray enables token auth for it when a token exists
        ray.init(address=os.environ[ADDRESS_ENV], log_to_driver=True)
        _say(f"joined the cluster at {address} {how}: {_describe_cluster()}")
        try:
            yield
        finally:
            ray.shutdown()


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``values`` for the block: what Ray reads from it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _describe_cluster() -> str:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    return f"{len(nodes)} nodes, {resources.get('CPU', 0):g} CPUs, {gpus} GPUs"


def _is_loopback(address: str) -> bool:
    return address.rsplit(":", 1)[0].strip("[]") in ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def _loopback() -> Iterator[None]:
    """Ray on 127.0.0.1 for the block: every Ray process this one starts reads the env
    var; this process, which imported Ray before, the flag. Otherwise Ray binds to the
    machine's network address, and swaps a cluster address of 127.0.0.1 for that address,
    where a node bound to loopback does not listen (a join then retries for many minutes)."""
    from ray._private import ray_constants

    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        with environment({ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR: "0"}):
            yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag


@contextlib.contextmanager
def _private_cluster(num_cpus: int | None) -> Iterator[None]:
    import ray

    running = running_instance()  # not joined: the line below names it
    port = free_port()
    env = {ADDRESS_ENV: f"127.0.0.1:{port}", "RAY_GCS_SERVER_PORT": str(port)}
    with environment(env), _loopback():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=True,  # Tune/Train clean-up uses the state API it serves
            dashboard_host="127.0.0.1",
            dashboard_port=free_port(),
            log_to_driver=True,
        )
        try:
            _say(
                f"started a private cluster at 127.0.0.1:{port} (no ${ADDRESS_ENV}): "
                f"{_describe_cluster()}{_not_joined(running)}"
            )
            yield
        finally:
            ray.shutdown()


def _not_joined(running: str | None) -> str:
    if not running:
        return ""
    return (
        f"; not the Ray instance `ray start` left on this machine at {running}, which may be "
        f"anyone's: {ADDRESS_ENV}={AUTO} joins it"
    )
