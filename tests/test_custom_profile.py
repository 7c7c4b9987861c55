"""Your own dialogues, as the README tells a user: ``cp profiles/custom.yaml params.yaml &&
make repro`` in a fresh copy trains every model of the profile on ``examples/chat.jsonl``
and ends with a report of the corpus's own tables; then editing the file puts exactly that
corpus's download and tokenize out of date (and, through them, what trains on it).

The trainings are cut to :data:`SHORTER` (every epoch, its validation and the evaluation
as the profile says; 8 batches an epoch instead of all of them: the four trainings took
445 of the 609 s of ``dvc repro`` at this profile on a busy 2-core machine, and nothing here
reads what they learn). That the profile as shipped validates is
``tests/plan/test_check.py``'s."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.projects import DVC, USER_PATH, VENV, dvc_json, edit_params, fresh_copy, run, user_env

# 32 steps: the profile's 50-step warm-up would outlast them (refused), so 3
SHORTER = {"train.defaults.max_batches_per_epoch": 8, "train.defaults.schedule.warmup_steps": 3}


@pytest.mark.slow
def test_custom_profile_from_a_fresh_clone(tmp_path: Path) -> None:
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs the project's venv (run through `make test`)")
    root = tmp_path / "hiertx"
    fresh_copy(root)
    shutil.copy2(root / "profiles" / "custom.yaml", root / "params.yaml")
    for key, value in SHORTER.items():
        edit_params(root, key, value)
    env = user_env(tmp_path / "mlflow.db")
    run(root, env, "make", "-o", str(VENV / ".installed"), f"VENV={VENV}", "repro")

    params = yaml.safe_load((root / "params.yaml").read_text())
    for key in params["train"]["runs"]:
        metrics = json.loads((root / "metrics" / f"{key}.json").read_text())
        assert metrics["n_examples"] > 0, key
    report = (root / "reports" / "report.md").read_text()
    assert "### Corpus: mychats" in report
    assert "#### Validation loss and test perplexity" in report
    assert "#### Response selection" in report and "#### Language-model perplexity" in report
    assert "In the paper" not in report and "U-Net Transformer, Tables" not in report

    # editing the declared file: only its corpus's stages are out of date
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{USER_PATH}"
    assert dvc_json(root, env, "status") == {}
    with (root / "examples" / "chat.jsonl").open("a") as f:
        message = [
            {"role": "user", "content": "one more?"},
            {"role": "assistant", "content": "sure"},
        ]
        f.write(json.dumps({"messages": message}) + "\n")
    # the stages that read the downloaded corpus and nothing else (evaluate declares it for
    # MultiWOZ's database and goals, on every corpus: a foreach stage cannot tell them apart)
    readers = {"tokenize@mychats", *(f"evaluate@{key}" for key in params["train"]["runs"])}
    assert set(dvc_json(root, env, "status")) == {"download@mychats"} | readers
    run(root, env, DVC, "repro", "-s", "download@mychats")
    assert set(dvc_json(root, env, "status")) == readers
