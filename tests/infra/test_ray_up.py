"""``ray up infra/ray/{aws,gcp}.yaml`` as Ray runs it, checked without a cloud account.

* The project travels as git has it: the config's ``rsync_exclude`` and ``rsync_filter``,
  turned into rsync arguments by Ray's own command runner, are applied by the real
  ``rsync`` to a copy of the repository (its tracked files, a ``.git`` and what a working
  copy also holds): ``pipeline/data/`` and ``tests/data/`` (which an unanchored ``data``
  drops) and ``.git`` (DVC needs it) arrive; ``.venv``, ``data/``, ``runs/``,
  ``mlflow.db``, ``.dvc/cache``, ``.dvc/tmp``, ``.dvc/config.local``, ``infra/mlflow/.env``
  (passwords) and a Slurm job's token do not, nor anything else git ignores.
* The AWS head has its own instance profile, whose policy may pass the workers' role
  (``iam:PassRole``, which Ray's default ``ray-autoscaler-v1`` lacks: no worker started).
* GCP GPU workers wait for the NVIDIA driver before their container starts.
* The nodes' environment is rewritten by every ``ray up``: a corrected MLflow URI replaces
  the first one (appending ``${MLFLOW_TRACKING_URI:-...}`` to .bashrc kept the first).
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

import fnmatch
import importlib.util
import json
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
# DVC's cache, temporary files and local config (credentials), the MLflow server's
# passwords, a Slurm job's token: git ignores them, and `ray up` must not send them (to the
# head, then again to every worker it starts)
PRIVATE = [
    ".dvc/cache/files/md5/ab/cdef0123",
    ".dvc/tmp/rwlock",
    ".dvc/config.local",
    "infra/mlflow/.env",
    ".ray-job-42/token",
]


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
    for name in [".git/HEAD", ".git/objects/pack/x.pack", *HEAVY, *PRIVATE]:
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
    assert not arrived & set(PRIVATE), sorted(arrived & set(PRIVATE))
    # nothing git ignores travels (git's own verdict on every file that arrived)
    files = sorted(p for p in arrived & tracked if not p.startswith(".git/"))
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=REPO, input="\n".join(files), capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert not ignored, ignored[:5]


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


def allows(policy: dict[str, Any], action: str, resource: str, context: dict[str, str]) -> bool:
    """IAM's verdict on one request, for the policy's Allow statements (no Deny, no
    NotAction here): an action and resource matched with IAM's wildcards, every
    ``StringEquals`` condition met by the request's context."""
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow" and "NotAction" not in statement, statement
        actions = statement["Action"]
        resources = statement["Resource"]
        actions = [actions] if isinstance(actions, str) else actions
        resources = [resources] if isinstance(resources, str) else resources
        conditions = statement.get("Condition", {})
        assert set(conditions) <= {"StringEquals"}, conditions  # what this check understands
        if (
            any(fnmatch.fnmatchcase(action.lower(), a.lower()) for a in actions)
            and any(fnmatch.fnmatchcase(resource, r) for r in resources)
            and all(context.get(k) == v for k, v in conditions.get("StringEquals", {}).items())
        ):
            return True
    return False


# What the head's autoscaler calls (ray/autoscaler/_private/aws/node_provider.py: the
# workers' create_instances, instances.filter, create_tags, describe_images and
# describe_instance_types, terminate/stop): AmazonEC2FullAccess's share of it
HEAD_EC2 = [
    "ec2:RunInstances",
    "ec2:CreateTags",
    "ec2:DescribeInstances",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeImages",
    "ec2:TerminateInstances",
    "ec2:StopInstances",
]


