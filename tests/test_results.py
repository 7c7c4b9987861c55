"""``python -m pipeline results push|pull|check`` against a real S3 API on 127.0.0.1 (moto's
server, the ``s3`` fixture), on a small DVC project of its own: a stage that writes cached
weights and uncached metrics, plots and a report, as the pipeline's stages do.

The round trip is the cluster's story: a clone runs ``dvc repro`` with its own params (a
profile copied over ``params.yaml``), pushes, and is deleted; a fresh clone at the same
commit pulls and has the run's files byte for byte, with ``dvc status`` clean.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli, results
from pipeline.errors import ConfigError, DataError
from tests.s3_server import S3Server

STAGE = """\
import hashlib, json, pathlib, yaml
seed = yaml.safe_load(open("params.yaml"))["seed"]
for folder in ("models", "metrics", "plots", "reports"):
    pathlib.Path(folder).mkdir(exist_ok=True)
pathlib.Path("models/weights.bin").write_bytes(hashlib.sha256(str(seed).encode()).digest() * 64)
pathlib.Path("metrics/score.json").write_text(json.dumps({"score": seed / 10}))
pathlib.Path("plots/curve.csv").write_text(f"step,loss\\n1,{seed}\\n")
pathlib.Path("reports/report.md").write_text(f"# seed {seed}\\n")
"""
DVC_YAML = f"""\
stages:
  train:
    cmd: {sys.executable} stage.py
    deps: [stage.py]
    params: [seed]
    outs:
      - models
      - plots/curve.csv:
          cache: false
      - reports/report.md:
          cache: false
    metrics:
      - metrics/score.json:
          cache: false
  later:
    cmd: {sys.executable} -c "open('later.bin', 'w').write('x')"
    deps: [models]
    outs: [later.bin]
