"""``python -m pipeline.repro`` on a toy DVC project, with the real ``dvc`` (no mocks).

The toy pipeline: ``prep`` -> four ``work@a..d`` (each sleeps ``SLEEP_S`` and records its
start and end time in ``runs.jsonl``, outside every DVC output) -> ``report``. Each stage
command appends one line to ``runs.jsonl`` per run, so that file also counts executions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SLEEP_S = 1.5
WORK = ["work@a", "work@b", "work@c", "work@d"]

DVC_YAML = """\
stages:
  prep:
    cmd: python stage.py prep
    deps: [stage.py]
    outs: [out/prep.txt]
  work:
    foreach: [a, b, c, d]
    do:
      cmd: python stage.py work ${item}
      deps: [stage.py, out/prep.txt]
      outs:
        - out/work/${item}.txt
  report:
    cmd: python stage.py report
    deps: [stage.py, out/work]
    outs: [out/report.txt]
"""

STAGE_PY = f"""\
import json, os, sys, time

kind, item = sys.argv[1], (sys.argv[2:] or [""])[0]
start = time.time()
if kind == "prep":
    os.makedirs("out", exist_ok=True)
    open("out/prep.txt", "w").write("prep\\n")
elif kind == "work":
    print(f"working on {{item}}")
    if os.path.exists(f"fail-{{item}}"):
        print(f"work {{item}} fails on purpose")
        sys.exit(3)
    time.sleep({SLEEP_S})
    os.makedirs("out/work", exist_ok=True)
    open(f"out/work/{{item}}.txt", "w").write(open("out/prep.txt").read() + item + "\\n")
else:
    # not DVC's .gitignore: it lists the outputs in the order their stages finished
    parts = sorted(p for p in os.listdir("out/work") if not p.startswith("."))
    open("out/report.txt", "w").write("".join(open(f"out/work/{{p}}").read() for p in parts))
with open("runs.jsonl", "a") as log:
    name = f"{{kind}}@{{item}}" if item else kind
    log.write(json.dumps({{"stage": name, "start": start, "end": time.time()}}) + "\\n")
