"""What the cluster documentation tells a user to run is so: the README's "On a cluster",
``infra/README.md`` and the launch configs' headers.

* ``ray job submit`` runs the pipeline in the synced project (``cd ~/hiertx``), not with
  ``--working-dir .``, which runs it in an uploaded copy without the data mount and makes
  ``make`` build a ``.venv`` there (aws.yaml's header said so).
* The job API on the head's 127.0.0.1:8265 is reached through a tunnel (``ray dashboard``,
  ``kubectl port-forward``) set up in the same block before it is used.
* The tests ``infra/README.md`` cites exist (it cited a ``test_local_cluster.py`` long gone).
* Token authentication: Ray makes it the default from 2.59 for local clusters and from 2.61
  for all; the README says which, and what the pinned Ray gives a ``ray up`` cluster.
* Every MLflow server name the docs export is one ``.env.example`` lets the server answer
  (``mlflow.example.internal`` got 403 "Invalid Host header").
* The Makefile says what ``make setup`` installs of torch where (it said "its CPU wheel is
  pinned": plain PyPI gives the CUDA build).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mlflow.server.security_utils import is_allowed_host_header

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "infra" / "README.md"]
HEADERS = [REPO / "infra" / "ray" / "aws.yaml", REPO / "infra" / "ray" / "gcp.yaml"]
HEADERS += [REPO / "infra" / "kuberay" / "raycluster.yaml"]


def blocks(path: Path) -> list[str]:
    """The commands a user copies: a markdown file's fenced blocks, a config's header."""
    text = path.read_text()
    if path.suffix == ".md":
        return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)
    return ["\n".join(line for line in text.splitlines() if line.startswith("#"))]


def submits(block: str) -> list[str]:
    """Each ``ray job submit`` with its continuation lines."""
    joined = re.sub(r"\\\n#?\s*", " ", block)
    return [line for line in joined.splitlines() if "ray job submit" in line]


@pytest.mark.parametrize("path", DOCS + HEADERS, ids=lambda p: str(p.relative_to(REPO)))
def test_jobs_run_in_the_synced_project_after_a_tunnel_to_the_job_api(path: Path) -> None:
    found = 0
    for block in blocks(path):
        for command in submits(block):
            found += 1
            assert "--working-dir" not in command, command
            assert re.search(r"cd (~|/home/ray)/hiertx &&", command), command
        if "http://127.0.0.1:8265" in block and "ray job" in block:
            first_use = block.index("http://127.0.0.1:8265")
            tunnel = [block.find(t) for t in ("ray dashboard", "kubectl port-forward")]
            assert any(0 <= t < first_use for t in tunnel), block[:400]
    assert found, f"{path}: no ray job submit (the test looks at the wrong text)"


def test_the_tests_infra_readme_cites_exist() -> None:
    text = (REPO / "infra" / "README.md").read_text()
    cited = set(re.findall(r"\b(test_\w+\.py)\b", text))
    assert {"test_ray_up.py", "test_kuberay.py", "test_slurm.py"} <= cited
    present = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    assert cited <= present, sorted(cited - present)


def test_the_token_auth_default_is_stated_for_the_pinned_ray() -> None:
    pins = (REPO / "constraints.txt").read_text()
    ray = re.search(r"^ray==(\d+)\.(\d+)\.(\d+)$", pins, re.M)
    assert ray is not None
    version = tuple(int(p) for p in ray.groups())
    text = " ".join((REPO / "README.md").read_text().split())
    assert "Ray >= 2.59 starts" not in text  # 2.59 is local clusters only
    assert "from 2.59 for local clusters only and from 2.61 for all clusters" in text
    assert f"pins Ray {'.'.join(map(str, version))}" in text
    if version < (2, 61):
        assert "a `ray up` cluster has none" in text
    infra = " ".join((REPO / "infra" / "README.md").read_text().split())
    assert f"pins Ray {'.'.join(map(str, version))}, so a `ray up` cluster has none" in infra


def test_every_mlflow_server_name_in_the_docs_is_allowed() -> None:
    lines = (REPO / "infra" / "mlflow" / ".env.example").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    allowed = env["MLFLOW_ALLOWED_HOSTS"].split(",")
    text = "\n".join(block for p in DOCS for block in blocks(p))  # the commands, not prose
    hosts = re.findall(r"MLFLOW_TRACKING_URI=https?://([^/\s'\"]+)", text)
    assert hosts
    refused = [h for h in hosts if not is_allowed_host_header(allowed, h)]
    assert not refused, refused


def test_the_makefile_says_which_torch_build_setup_installs() -> None:
    text = (REPO / "Makefile").read_text()
    assert "CPU wheel is pinned" not in text
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "the CUDA one" in text