"""
RUN_FILES = (
    "dvc.lock",
    "params.yaml",
    "metrics/score.json",
    "plots/curve.csv",
    "reports/report.md",
)


def sh(cwd: Path, *args: str) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def dvc(cwd: Path, *args: str) -> str:
    return sh(cwd, sys.executable, "-m", "dvc", *args)


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    """A git repository holding a one-stage DVC project (no run committed)."""
    repo = tmp_path / "origin"
    repo.mkdir()
    sh(repo, "git", "init", "-q", "-b", "main")
    sh(repo, "git", "config", "user.email", "t@example.com")
    sh(repo, "git", "config", "user.name", "t")
    dvc(repo, "init", "-q")
    with (repo / ".dvc" / "config").open("a") as config:
        config.write("[core]\n    analytics = false\n")
    (repo / "stage.py").write_text(STAGE)
    (repo / "dvc.yaml").write_text(DVC_YAML)
    (repo / "params.yaml").write_text("seed: 1\n")
    (repo / ".gitignore").write_text("/runs/\n/mlflow.db\n/mlartifacts/\n")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-q", "-m", "project")
    return repo


def clone(origin: Path, name: str) -> Path:
    target = origin.parent / name
    sh(origin.parent, "git", "clone", "-q", str(origin), str(target))
    return target


def cluster_run(origin: Path) -> Path:
    """A clone that ran the first stage with its own params (seed 7), as a cluster's run
    that stopped early does."""
    project = clone(origin, "cluster")
    (project / "params.yaml").write_text("seed: 7\n")
    dvc(project, "repro", "-q", "train")  # a run of some stages: `later` never ran
    return project


@pytest.mark.slow
def test_push_then_pull_into_a_fresh_clone_brings_the_run_back(origin: Path, s3: S3Server) -> None:
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/runs/one"
    cluster = cluster_run(origin)
    manifest = results.push(cluster, url)
    assert manifest["git_commit"] == sh(cluster, "git", "rev-parse", "HEAD").strip()
    assert set(RUN_FILES) <= set(manifest["files"])
    assert manifest["uncommitted"] == []  # params.yaml changed, but it travels
    sent = {name: (cluster / name).read_bytes() for name in (*RUN_FILES, "models/weights.bin")}
    keys = s3.keys(bucket)
    assert "runs/one/results.tar.gz" in keys
    cached = [k for k in keys if k.startswith("runs/one/dvc/files/md5/")]
    assert cached, keys  # the weights, as DVC's remote stores them
    # nothing the user would commit changed: the remote lives in .dvc/config.local
    assert sh(cluster, "git", "status", "--porcelain", ".dvc") == ""
    assert "hiertx-results" in (cluster / ".dvc" / "config.local").read_text()

    laptop = clone(origin, "laptop")
    sh(origin.parent, "rm", "-rf", str(cluster))
    assert cli.main(["results", "pull", url, "--root", str(laptop)]) == 0
    for name, content in sent.items():
        assert (laptop / name).read_bytes() == content, name
    status = dvc(laptop, "status", "train")  # the stage that ran (`later` never did)
    assert "up to date" in status, status


def test_check_accepts_a_bucket_and_refuses_what_cannot_work(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = s3.new_bucket()
    assert cli.main(["results", "check", f"s3://{bucket}/x"]) == 0
    assert f"s3://{bucket}/x is ready" in capsys.readouterr().out
    missing = f"s3://no-such-{bucket}/x"
    assert cli.main(["results", "check", missing]) == 2
    assert f"bucket no-such-{bucket} of {missing} does not exist" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cannot open ftp://host/x"):
        results.open_place("ftp://host/x")
    with pytest.raises(ConfigError, match="HIERTX_RESULTS_URL"):
        results.results_url(None)
    assert s3.keys(bucket) == []


def test_a_scheme_without_its_dvc_plugin_is_refused_naming_the_package(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    bucket = s3.new_bucket()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "dvc_s3" else find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match="pip install dvc-s3"):
        results.open_place(f"s3://{bucket}/x")


def test_push_without_a_run_is_refused_before_anything_is_sent(origin: Path, s3: S3Server) -> None:
    bucket = s3.new_bucket()
    with pytest.raises(DataError, match=r"no dvc.lock: nothing has run here"):
        results.push(origin, f"s3://{bucket}/p")
    assert s3.keys(bucket) == []
    assert not (origin / ".dvc" / "config.local").exists()


def test_pull_refuses_a_clone_at_another_commit_and_missing_results(
    origin: Path, s3: S3Server
) -> None:
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/p"
    with pytest.raises(ConfigError, match=f"no results at {url}"):
        results.pull(origin, url)
    other = "0" * 40
    manifest = {"format": 1, "git_commit": other, "files": {"params.yaml": "x"}}
    results._write_bundle(results.open_place(url), origin, manifest)
    before = (origin / "params.yaml").read_bytes()
    with pytest.raises(ConfigError, match=f"git checkout {other}"):
        results.pull(origin, url)
    assert (origin / "params.yaml").read_bytes() == before
    assert not (origin / ".dvc" / "config.local").exists()


def test_pull_checks_every_file_against_the_manifest(origin: Path, s3: S3Server) -> None:
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/p"
    commit = sh(origin, "git", "rev-parse", "HEAD").strip()
    manifest = {"format": 1, "git_commit": commit, "files": {"params.yaml": "0" * 64}}
    results._write_bundle(results.open_place(url), origin, manifest)
    with pytest.raises(DataError, match=r"params\.yaml is missing or damaged"):
        results.pull(origin, url)


def test_pull_never_replaces_an_mlflow_store_the_clone_has(origin: Path, s3: S3Server) -> None:
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/p"
    store_db = "runs/mlflow-fallback/mlflow.db"
    (origin / store_db).parent.mkdir(parents=True)
    (origin / store_db).write_bytes(b"the cluster's runs")
    commit = sh(origin, "git", "rev-parse", "HEAD").strip()
    manifest = {
        "format": 1,
        "git_commit": commit,
        "files": {store_db: results.sha256(origin / store_db)},
    }
    results._write_bundle(results.open_place(url), origin, manifest)
    (origin / store_db).write_bytes(b"the laptop's own runs")
    with pytest.raises(ConfigError, match="already has the MLflow store runs/mlflow-fallback"):
        results.pull(origin, url)
    assert (origin / store_db).read_bytes() == b"the laptop's own runs"


@pytest.mark.slow
def test_the_fallback_mlflow_runs_reach_the_laptops_store(
    origin: Path, s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster's tracking server was unreachable: its runs are in the fallback store,
    which travels in the bundle and is replayed with sync-mlflow on the laptop."""
    from pipeline.tracking import store

    bucket = s3.new_bucket()
    url = f"s3://{bucket}/p"
    cluster = cluster_run(origin)
    fallback = store.fallback_uri(cluster)
    client = store.mlflow_client(fallback)
    experiment = store.experiment_id(client, "hiertx-generate-chitchat")
    run = client.create_run(experiment, run_name="train-transformer")
    client.log_metric(run.info.run_id, "valid_loss", 4.5, step=3)
    (tmp_path / "note.txt").write_text("an artifact")
    client.log_artifact(run.info.run_id, str(tmp_path / "note.txt"))
    client.set_terminated(run.info.run_id)
    results.push(cluster, url)

    laptop = clone(origin, "laptop")
    server = f"sqlite:///{tmp_path / 'team.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    assert cli.main(["results", "pull", url, "--root", str(laptop)]) == 0
    team = store.mlflow_client(server)
    copies = team.search_runs(
        [store.experiment_id(team, "hiertx-generate-chitchat")],
        f"tags.`hiertx.synced_from` = '{run.info.run_id}'",
    )
    assert len(copies) == 1
    copy = copies[0]
    assert [m.value for m in team.get_metric_history(copy.info.run_id, "valid_loss")] == [4.5]
    note = Path(team.download_artifacts(copy.info.run_id, "note.txt", str(tmp_path)))
    assert note.read_text() == "an artifact"


