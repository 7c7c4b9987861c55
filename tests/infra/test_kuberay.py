"""The KubeRay manifests: valid against KubeRay's CRDs, and what a run on them needs.

* Schema: every manifest against the ``openAPIV3Schema`` of KubeRay v1.7.0's CRDs
  (``ray-operator/config/crd/bases/ray.io_{rayclusters,rayjobs}.yaml`` of the release tag),
  strictly: an object schema that lists its properties accepts no other key, as
  ``kubectl apply --validate=strict`` does. The CRD files are read from
  ``$HIERTX_KUBERAY_CRDS`` or ``shared/kuberay-crds-v1.7.0/`` beside the project (a mirror
  of the release's files, as ``shared/data`` mirrors the corpora); without them that test
  is skipped.
* Bucket access through a service account (IRSA / Workload Identity) on every pod.
* The ``nvidia.com/gpu`` toleration on every pod that asks for a GPU.
* The profile chosen at submit time, and one whose trainings use the GPU workers.
* Results that outlive the head pod (copied to the data volume).
* ``generateName``: every ``kubectl create`` is a new run.
* Token auth for the dashboard and job API (``authOptions``), and a NetworkPolicy.
* The data volume owned by the image's ``ray`` user (uid 1000).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBERAY = REPO / "infra" / "kuberay"
CRD_VERSION = "v1.7.0"
MANIFESTS = {"raycluster.yaml": "rayclusters", "rayjob.yaml": "rayjobs"}


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((KUBERAY / name).read_text())


def cluster_spec(name: str) -> dict[str, Any]:
    doc = load(name)
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def pods(name: str) -> list[dict[str, Any]]:
    spec = cluster_spec(name)
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [g["template"]["spec"] for g in groups]


def crd_folder() -> Path | None:
    candidates = [
        os.environ.get("HIERTX_KUBERAY_CRDS"),
        REPO.parent / "shared" / "kuberay-crds-v1.7.0",
    ]
    return next((Path(c) for c in candidates if c and Path(c).is_dir()), None)


def strict(schema: Any) -> Any:
    """The CRD's schema with ``additionalProperties: false`` wherever properties are listed
    and unknown fields are not preserved (``kubectl --validate=strict``)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.mark.slow  # ~25 s: the CRDs embed the whole PodSpec schema
@pytest.mark.skip_on_ci_allowed(
    "KubeRay publishes its CRDs only on GitHub (no PyPI or Debian package; CI reaches neither),"
    " and the project commits no copy of them: they are checked where mirrored"
)
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_match_kuberay_crd_schema(name: str) -> None:
    folder = crd_folder()
    if folder is None:
        pytest.skip(f"KubeRay {CRD_VERSION} CRDs not mirrored (shared/kuberay-crds-v1.7.0)")
    crd = yaml.load((folder / f"ray.io_{MANIFESTS[name]}.yaml").read_text(), yaml.CSafeLoader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strict(version["schema"]["openAPIV3Schema"])
    doc = load(name)
    jsonschema.validate({k: v for k, v in doc.items() if k != "metadata"}, schema)
    with pytest.raises(jsonschema.ValidationError):  # the check can fail: a misspelt key
        bad = {**doc, "spec": {**doc["spec"], "shutdownAfterJobFinish": True}}
        jsonschema.validate({k: v for k, v in bad.items() if k != "metadata"}, schema)


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_can_reach_the_bucket_and_gpu_pods_tolerate_gpu_nodes(name: str) -> None:
    account = load("serviceaccount.yaml")
    assert account["kind"] == "ServiceAccount"
    annotations = account["metadata"]["annotations"]
    assert {"eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account"} <= set(annotations)
    for pod in pods(name):
        assert pod["serviceAccountName"] == account["metadata"]["name"]
        asks_gpu = any("nvidia.com/gpu" in c["resources"]["limits"] for c in pod["containers"])
        tolerated = {t["key"] for t in pod.get("tolerations", [])}
        assert asks_gpu == ("nvidia.com/gpu" in tolerated), pod["containers"][0]["name"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_token_auth_and_the_data_volume_owned_by_the_ray_user(name: str) -> None:
    spec = cluster_spec(name)
    assert spec["authOptions"] == {"mode": "token"}
    assert tuple(int(p) for p in spec["rayVersion"].split(".")) >= (2, 52)  # authOptions
    policy = load("networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    head = pods(name)[0]
    owner = head["initContainers"][0]
    assert owner["securityContext"]["runAsUser"] == 0
    assert "chown 1000:100 /home/ray/hiertx/data" in " ".join(owner["command"])
    assert all(pod["securityContext"]["fsGroup"] == 100 for pod in pods(name))


def test_the_rayjob_is_a_new_run_per_create_with_its_profile_and_results_kept() -> None:
    doc = load("rayjob.yaml")
    assert "name" not in doc["metadata"] and doc["metadata"]["generateName"] == "hiertx-repro-"
    entrypoint = doc["spec"]["entrypoint"]
    assert 'cp "profiles/$HIERTX_PROFILE.yaml" params.yaml' in entrypoint
    profile = yaml.safe_load(doc["spec"]["runtimeEnvYAML"])["env_vars"]["HIERTX_PROFILE"]
    params = yaml.safe_load((REPO / "profiles" / f"{profile}.yaml").read_text())
    assert params["train"]["scale"]["num_workers"] >= 1  # trainings on the GPU workers
    assert params["train"]["placement"]["use_gpu"] is True
    assert "python -m pipeline.repro --jobs" in entrypoint
    # results to the data volume, which outlives the head pod
    assert "out=data/results/" in entrypoint and "dvc.lock params.yaml metrics plots" in entrypoint
    assert entrypoint.rstrip("'").endswith("exit $status")  # the run's own exit status
