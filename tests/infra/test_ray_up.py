"""``ray up infra/ray/{aws,gcp}.yaml`` as Ray runs it, checked without a cloud account.

* The project travels whole: the config's ``rsync_exclude`` and ``rsync_filter``, turned
  into rsync arguments by Ray's own command runner, are applied by the real ``rsync`` to a
  copy of the repository (its tracked files, a ``.git`` and the heavy folders a working copy
  has): ``pipeline/data/`` and ``tests/data/`` (which an unanchored ``data`` drops) and
  ``.git`` (DVC needs it) arrive, ``.venv``, ``data/``, ``runs/``, ``mlflow.db`` do not.
* The shared ``data/`` is mounted on the host (``initialization_commands``; Ray runs
  ``setup_commands`` in the container, which may not mount) and bind-mounted into the
  container where the project keeps it.
* Workers can write to the bucket: an instance profile (AWS) or service account (GCP) on
  every worker type (Ray gives one to the head only).
* GCP's ``scheduling`` is one object (a list is dropped: ray-project/ray#46248).
* Every node boots a pinned image (no ImageId: Ray's Ubuntu 18.04 fallback; no image
  family that moves).
* The smoke test refuses a storage folder the other nodes do not see.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.command_runner import SSHCommandRunner

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["aws.yaml", "gcp.yaml"]
DATA_ON_HOST = "/mnt/hiertx-data"
DATA_IN_CONTAINER = "/home/ray/hiertx/data"
HEAVY = [".venv/lib/site.py", "data/shards/x.arrow", "runs/ray/x", "mlflow.db", "mlruns/0/x"]


def config(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "infra" / "ray" / name).read_text())


def workers(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    types = cfg["available_node_types"]
    return [t["node_config"] for name, t in types.items() if name != cfg["head_node_type"]]


@pytest.fixture(scope="module")
def working_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's tracked files, a ``.git`` and what a working copy also holds."""
    root = tmp_path_factory.mktemp("wc") / "hiertx"
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / name, root / name)
    for name in [".git/HEAD", ".git/objects/pack/x.pack", *HEAVY]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    return root


@pytest.mark.parametrize("name", CONFIGS)
def test_rsync_filters_keep_the_library_and_git(name: str, working_copy: Path) -> None:
    if shutil.which("rsync") is None:
        if os.environ.get("CI"):
            pytest.fail("rsync is missing (.ci/run installs Debian's rsync)")
        pytest.skip("needs rsync")
    cfg = config(name)
    options = {"rsync_exclude": cfg.get("rsync_exclude"), "rsync_filter": cfg.get("rsync_filter")}
    args = SSHCommandRunner._create_rsync_filter_args(None, options)  # type: ignore[arg-type]
    assert cfg["file_mounts"] == {"~/hiertx": "."}
    # Ray syncs a folder as "<local>/" to "<remote>/" (updater.sync_file_mounts)
    listed = subprocess.run(
        ["rsync", "-a", "--dry-run", "--out-format=%n", *args, f"{working_copy}/", "/nowhere/"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    arrived = {p.rstrip("/") for p in listed}
    tracked = {str(p.relative_to(working_copy)) for p in working_copy.rglob("*") if p.is_file()}
    library = {p for p in tracked if p.startswith(("pipeline/", "stages/", "tests/data/"))}
    assert "pipeline/data/__init__.py" in library and any(
        p.startswith("tests/data/") for p in tracked
    )
    assert library <= arrived, sorted(library - arrived)[:5]
    assert {".git/HEAD", ".git/objects/pack/x.pack", "dvc.yaml", "params.yaml"} <= arrived
    assert not arrived & set(HEAVY), sorted(arrived & set(HEAVY))


@pytest.mark.parametrize("name", CONFIGS)
def test_data_is_mounted_on_the_host_and_bound_into_the_container(name: str) -> None:
    cfg = config(name)
    host = " ".join(cfg["initialization_commands"])
    assert "mount -t nfs" in host and DATA_ON_HOST in host and "chown 1000:100" in host
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        assert not any("mount " in cmd for cmd in cfg.get(key) or []), key
    assert f"-v {DATA_ON_HOST}:{DATA_IN_CONTAINER}" in cfg["docker"]["run_options"]
    setup = " ".join(cfg["setup_commands"])
    assert "-c constraints.txt" in setup  # the image's and make setup's locked versions


def test_aws_workers_have_an_instance_profile_and_every_node_a_pinned_ami() -> None:
    cfg = config("aws.yaml")
    assert all(w["IamInstanceProfile"]["Arn"].startswith("arn:aws:iam::") for w in workers(cfg))
    for node_type in cfg["available_node_types"].values():
        assert node_type["node_config"]["ImageId"].startswith("ami-")


def test_gcp_workers_have_a_service_account_scheduling_object_and_pinned_image() -> None:
    cfg = config("gcp.yaml")
    for worker in workers(cfg):
        assert worker["serviceAccounts"][0]["email"].endswith(".iam.gserviceaccount.com")
        assert worker["scheduling"] == {"onHostMaintenance": "TERMINATE", "preemptible": True}
    for node_type in cfg["available_node_types"].values():
        for disk in node_type["node_config"]["disks"]:
            image = disk["initializeParams"]["sourceImage"]
            assert "/global/images/" in image and "/family/" not in image, image


@pytest.mark.parametrize("name", CONFIGS)
def test_the_image_is_pinned_and_the_dashboard_stays_on_loopback(name: str) -> None:
    import ray

    cfg = config(name)
    assert cfg["docker"]["image"] == f"rayproject/ray:{ray.__version__}-py311-gpu"
    assert all("--dashboard-host=127.0.0.1" in c for c in cfg["head_start_ray_commands"][1:])


def test_the_smoke_test_refuses_storage_the_other_nodes_do_not_see(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("smoke_ddp", REPO / "infra" / "smoke_ddp.py")
    assert spec is not None and spec.loader is not None
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    monkeypatch.delenv("HIERTX_STORAGE_PATH", raising=False)
    probed: list[Path] = []

    def blind(folder: Path) -> list[str]:  # cluster.unshared on a cluster whose worker
        probed.append(folder)  # (10.0.0.7) has its own disk
        return ["10.0.0.7"]

    monkeypatch.setattr(smoke, "unshared", blind)
    with pytest.raises(SystemExit, match=r"10.0.0.7 do not see .*--storage s3://"):
        smoke.shared_storage(str(tmp_path))
    with pytest.raises(SystemExit, match="do not see"):
        smoke.shared_storage(None)  # a temporary folder on this machine: refused too
    assert probed[0] == tmp_path
    assert smoke.shared_storage("s3://bucket/smoke") == "s3://bucket/smoke"  # not probed
    monkeypatch.setattr(smoke, "unshared", lambda folder: [])
    assert smoke.shared_storage(str(tmp_path)) == str(tmp_path)