"""


def env() -> dict[str, str]:
    """The venv first on PATH (so a stage's ``python`` is the venv's); this repo importable."""
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "DVC_NO_ANALYTICS": "1"}


def run(project: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run a command in the toy project, output captured (stderr into stdout)."""
    return subprocess.run(
        argv, cwd=project, env=env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def dvc(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = run(project, str(BIN / "dvc"), *args)
    assert done.returncode == 0, done.stdout
    return done


def repro(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run(project, sys.executable, "-m", "pipeline.repro", *args)


def make_project(
    root: Path,
    dvc_yaml: str = DVC_YAML,
    scripts: dict[str, str] | None = None,
    ignored: tuple[str, ...] = ("/runs.jsonl", "/fail-*"),
) -> Path:
    """``git init`` + ``dvc init`` + a toy pipeline (default: this module's), its stage
    ``scripts`` by file name, DVC's per-repo cache dirs kept inside."""
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    dvc(root, "init", "-q")
    dvc(root, "config", "--local", "core.site_cache_dir", str(root / ".site-cache"))
    (root / ".gitignore").write_text("".join(f"{p}\n" for p in ("/.site-cache", *ignored)))
    (root / "dvc.yaml").write_text(dvc_yaml)
    for name, text in (scripts or {"stage.py": STAGE_PY}).items():
        (root / name).write_text(text)
    return root


def runs(project: Path) -> list[dict[str, float | str]]:
    path = project / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = open_now = 0
    for _, step in events:
        open_now += step
        best = max(best, open_now)
    return best


def outputs(project: Path) -> dict[str, str]:
    return {
        str(p.relative_to(project)): p.read_text()
        for p in sorted((project / "out").rglob("*"))
        if p.is_file() and p.name != ".gitignore"  # DVC's, in stage completion order
    }


def lock_outs(project: Path) -> dict[str, object]:
    """Each stage's recorded outputs in dvc.lock (hashes), for comparing two runs."""
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    return {name: stage["outs"] for name, stage in lock["stages"].items()}


@pytest.fixture(scope="module")
def parallel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The toy project after ``--jobs 2``, and that run's output."""
    project = make_project(tmp_path_factory.mktemp("repro") / "parallel")
    done = repro(project, "--jobs", "2")
    assert done.returncode == 0, done.stdout
    return project, done.stdout


@pytest.mark.slow
def test_jobs_2_runs_two_stages_at_a_time_in_dependency_order(parallel: tuple[Path, str]) -> None:
    project, output = parallel
    times = {r["stage"]: (float(r["start"]), float(r["end"])) for r in runs(project)}
    assert sorted(times) == sorted(["prep", *WORK, "report"])
    assert max_overlap([times[w] for w in WORK]) == 2
    assert all(times["prep"][1] <= times[w][0] for w in WORK)
    assert max(times[w][1] for w in WORK) <= times["report"][0]
    # streamed with the stage's prefix, status lines, report left to the closing `dvc repro`
    assert "[work@c] working on c" in output
    assert "started work@b (2 running, 1/5 done)" in output
    assert "done work@a in " in output
    assert "[dvc repro] Running stage 'report'" in output
    assert "Running stage 'work@" not in output.split("started dvc repro")[1]
    log = json.loads((project / ".dvc/tmp/repro-times.json").read_text())
    assert [r["stage"] for r in log["stages"]][:1] == ["prep"]
    assert sorted(r["stage"] for r in log["stages"]) == sorted(["prep", *WORK])
    assert all(r["returncode"] == 0 and r["start"] < r["end"] for r in log["stages"])
    assert log["repro"]["stage"] == "dvc repro" and log["repro"]["returncode"] == 0
    assert json.loads(dvc(project, "status", "--json").stdout) == {}


@pytest.mark.slow
def test_second_run_starts_no_stage_command(parallel: tuple[Path, str]) -> None:
    project, _ = parallel
    before, outs = len(runs(project)), outputs(project)
    done = repro(project, "--jobs", "3")
    assert done.returncode == 0, done.stdout
    assert len(runs(project)) == before, done.stdout
    assert outputs(project) == outs
    # DVC's status finds every scheduled stage up to date: no `dvc repro -s` is started
    assert "up to date: prep work@a work@b work@c work@d\n" in done.stdout
    assert "started work@" not in done.stdout and "started prep" not in done.stdout
    assert "Data and pipelines are up to date" in done.stdout


@pytest.mark.slow
def test_only_a_stale_stage_and_what_depends_on_it_run_again(tmp_path: Path) -> None:
    project = make_project(tmp_path / "stale")
    assert repro(project, "--jobs", "2").returncode == 0
    (project / "out" / "work" / "b.txt").write_text("edited by hand\n")  # work@b is stale
    done = repro(project, "--jobs", "2")
    assert done.returncode == 0, done.stdout
    assert "up to date: prep work@a work@c work@d\n" in done.stdout
    started = [line for line in done.stdout.splitlines() if line.startswith("started ")]
    assert started == [
        "started work@b (1 running, 0/1 done)",
        "started dvc repro (the remaining stages)",
    ]
    # DVC itself restores the edited output (from its run cache: the command does not run)
    assert "[work@b] Stage 'work@b' is cached - skipping run, checking out outputs" in done.stdout
    assert (project / "out" / "work" / "b.txt").read_text() == "prep\nb\n"
    assert json.loads(dvc(project, "status", "--json").stdout) == {}


@pytest.mark.slow
def test_a_failed_stage_stops_the_run_and_nothing_downstream_runs(tmp_path: Path) -> None:
    project = make_project(tmp_path / "failing")
    (project / "fail-b").touch()
    done = repro(project, "--jobs", "2")
    assert done.returncode != 0
    assert "stage work@b failed" in done.stdout
    assert "work b fails on purpose" in done.stdout.split("stage work@b failed")[1]  # its tail
    ran = {r["stage"] for r in runs(project)}
    assert "report" not in ran and "work@b" not in ran
    assert "started dvc repro" not in done.stdout
    log = json.loads((project / ".dvc/tmp/repro-times.json").read_text())
    assert {r["stage"]: r["returncode"] for r in log["stages"]}["work@b"] != 0
    assert log["repro"] is None


@pytest.mark.slow
def test_jobs_1_is_a_plain_dvc_repro(tmp_path: Path, parallel: tuple[Path, str]) -> None:
    project = make_project(tmp_path / "serial")
    done = repro(project, "--jobs", "1")
    assert done.returncode == 0, done.stdout
    assert "started" not in done.stdout and "[" not in done.stdout.split("\n")[0]
    times = [(float(r["start"]), float(r["end"])) for r in runs(project)]
    assert len(times) == 6 and max_overlap(times) == 1
    assert outputs(project) == outputs(parallel[0])
    assert lock_outs(project) == lock_outs(parallel[0])
    assert json.loads(dvc(project, "status", "--json").stdout) == {}


def test_a_ready_stage_on_the_longest_chain_starts_first() -> None:
    """A tuned training waits for its search; once the search is done it goes before the
    plain trainings still waiting, which can run beside it (then dvc.yaml order)."""
    from pipeline.repro import topological

    names = ["prep", "work@a", "work@b", "search", "tuned", "report"]
    upstream = {
        "prep": set(),
        "work@a": {"prep"},
        "work@b": {"prep"},
        "search": {"prep"},
        "tuned": {"search"},
        "report": {"work@a", "work@b", "tuned"},
    }
    assert topological(names, upstream) == ["prep", "search", "tuned", "work@a", "work@b", "report"]


def test_dry_run_prints_the_waves(tmp_path: Path) -> None:
    project = make_project(tmp_path / "dry")
    done = repro(project, "--jobs", "4", "--dry-run")
    assert done.returncode == 0, done.stdout
    assert textwrap.dedent("""\
          wave 1: prep
          wave 2: work@a work@b work@c work@d
        then `dvc repro` for: report
        """) in done.stdout  # fmt: skip
    assert runs(project) == []


@pytest.mark.slow
def test_jobs_2_trains_two_runs_at_once_in_processes_without_ray(
    tokenized_tiny: Path, tmp_path: Path
) -> None:
    """``make repro JOBS=2`` on one machine with ``train.scale.num_workers: 0``: two train
    stages' trainings overlap (their MLflow curves' timestamps: when each was stepping),
    each in its stage's own process. No stage starts or joins Ray: ``RAY_ADDRESS`` points
    at a port where nothing listens, so one that tried would fail; tune runs (Ray Tune)
    are left out of the params."""
    from tests.infra.test_cluster_repro import most_at_once, training_intervals
    from tests.projects import VENV, copy_tokenized, edit_params, user_env
    from tests.projects import run as run_in

    root = tmp_path / "p"
    copy_tokenized(tokenized_tiny, root)  # tokenized: the trainings are what is timed
    runs = {f"{m}-chitchat": {"model": m, "corpus": "chitchat"} for m in ("transformer", "gpt")}
    for key, value in {
        "train.runs": runs,
        "tune.runs": {},
        "train.scale.num_workers": 0,
        "train.defaults.epochs": 40,  # long enough to overlap: 160 steps of 4 batches
    }.items():
        edit_params(root, key, value)
    mlflow_db = tmp_path / "mlflow.db"
    env = user_env(mlflow_db, f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}")
    env |= {"RAY_ADDRESS": "127.0.0.1:9", "OMP_NUM_THREADS": "1"}
    output = run_in(root, env, str(VENV / "bin" / "python"), "-m", "pipeline.repro", "--jobs", "2")
    log = json.loads((root / ".dvc/tmp/repro-times.json").read_text())
    stages = {r["stage"] for r in log["stages"]}
    assert {"train@transformer-chitchat", "train@gpt-chitchat"} <= stages, output[-3000:]
    assert "in this process" in output  # the train stage's line: no Ray Train workers
    intervals = training_intervals(f"sqlite:///{mlflow_db}")
    assert len(intervals) == 2 and most_at_once(intervals) == 2, intervals
