"""THE end-to-end CI test: ``dvc repro`` of ``profiles/tiny.yaml`` in a fresh copy of the
project (download -> tokenize -> tune -> train -> evaluate -> report), then a no-op
``dvc repro``, then a tokenize param change: tokenize re-runs, download does not, and
everything downstream is out of date."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1200


def project_files() -> list[str]:
    """What a commit of the working tree holds: tracked and untracked-but-not-ignored."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


def repro(root: Path, env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [str(Path(sys.executable).with_name("dvc")), "repro", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"dvc repro failed:\n{output[-6000:]}"
    return output


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


@pytest.mark.slow
def test_dvc_repro_tiny_profile(tmp_path):
    root = tmp_path / "hiertx"
    for name in project_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    shutil.copy2(REPO / "profiles" / "tiny.yaml", root / "params.yaml")
    (root / "dvc.lock").unlink(missing_ok=True)  # a fresh pipeline for the tiny params
    git = ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.com"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "fresh clone"], cwd=root, check=True)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "DVC_NO_ANALYTICS": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "OMP_NUM_THREADS": "1",
    }
    params = yaml.safe_load((root / "params.yaml").read_text())
    keys = [*params["train"]["runs"], *params["tune"]["runs"]]

    first = repro(root, env)
    assert {"download@chitchat", "tokenize@chitchat", "report"} <= ran(first)

    report = (root / "reports" / "report.md").read_text()
    tables = json.loads((root / "reports" / "tables.json").read_text())["tables"]
    for key in keys:
        metrics = json.loads((root / "data" / "eval" / key / "metrics.json").read_text())
        assert metrics["n_examples"] > 0
        assert f"| {key} |" in report  # the overview
        assert any(row["run"] == key for t in tables for row in t["rows"])  # a paper table
        curve = (root / "reports" / "curves" / f"{key}.csv").read_text().splitlines()
        assert curve[0] == "step,valid_loss" and len(curve) >= 2
    for png in ("learning_curves", "metrics", "length_vs_loss", "attention_masks", "unet_widths"):
        assert (root / "reports" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dvc = str(Path(sys.executable).with_name("dvc"))
    plots = subprocess.run(
        [dvc, "plots", "show", "--json"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "transformer-chitchat.csv" in plots

    second = repro(root, env)
    assert not ran(second) and "Data and pipelines are up to date" in second

    # A tokenize param: tokenize re-runs, download does not; its new shards put every
    # downstream stage out of date (checked with `dvc status`, not paid for again).
    params["tokenize"]["on_error"] = "skip"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    third = repro(root, env, "--single-item", "tokenize@chitchat")
    assert ran(third) == {"tokenize@chitchat"}
    status = subprocess.run(
        [dvc, "status", "--json"], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    stale = set(json.loads(status.stdout))
    assert "download@chitchat" not in stale and "tokenize@chitchat" not in stale
    assert {"train@transformer-chitchat", "tune@hier-chitchat", "report"} <= stale
