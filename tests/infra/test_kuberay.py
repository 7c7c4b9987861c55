"""The KubeRay manifests: valid against KubeRay's CRDs, and what a run on them needs.

* Schema: every manifest against the ``openAPIV3Schema`` of KubeRay v1.7.0's CRDs
  (``ray-operator/config/crd/bases/ray.io_{rayclusters,rayjobs}.yaml`` of the release tag),
  strictly: an object schema that lists its properties accepts no other key, as
  ``kubectl apply --validate=strict`` does. The CRD files are read from
  ``$HIERTX_KUBERAY_CRDS`` or ``../shared/kuberay-crds-v1.7.0/`` beside the repository (a
  read-only mirror of the release's files, as ``shared/data`` mirrors the corpora; CI has
  it), checked against its ``SHA256SUMS`` first. Without them the test skips, which CI
  counts as a failure.
* Bucket access through a service account (IRSA / Workload Identity) on every pod.
* The ``nvidia.com/gpu`` toleration on every pod that asks for a GPU.
* The profile chosen at submit time, and one whose trainings use the GPU workers.
* Results that outlive the head pod (copied to the data volume).
* ``generateName``: every ``kubectl create`` is a new run.
* Token auth for the dashboard and job API (``authOptions``), and a NetworkPolicy that
  admits the cluster's own pods and the operator (in its own namespace), nothing else.
* The data volume writable by the image's ``ray`` user (uid 1000, group 100) without a
  root ``chown`` (EFS access points and Azure Files refuse it: the head stayed in Init).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.batches import shared_dir

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
    """``$HIERTX_KUBERAY_CRDS``, else ``shared/kuberay-crds-<version>`` beside the checkout
    or its origin (``tests.batches.shared_dir``); None where neither holds the CRDs."""
    env = os.environ.get("HIERTX_KUBERAY_CRDS")
    folder = Path(env) if env else shared_dir(f"kuberay-crds-{CRD_VERSION}", "SHA256SUMS")
    return folder if (folder / "SHA256SUMS").is_file() else None


def verified_crd(folder: Path, name: str) -> bytes:
    """The CRD file's bytes, once its sha256 matches the mirror's SHA256SUMS."""
    sums = dict(
        reversed(line.split(maxsplit=1))
        for line in (folder / "SHA256SUMS").read_text().splitlines()
        if line.strip()
    )
    data = (folder / name).read_bytes()
    assert name in sums, f"{name} is not in {folder}/SHA256SUMS"
    assert hashlib.sha256(data).hexdigest() == sums[name], f"{folder}/{name}: sha256 differs"
    return data


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
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_match_kuberay_crd_schema(name: str) -> None:
    folder = crd_folder()
    if folder is None:  # a failure on CI (tests/conftest.py), which has the mirror
        pytest.skip(
            f"KubeRay {CRD_VERSION} CRDs not found: ../shared/kuberay-crds-{CRD_VERSION}/"
            " beside the repository, or $HIERTX_KUBERAY_CRDS"
        )
    data = verified_crd(folder, f"ray.io_{MANIFESTS[name]}.yaml")
    crd = yaml.load(data, yaml.CSafeLoader)
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
def test_token_auth_and_the_data_volume_writable_by_the_ray_user_without_chown(
    name: str,
) -> None:
    spec = cluster_spec(name)
    assert spec["authOptions"] == {"mode": "token"}
    assert tuple(int(p) for p in spec["rayVersion"].split(".")) >= (2, 52)  # authOptions
    for pod in pods(name):
        # no root container chowning the volume: EFS access points and Azure Files answer
        # EPERM, the init container fails and the head never starts
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert "chown" not in " ".join(container.get("command", [])), container["name"]
            assert container.get("securityContext", {}).get("runAsUser") != 0
        assert pod["securityContext"] == {"fsGroup": 100, "fsGroupChangePolicy": "OnRootMismatch"}
    if name == "rayjob.yaml":  # and a volume it cannot write is said at once
        entrypoint = load(name)["spec"]["entrypoint"]
        assert entrypoint.index("test -w data ||") < entrypoint.index("pipeline.repro")


def selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels only, as these manifests use) on labels."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admitted(policy: dict[str, Any], namespace: str, pod: dict[str, str], source: str) -> bool:
    """Whether the NetworkPolicy (in ``namespace``) admits traffic to a pod it selects from
    a pod with labels ``pod`` in namespace ``source``: a peer's podSelector alone means the
    policy's namespace; namespaceSelector and podSelector in one peer must both match."""
    namespace_labels = {"kubernetes.io/metadata.name": source}  # set by Kubernetes >= 1.22
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
            in_namespace = (
                selected(peer["namespaceSelector"], namespace_labels)
                if "namespaceSelector" in peer
                else source == namespace
            )
            if in_namespace and selected(peer.get("podSelector", {}), pod):
                return True
    return False


