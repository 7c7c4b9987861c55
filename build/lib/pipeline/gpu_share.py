"""How the stages of one ``make repro JOBS=N`` share this machine's GPUs.

``pipeline.repro`` runs every stage as its own process. Left alone, each would start a
private Ray instance (``cluster.ray_cluster``) that believes it owns every GPU, and two
train stages would hand their seeds the same GPU ids (GPUs 0, 1, 2 twice on an 8-GPU
machine, five idle); a training in the stage's own process (``num_workers: 0``) would use
``cuda:0`` in every stage. So:

* :func:`run_instance`: when this machine has GPUs and ``--jobs`` > 1 (or it has several
  GPUs), ``pipeline.repro`` starts one Ray instance for the whole run, bound to
  127.0.0.1 with token authentication (a token private to the run), and hands it to
  every stage through ``RAY_ADDRESS``. Ray then assigns distinct GPU ids to concurrent
  trainings and packs fractions (``train.placement.gpus_per_worker: 0.25``: four to a
  GPU) without going over one GPU; what does not fit waits. It is not started where
  ``RAY_ADDRESS`` names a cluster: the stages join that one. Ray counts the GPUs
  ``CUDA_VISIBLE_DEVICES`` leaves visible and hands out their real ids.
* :func:`gpu_lease`: a stage that computes in its own process (``num_workers: 0``) on a
  cluster named by ``RAY_ADDRESS`` first takes its GPU share (``gpus_per_worker``) from Ray
  on its own node, an actor that holds it until the stage ends, and then sees that one
  GPU alone (``CUDA_VISIBLE_DEVICES``), as ``cuda:0``. It waits while every GPU is taken.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.cluster import (
    ADDRESS_ENV,
    JOINED,
    _environment,
    _free_port,
    ray_cluster,
)
from pipeline.config import PlacementParams

AUTH_ENV = {"RAY_AUTH_MODE": "token"}
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": every Ray socket on 127.0.0.1
OVERRIDE_ENV = "RAY_OVERRIDE_RESOURCES"  # Ray's own: the resources a node it starts declares
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
READY = "READY "  # the holder's line once its instance is up: READY <address>
START_TIMEOUT_S = 300.0  # a loaded 2-core machine has taken over a minute


def local_gpus() -> int:
    """The GPUs a Ray instance started here would declare: Ray's own override
    (``RAY_OVERRIDE_RESOURCES``, e.g. ``{"GPU": 8}``) if it names GPUs, else those torch
    sees (``CUDA_VISIBLE_DEVICES`` respected)."""
    override = json.loads(os.environ.get(OVERRIDE_ENV) or "{}")
    if "GPU" in override:
        return int(override["GPU"])
    import torch

    return torch.cuda.device_count()


def wants_instance(jobs: int) -> bool:
    """Whether ``pipeline.repro --jobs jobs`` starts a Ray instance for its stages: this
    machine has GPUs, several stages run at once or several GPUs are here, and there is no
    cluster to join (``RAY_ADDRESS``; a Ray instance merely running here is not joined
    unasked, ``pipeline.cluster``)."""
    if os.environ.get(ADDRESS_ENV):
        return False
    gpus = local_gpus()
    return gpus > 0 and (jobs > 1 or gpus > 1)


@contextlib.contextmanager
def run_instance(jobs: int) -> Iterator[str | None]:
    """For the block: the run's shared Ray instance when :func:`wants_instance` (its
    address in ``RAY_ADDRESS`` with its token for every process started inside), else
    nothing (None). The instance lives in a holder process stopped at the end by PID."""
    if not wants_instance(jobs):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="hiertx-run-ray-") as folder:
        token = Path(folder) / "token"
        token.touch(mode=0o600)
        token.write_text(os.urandom(32).hex())
        env = {**AUTH_ENV, TOKEN_PATH_ENV: str(token), LOOPBACK_ENV: "0"}
        holder = subprocess.Popen(
            [sys.executable, "-m", "pipeline.gpu_share"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
            start_new_session=True,  # Ctrl-C goes to the stages; the holder stops last
        )
        try:
            address = _ready(holder)
            with _environment({**env, ADDRESS_ENV: address}):
                yield address
        finally:
            _stop(holder)


def _ready(holder: subprocess.Popen[str]) -> str:
    """The address the holder prints once its instance is up."""
    assert holder.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([holder.stdout], [], [], 1.0)
        if ready:
            line = holder.stdout.readline()
            if line.startswith(READY):
                return line.removeprefix(READY).strip()
            if not line:  # the holder exited: Ray said why on stderr (ours)
                break
    raise RuntimeError(
        f"the run's Ray instance did not start within {START_TIMEOUT_S:.0f} s (its output "
        f"is above); set {ADDRESS_ENV} to a running cluster, or run with --jobs 1"
    )


def _stop(holder: subprocess.Popen[str]) -> None:
    """Close the holder's stdin (it shuts Ray down and exits); kill it if it hangs."""
    with contextlib.suppress(OSError):
        assert holder.stdin is not None
        holder.stdin.close()
    try:
        holder.wait(timeout=60)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()


