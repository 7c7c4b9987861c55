"""``dvc.lock`` is what the committed code and params computed: every git-tracked dependency
it records (``stages/``, ``pipeline/``, ``params.yaml``, the committed example corpus)
hashes as the checkout's file does. Code changed without re-running what depends on it,
and committing the old ``dvc.lock``, fails here: the lock would claim results this code
never produced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tracked_files() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return set(out.stdout.splitlines())


def test_dvc_lock_records_the_committed_code_and_params() -> None:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    status = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    tracked = tracked_files()
    stale: dict[str, list[str]] = {}
    for stage, changes in json.loads(status.stdout or "{}").items():
        for change in changes:
            if not isinstance(change, dict):
                continue
            for path in change.get("changed deps", {}):
                inside = any(f == path or f.startswith(f"{path}/") for f in tracked)
                if inside and not path.startswith("data/"):
                    stale.setdefault(stage, []).append(path)
    assert not stale, (
        f"dvc.lock records other code or params than the checkout's: {stale}; run "
        "`make repro` and commit dvc.lock with the code"
    )
