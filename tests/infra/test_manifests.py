"""Every infra/ manifest parses and carries the keys Ray, KubeRay and Compose require."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra"


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_cluster_launcher_configs_match_rays_schema(name: str) -> None:
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = yaml.safe_load((INFRA / "ray" / name).read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = [t for t in types if t != config["head_node_type"]]
    assert workers, "a worker node type is needed for training"
    assert any("hiertx" in cmd for cmd in config["setup_commands"])
    # the dashboard (job submission endpoint) stays on loopback: reach it through `ray dashboard`
    assert all("0.0.0.0" not in cmd for cmd in config["head_start_ray_commands"])
    # a stage joins only the cluster RAY_ADDRESS names: the head's stages are given this one
    exported = "export RAY_ADDRESS=${RAY_ADDRESS:-auto}"
    assert any(exported in cmd for cmd in config["head_setup_commands"])


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def _check_cluster_spec(spec: dict) -> None:
    """A CPU head, GPU workers, and every pod mounting the one shared data volume where the
    project keeps data/ (workers read the shards the head tokenized)."""
    pvc = yaml.safe_load((INFRA / "kuberay" / "data-pvc.yaml").read_text())
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == [
        "ReadWriteMany"
    ]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        mounts = {
            m["mountPath"]: m["name"] for m in _containers(group["template"])[0]["volumeMounts"]
        }
        assert claims[mounts["/home/ray/hiertx/data"]] == pvc["metadata"]["name"]
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert _containers(head["template"])[0]["image"]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"]
        assert isinstance(group["rayStartParams"], dict)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        container = _containers(group["template"])[0]
        assert container["image"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_kuberay_raycluster() -> None:
    doc = yaml.safe_load((INFRA / "kuberay" / "raycluster.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    assert doc["spec"]["rayVersion"] == ray.__version__
    _check_cluster_spec(doc["spec"])


def test_kuberay_rayjob_runs_the_pipeline() -> None:
    doc = yaml.safe_load((INFRA / "kuberay" / "rayjob.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    assert "python -m pipeline.repro --jobs" in doc["spec"]["entrypoint"]
    assert doc["spec"]["shutdownAfterJobFinishes"] is True
    assert doc["spec"]["rayClusterSpec"]["rayVersion"] == ray.__version__
    _check_cluster_spec(doc["spec"]["rayClusterSpec"])


def test_mlflow_compose_publishes_on_loopback_only() -> None:
    doc = yaml.safe_load((INFRA / "mlflow" / "docker-compose.yaml").read_text())
    services = doc["services"]
    assert {"postgres", "mlflow"} <= set(services)
    for service in services.values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), port
    command = services["mlflow"]["command"]
    assert "--serve-artifacts" in command
    # SQLAlchemy >= 2.1 reads a bare postgresql:// as psycopg 3: the URI names the driver
    # the image installs (tests/train/test_mlflow_server.py runs it on a real PostgreSQL);
    # the image's entry point builds it (tests/infra/test_mlflow_store_uri.py)
    assert "hiertx-mlflow-serve" in command
    assert "postgresql+psycopg2://" in (INFRA / "mlflow" / "serve.py").read_text()
    assert services["mlflow"]["build"]["dockerfile"] == "Dockerfile"
    assert "psycopg2-binary==" in (INFRA / "mlflow" / "Dockerfile").read_text()
    example = (INFRA / "mlflow" / ".env.example").read_text()
    for var in ("POSTGRES_PASSWORD", "MLFLOW_ALLOWED_HOSTS"):
        assert f"{var}=" in example


def test_local_cluster_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(INFRA / "local_cluster.sh")], check=True)