def hold() -> None:
    """The holder process: a Ray instance on 127.0.0.1 (the environment ``run_instance``
    gave: token auth, loopback) until stdin closes."""
    import ray
    from ray._private import ray_constants

    port = _free_port()
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)
    ray_constants.ENABLE_RAY_CLUSTER = False  # imported before the env var was read here
    ray.init(
        address="local",
        include_dashboard=True,  # Tune/Train clean-up uses the state API it serves
        dashboard_host="127.0.0.1",
        dashboard_port=_free_port(),
        log_to_driver=False,
    )
    resources = ray.cluster_resources()
    print(
        f"{JOINED} started one Ray instance for this run at 127.0.0.1:{port} "
        f"({resources.get('GPU', 0):g} GPUs, {resources.get('CPU', 0):g} CPUs): every stage "
        f"joins it, so concurrent trainings get distinct GPUs",
        file=sys.stderr,
        flush=True,
    )
    print(f"{READY}127.0.0.1:{port}", flush=True)
    try:
        sys.stdin.read()  # until the run ends (or its process dies: EOF all the same)
    finally:
        ray.shutdown()


class _GpuShare:
    """An actor that holds a GPU share for a stage computing in its own process."""

    def visible(self) -> str:
        return os.environ.get(VISIBLE_ENV, "")


@contextlib.contextmanager
def gpu_lease(placement: PlacementParams) -> Iterator[str | None]:
    """For the block: this process computes on the GPU share Ray gave it (module docstring),
    whose id it yields; None, and nothing changed, without a cluster named by
    ``RAY_ADDRESS``, with ``use_gpu: false``, or on a machine without GPUs (then no Ray
    is joined at all). Must come before anything initialises CUDA in this process."""
    if not os.environ.get(ADDRESS_ENV) or placement.use_gpu is False or not local_gpus():
        yield None
        return
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    with ray_cluster():
        node = ray.get_runtime_context().get_node_id()
        here = next(n for n in ray.nodes() if n["NodeID"] == node)
        if not here["Resources"].get("GPU"):
            yield None
            return
        if torch.cuda.is_initialized():
            raise RuntimeError("CUDA was initialised before the GPU lease: it cannot pin")
        share = placement.gpus_per_worker
        holder = (
            ray.remote(_GpuShare)
            .options(
                num_cpus=0,
                num_gpus=share,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            .remote()
        )
        print(f"{JOINED} waiting for a GPU share of {share:g} on this node", file=sys.stderr)
        visible = ray.get(holder.visible.remote())
        print(
            f"{JOINED} computing in this process on GPU {visible} ({VISIBLE_ENV}), a share of "
            f"{share:g} Ray holds for this stage",
            file=sys.stderr,
            flush=True,
        )
        try:
            with _environment({VISIBLE_ENV: visible}):
                yield visible
        finally:
            ray.kill(holder)


if __name__ == "__main__":
    hold()
