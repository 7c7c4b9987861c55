"""The Ray cluster a stage runs on, and the storage its runs checkpoint to.

:func:`ray_cluster` joins, in this order:

1. the cluster ``$RAY_ADDRESS`` names (``infra/local_cluster.sh``, a KubeRay job, any
   driver started with ``ray job submit``);
2. the Ray instance already running on this machine, the one ``ray start`` recorded and a
   plain ``ray.init()`` finds: the head node of a cluster launched with ``ray up``, where
   ``ray exec ... 'dvc repro'`` runs without ``RAY_ADDRESS``;
3. otherwise a private single-node cluster bound to 127.0.0.1 with a GCS port it picks,
   exported to every Ray process it starts (Ray's own helpers, such as Train's
   placement-group cleaner, otherwise auto-detect "the" cluster and fail when another one
   runs on the same machine).

The first line a stage prints about Ray says which (:data:`JOINED`). Token authentication
follows Ray's own rule: the instance running on this machine is joined as ``ray.init()``
joins it (``address="auto"``), which turns token auth on when ``~/.ray/auth_token`` exists
(``ray start`` enables it when a token exists, Ray >= 2.59); a cluster named by
``$RAY_ADDRESS`` needs ``RAY_AUTH_MODE=token`` and its token (``RAY_AUTH_TOKEN`` or
``RAY_AUTH_TOKEN_PATH``) set explicitly, as ``infra/local_cluster.sh`` does.

Storage: runs and checkpoints live under ``train.placement.storage_path``, else
``$HIERTX_STORAGE_PATH``, else ``<project>/runs/ray``. A multi-node run needs a path every
node reads (NFS, ``s3://``, ``gs://``): a worker that restarts on another node resumes
from there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from pipeline import machine
from pipeline.config import PlacementParams
from pipeline.errors import ConfigError

STORAGE_ENV = "HIERTX_STORAGE_PATH"
ADDRESS_ENV = "RAY_ADDRESS"
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


def use_gpu(placement: PlacementParams) -> bool:
    """Whether workers take a GPU: as params say, else when this machine has one."""
    return machine.has_gpu() if placement.use_gpu is None else placement.use_gpu


def running_instance() -> str | None:
    """The address of the Ray instance ``ray start`` left running on this machine (the one
    a plain ``ray.init()`` joins), or None: none was started, or it has stopped."""
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(line: str) -> None:
    print(f"{JOINED} {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def ray_cluster(num_cpus: int | None = None) -> Iterator[None]:
    """Join the cluster this stage runs on, or start a private one, for the block (module
    docstring). Reuses an already initialised Ray."""
    import ray

    if ray.is_initialized():
        yield
        return
    address = os.environ.get(ADDRESS_ENV)
    how = f"joined the cluster at {address} (${ADDRESS_ENV})"
    if not address:
        address = running_instance()
        how = f"joined the Ray instance running on this machine at {address} (ray start)"
    queue = {QUEUE_TIMEOUT_ENV: os.environ.get(QUEUE_TIMEOUT_ENV, QUEUE_TIMEOUT_S)}
    if not address:
        with _environment(queue), _private_cluster(num_cpus):
            yield
        return
    with _environment(queue):
        # "auto" for the running instance: Ray enables token auth for it when a token exists
        ray.init(address=os.environ.get(ADDRESS_ENV, "auto"), log_to_driver=True)
        _say(f"{how}: {_describe_cluster()}")
        try:
            yield
        finally:
            ray.shutdown()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
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


@contextlib.contextmanager
def _private_cluster(num_cpus: int | None) -> Iterator[None]:
    import ray
    from ray._private import ray_constants

    port = _free_port()
    env = {
        ADDRESS_ENV: f"127.0.0.1:{port}",
        "RAY_GCS_SERVER_PORT": str(port),
        # read by every Ray process: bind to 127.0.0.1 only
        ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR: "0",
    }
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported Ray before the env var
    try:
        with _environment(env):
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=True,  # Tune/Train clean-up uses the state API it serves
                dashboard_host="127.0.0.1",
                dashboard_port=_free_port(),
                log_to_driver=True,
            )
            try:
                _say(
                    f"started a private cluster at 127.0.0.1:{port} (no ${ADDRESS_ENV}, no "
                    f"Ray running here): {_describe_cluster()}"
                )
                yield
            finally:
                ray.shutdown()
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
