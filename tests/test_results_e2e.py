"""Issue 48's "done when", on one machine: the pipeline runs "remotely" (a clone at
``profiles/tiny.yaml`` with its checkpoints in a bucket of the local S3 server and its
MLflow server unreachable, so its runs go to the fallback store), pushes its results to the
bucket, and is deleted; a fresh clone at the same commit runs the documented command and
has ``dvc.lock``, the metrics, the model and the MLflow runs back, with ``dvc status`` up
to date.

Only one run's stages run (train and evaluate of the Transformer, after the shared
tokenized tiny project's check, download and tokenize): the whole tiny pipeline is
``tests/test_pipeline.py``'s, and what is pushed does not depend on how many stages ran.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.projects import VENV, copy_tokenized, run, venv_env
from tests.s3_server import S3Server

RUN = "transformer-chitchat"
STAGE = f"evaluate@{RUN}"
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing answers


def files_under(root: Path, *tops: str) -> dict[str, bytes]:
    found = {}
    for top in tops:
        path = root / top
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found.update({p.relative_to(root).as_posix(): p.read_bytes() for p in paths})
    return found


@pytest.mark.slow
def test_a_remote_run_pushed_deleted_and_pulled_into_a_fresh_clone(
    tmp_path: Path, s3: S3Server, tokenized_tiny: Path
) -> None:
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs the project's venv (run through `make test`)")
    # the cluster's project starts after tokenize (the run's own stages are train and
    # evaluate); the laptop clones the commit it was copied from
    cluster, laptop = tmp_path / "cluster", tmp_path / "laptop"
    copy_tokenized(tokenized_tiny, cluster)
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/results"
    env = venv_env(tmp_path / "unused.db") | {
        "MLFLOW_TRACKING_URI": UNREACHABLE,
        "HIERTX_STORAGE_PATH": f"s3://{bucket}/ray",
    }

    # "on the cluster": the run, then the push (what the jobs end with)
    run(cluster, env, str(VENV / "bin" / "dvc"), "repro", STAGE)
    assert (cluster / "runs" / "mlflow-fallback" / "mlflow.db").is_file()  # server down
    assert any(k.startswith("ray/") for k in s3.keys(bucket))  # checkpoints in the bucket
    pushed = run(cluster, env, sys.executable, "-m", "pipeline", "results", "push", url)
    assert f"make pull-results REMOTE={url}" in pushed
    kept = files_under(cluster, "dvc.lock", "params.yaml", f"metrics/{RUN}.json")
    kept |= files_under(cluster, f"data/train/{RUN}")
    assert any(name.endswith(".safetensors") or "model" in name for name in kept), kept.keys()
    shutil.rmtree(cluster)

    # on the laptop: a fresh clone, the documented command, a tracking store of its own
    subprocess.run(["git", "clone", "-q", str(tokenized_tiny), str(laptop)], check=True)
    team = tmp_path / "team.db"
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{team}"
    pulled = run(laptop, env, sys.executable, "-m", "pipeline", "results", "pull", url)
    assert "runs copied" in pulled, pulled[-3000:]
    got = files_under(laptop, "dvc.lock", "params.yaml", f"metrics/{RUN}.json")
    got |= files_under(laptop, f"data/train/{RUN}")
    assert got.keys() == kept.keys()
    assert [n for n in kept if got[n] != kept[n]] == []
    status = run(laptop, env, str(VENV / "bin" / "dvc"), "status", "--with-deps", STAGE)
    assert "up to date" in status, status

    from pipeline.tracking import store

    client = store.mlflow_client(f"sqlite:///{team}")
    runs = [
        r
        for e in client.search_experiments()
        for r in client.search_runs([e.experiment_id])
        if "hiertx.synced_from" in r.data.tags
    ]
    assert runs and all(r.info.status == "FINISHED" for r in runs), runs
    assert any(r.data.metrics for r in runs)