def test_the_network_policy_admits_the_ray_pods_and_the_operator_only() -> None:
    """The operator polls every RayJob's dashboard from its own namespace; a policy that
    admits only this namespace's Ray pods left KubeRay v1.7.0 marking the RayJob Failed
    after 300 s (JobStatusCheckTimeoutExceeded). Operator pod labels: KubeRay v1.7.0's Helm
    chart and kustomize manifests (``app.kubernetes.io/component: kuberay-operator``)."""
    policy = load("networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    ray_pod = {"app.kubernetes.io/created-by": "kuberay-operator", "ray.io/node-type": "head"}
    assert selected(policy["spec"]["podSelector"], ray_pod)
    operator_namespace = next(
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
        if "namespaceSelector" in peer
    )
    assert operator_namespace != "hiertx"
    helm = {
        "app.kubernetes.io/name": "kuberay-operator",
        "app.kubernetes.io/instance": "kuberay-operator",
        "app.kubernetes.io/component": "kuberay-operator",
    }
    kustomize = {
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/component": "kuberay-operator",
    }
    for operator in (helm, kustomize):
        assert admitted(policy, "hiertx", operator, operator_namespace), operator
        assert not admitted(policy, "hiertx", operator, "someone-else")
    assert admitted(policy, "hiertx", ray_pod, "hiertx")  # GCS, objects, the submitter
    assert not admitted(policy, "hiertx", ray_pod, "someone-else")  # another's Ray pods
    assert not admitted(policy, "hiertx", {"app": "web"}, "hiertx")
    assert not admitted(policy, "hiertx", {"app": "web"}, operator_namespace)
    text = (KUBERAY / "networkpolicy.yaml").read_text()
    assert "kubectl get pods -A -l app.kubernetes.io/component=kuberay-operator" in text


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
    # results to the bucket, which outlives the cluster (tests/infra/test_results_paths.py)
    assert entrypoint.index("pipeline results check") < entrypoint.index("pipeline.repro")
    assert entrypoint.index("pipeline.repro") < entrypoint.index("pipeline results push")
    assert entrypoint.rstrip("'").endswith("exit $status")  # the run's own exit status


def test_a_crd_file_that_differs_from_its_checksum_is_refused(tmp_path: Path) -> None:
    folder = crd_folder()
    if folder is None:
        pytest.skip(f"KubeRay {CRD_VERSION} CRDs not found (../shared/kuberay-crds-{CRD_VERSION})")
    name = "ray.io_rayjobs.yaml"
    assert verified_crd(folder, name)  # the mirror as its SHA256SUMS pins it
    (tmp_path / "SHA256SUMS").write_bytes((folder / "SHA256SUMS").read_bytes())
    (tmp_path / name).write_bytes((folder / name).read_bytes().replace(b"submissionMode", b"x", 1))
    with pytest.raises(AssertionError, match="sha256 differs"):
        verified_crd(tmp_path, name)