def test_changed_files_names_tracked_edits_only(origin: Path) -> None:
    """What the manifest's ``uncommitted`` is made of: a run whose code differed from its
    commit says so on the laptop."""
    (origin / "stage.py").write_text(STAGE + "# edited on the cluster\n")
    (origin / "untracked.txt").write_text("not in git")
    assert results.changed_files(origin) == ["stage.py"]


def test_the_bundle_carries_the_results_document_and_its_figures(origin: Path) -> None:
    """The study's ``report.results`` document is written by the report stage beside its
    DVC outputs, and committed: it travels in the bundle with its figures' folder."""
    (origin / "params.yaml").write_text("seed: 1\nreport:\n  results: results/STUDY.md\n")
    (origin / "results" / "study").mkdir(parents=True)
    for name in ("results/STUDY.md", "results/study/curves.png", "results/OTHER.md"):
        (origin / name).write_text(name)
    assert results.results_document(origin) == ["results/STUDY.md", "results/study/curves.png"]
    (origin / "params.yaml").write_text("seed: 1\nreport:\n  results: null\n")
    assert results.results_document(origin) == []


def test_a_bundle_member_that_is_a_link_or_leaves_the_project_is_refused(tmp_path: Path) -> None:
    import io
    import tarfile

    for name, kind in (("metrics/x.json", tarfile.SYMTYPE), ("../outside", tarfile.REGTYPE)):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            member = tarfile.TarInfo(name)
            member.type, member.linkname = kind, "/etc/passwd" if kind == tarfile.SYMTYPE else ""
            tar.addfile(member, io.BytesIO(b""))
        buffer.seek(0)
        with tarfile.open(fileobj=buffer) as tar, pytest.raises(DataError, match="not a plain"):
            results._extract_member(tar, tar.next(), tmp_path / "into", "s3://b/r")
        assert not (tmp_path / "into").exists() and not (tmp_path / "outside").exists()