def test_aws_head_may_launch_workers_with_their_instance_profile() -> None:
    """Ray's default head role (``ray-autoscaler-v1``: AmazonEC2FullAccess and
    AmazonS3FullAccess) has no ``iam:PassRole``: EC2 refuses every RunInstances that names
    the workers' profile, and no worker starts. The head has its own profile, whose policy
    (infra/ray/aws-head-policy.json) passes exactly the role the workers' profile holds."""
    cfg = config("aws.yaml")
    head = cfg["available_node_types"][cfg["head_node_type"]]["node_config"]
    assert head["IamInstanceProfile"]["Arn"].startswith("arn:aws:iam::")
    assert "/ray-autoscaler-v1" not in head["IamInstanceProfile"]["Arn"]
    policy = json.loads((REPO / "infra" / "ray" / "aws-head-policy.json").read_text())
    assert policy["Version"] == "2012-10-17"
    ec2 = {"iam:PassedToService": "ec2.amazonaws.com"}
    for worker in workers(cfg):
        profile = worker["IamInstanceProfile"]["Arn"]
        # the profile and its role share their name (as the console and the README make them)
        role = profile.replace(":instance-profile/", ":role/")
        assert allows(policy, "iam:PassRole", role, ec2), role
        assert not allows(policy, "iam:PassRole", role.replace("worker", "admin"), ec2)
        assert not allows(policy, "iam:PassRole", role, {"iam:PassedToService": "lambda"})
    for action in HEAD_EC2:
        assert allows(policy, action, "arn:aws:ec2:us-west-2:1:instance/i-0abc", {}), action
    bucket = cfg["setup_commands"][1].split("s3://", 1)[1].split("/", 1)[0]
    assert allows(policy, "s3:PutObject", f"arn:aws:s3:::{bucket}/ray/x", {}), bucket
    assert allows(policy, "s3:ListBucket", f"arn:aws:s3:::{bucket}", {}), bucket
    readme = (REPO / "infra" / "README.md").read_text()
    assert "aws-head-policy.json" in readme
    assert "it\n   launches workers" not in readme  # the old claim that the default role does


def test_gcp_gpu_workers_wait_for_the_nvidia_driver_before_the_container(
    tmp_path: Path,
) -> None:
    """``install-nvidia-driver`` installs the driver at first boot, while Ray already runs
    the node's setup: a container started before ``nvidia-smi`` works gets no GPU runtime
    (Ray's DockerCommandRunner adds it only when nvidia-smi answers). Ray runs
    ``initialization_commands`` on the host before ``docker run``; a GPU type's own list
    waits for the driver first (as Ray's GCP GPU example does), then mounts data/."""
    cfg = config("gcp.yaml")
    types = cfg["available_node_types"]
    for name, node_type in types.items():
        gpu = "guestAccelerators" in node_type["node_config"]
        commands = node_type.get("initialization_commands", cfg["initialization_commands"])
        waits = [i for i, c in enumerate(commands) if "nvidia-smi" in c]
        assert bool(waits) == gpu, name
        if gpu:
            assert waits == [0], commands  # before the mount (and the container)
            assert commands[1:] == cfg["initialization_commands"]  # the same mount
    wait = next(t for t in types.values() if "initialization_commands" in t)
    wait = wait["initialization_commands"][0]
    # the wait itself: a stand-in nvidia-smi that fails twice, then answers; sleep a no-op
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").write_text(
        '#!/bin/sh\necho x >>"$CALLS"\n[ "$(wc -l <"$CALLS")" -ge 3 ]\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "n")}
    subprocess.run(["bash", "-c", wait], env=env, check=True, timeout=30)
    assert (tmp_path / "n").read_text().count("x") == 3
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # never: the wait gives up
    done = subprocess.run(
        ["bash", "-c", wait.replace("timeout 900", "timeout 2")], env=env, timeout=30
    )
    assert done.returncode != 0


@pytest.mark.parametrize("name", CONFIGS)
def test_a_changed_tracking_uri_replaces_the_old_one(name: str, tmp_path: Path) -> None:
    """The nodes' environment comes from the config on every ``ray up``: run the setup
    commands (all but pip) twice in a home folder, the second time with another MLflow
    server, as after fixing the config; a login shell then has the second. Appending
    ``export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-...}`` to .bashrc kept the first."""
    cfg = config(name)
    text = (REPO / "infra" / "ray" / name).read_text()
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# the image's own\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAY_"))}
    env["HOME"] = str(home)
    uris = ["http://CHANGE-ME-mlflow:5000", "http://mlflow-new.internal:5000"]
    assert uris[0] in text
    for uri in uris:
        fixed = yaml.safe_load(text.replace(uris[0], uri))
        commands = [*fixed["setup_commands"], *fixed["head_setup_commands"]]
        for command in commands:
            if "pip install" not in command:
                subprocess.run(["bash", "-c", command], env=env, check=True, cwd=home)
    shell = subprocess.run(
        ["bash", "-c", '. ~/.bashrc; echo "$MLFLOW_TRACKING_URI $RAY_ADDRESS"'],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert shell.stdout.split() == [uris[1], "auto"], shell.stdout
    bashrc = (home / ".bashrc").read_text()
    assert "MLFLOW_TRACKING_URI" not in bashrc  # in the rewritten file, not appended here
    assert cfg["setup_commands"][0].startswith("cd ~/hiertx && pip install")
    assert len(bashrc.splitlines()) == 2, bashrc  # the image's line and one source line
