"""THE end-to-end CI test, run the way a user runs the project, at ``profiles/tiny.yaml``
in a fresh git copy (the tiny pipeline runs once, the checks share it):

1. ``make repro`` from a shell whose PATH has no venv (README's main command);
2. the stages find the project's venv by themselves when ``dvc`` is typed without it;
3. DVC experiments keep their metrics, params and plots: ``dvc exp run -S``,
   ``dvc exp show``, ``dvc metrics diff``, ``dvc params diff``, ``dvc plots show/diff``;
4. ``tracking.*`` and ``train.placement.*`` changes invalidate nothing; a tokenize param
   re-runs tokenize, not download, and puts everything downstream out of date.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.projects import (
    DVC,
    NOT_FROM_USER_SHELL,
    REPO,
    USER_PATH,
    VENV,
    dvc_json,
    edit_params,
    fresh_copy,
    git,
    ran,
    run,
    user_env,
)


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """``{file: {"data": {metric: value}}}`` of ``dvc exp show --json`` -> numeric leaves."""
    out = {}
    for path, content in (metrics or {}).items():
        for name, value in (content.get("data") or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{path}:{name}"] = float(value)
    return out


@pytest.mark.slow
def test_make_repro_as_a_user_then_compare_experiments(tmp_path):
    """``make repro`` runs with ``VENV=`` the venv of this test run and ``-o`` on its
    ``.installed`` stamp: the set-up step is then up to date instead of installing torch
    and the project into the copy (minutes, and the network), while everything after it
    runs as on a fresh machine. About 5 minutes on 2 cores, most of it the first repro."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs the project's venv (run through `make test`)")
    started = time.perf_counter()
    root = tmp_path / "hiertx"
    fresh_copy(root)
    env = user_env(tmp_path / "mlflow.db") | {"OMP_NUM_THREADS": "1"}
    make = ["make", "-o", str(VENV / ".installed"), f"VENV={VENV}", "repro"]
    params = yaml.safe_load((root / "params.yaml").read_text())
    keys = [*params["train"]["runs"], *params["tune"]["runs"]]

    # 1. the README's main command from a shell without the venv
    first = run(root, env, *make)
    assert {"check", "download@chitchat", "tokenize@chitchat", "report"} <= ran(first)
    report = (root / "reports" / "report.md").read_text()
    tables = json.loads((root / "reports" / "tables.json").read_text())["tables"]
    curves = (root / "plots" / "valid_loss.csv").read_text().splitlines()
    ranking = (root / "plots" / "valid_ranking_loss.csv").read_text().splitlines()
    assert curves[0] == "step,valid_loss,run"
    assert ranking[0] == "step,valid_ranking_loss,run"
    for key in keys:
        metrics = json.loads((root / "metrics" / f"{key}.json").read_text())
        assert metrics["n_examples"] > 0
        assert f"| {key} |" in report  # the overview
        assert any(row["run"] == key for t in tables for row in t["rows"])  # a paper table
        assert any(line.endswith(f",{key}") for line in curves[1:] + ranking[1:]), key
    for png in ("learning_curves", "metrics", "length_vs_loss", "attention_masks", "unet_widths"):
        assert (root / "reports" / "figures" / f"{png}.png").read_bytes()[
            :8
        ] == b"\x89PNG\r\n\x1a\n"
    second = run(root, env, *make)
    assert not ran(second) and "Data and pipelines are up to date" in second

    # 2. `dvc` typed without the venv: `python` is the user's, which lacks the project
    user_python = shutil.which("python", path=USER_PATH)
    probe = "import importlib.metadata as m; m.distribution('hiertx')"
    lacks = (
        user_python is not None
        and subprocess.run([user_python, "-c", probe], cwd="/", capture_output=True).returncode
    )
    if lacks:
        refused = run(root, env, DVC, "repro", "-f", "-s", "check", ok=False)
        assert f"{user_python}" in refused and "lacks hiertx" in refused, refused
        assert "make repro" in refused and "source .venv/bin/activate" in refused
    (root / ".venv").symlink_to(VENV)  # what `make setup` leaves in a clone
    if user_python is None:  # no `python` at all: only an activated venv gives one
        env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{USER_PATH}"
    rerun = run(root, env, DVC, "repro", "-f", "-s", "check")
    if lacks:
        assert f"re-running with {root / '.venv' / 'bin' / 'python'}" in rerun
    assert ran(rerun) == {"check"}

    # 3. experiments: the results are committed as a user does, then compared
    run(root, env, DVC, "plots", "show")  # writes dvc_plots/index.html: not for git
    assert (root / "dvc_plots" / "index.html").is_file()
    git(root, "add", "-A")
    staged = {p.split("/")[0] for p in git(root, "diff", "--cached", "--name-only").split()}
    assert {"metrics", "plots", "dvc.lock"} <= staged and not {".venv", "dvc_plots"} & staged
    git(root, "commit", "-qm", "tiny run")
    head = git(root, "rev-parse", "HEAD").strip()
    exp = run(root, env, DVC, "exp", "run", "-n", "fewer-batches", "-S", "evaluate.max_batches=1")
    assert {f"evaluate@{k}" for k in params["train"]["runs"]} <= ran(exp)
    if lacks:  # typed without the venv: each stage found .venv by itself
        assert "re-running with" in exp
    assert "tune@hier-chitchat" not in ran(exp) and "train@gpt-chitchat" not in ran(exp)

    shown = dvc_json(root, env, "exp", "show")
    rows = {"workspace": shown[0]["data"]}
    (baseline,) = [r for r in shown[1:] if r["rev"] == head]
    rows["main"] = baseline["data"]
    (experiment,) = [e["revs"][0] for e in baseline["experiments"] or []]
    assert experiment["name"] == "fewer-batches"
    rows["experiment"] = experiment["data"]
    for label, row in rows.items():
        found = numbers(row["metrics"])
        for key in keys:
            assert f"metrics/{key}.json:n_examples" in found, (label, sorted(found)[:5])
    assert numbers(rows["workspace"]["metrics"]) == numbers(rows["experiment"]["metrics"])
    assert rows["experiment"]["params"]["params.yaml"]["data"]["evaluate"]["max_batches"] == 1
    assert rows["main"]["params"]["params.yaml"]["data"]["evaluate"]["max_batches"] == 2

    diff = dvc_json(root, env, "metrics", "diff", "HEAD")
    changed = {
        (path, name): (d["old"], d["new"])
        for path, metrics in diff.items()
        for name, d in metrics.items()
    }
    old, new = changed[("metrics/transformer-chitchat.json", "n_examples")]
    assert old > new > 0  # evaluate.max_batches: 2 -> 1
    assert dvc_json(root, env, "params", "diff", "HEAD") == {
        "params.yaml": {"evaluate.max_batches": {"old": 2, "new": 1, "diff": -1}}
    }

    # `make compare REV=HEAD`: the experiment's key metrics beside their change since HEAD,
    # within the 120 columns the README promises (the make line itself aside)
    compared = run(root, env, *make[:-1], "compare", "REV=HEAD").splitlines()
    tables = [line for line in compared if " -m pipeline compare" not in line]
    assert max(map(len, tables)) <= 120, tables
    continuations = sum(" continued" in line for line in tables)
    for key in keys:
        # a row in its task's table, and one in each continuation where 120 columns split it
        rows = [line for line in tables if line.split()[:1] == [key]]
        assert 1 <= len(rows) <= 1 + continuations, compared
        assert all("(gone)" not in row for row in rows), compared
        # each value beside its change (fewer-batches vs HEAD)
        assert all(row.count("(") >= 1 for row in rows), compared
        assert sum(row.count("(") for row in rows) >= 2, compared

    plots = dvc_json(root, env, "plots", "diff", "HEAD")["data"]
    (chart,) = plots["plots/valid_loss.csv"]
    spec = chart["content"]
    assert spec["title"]["text"] == "Validation loss per run (generate and lm runs)"
    assert spec["spec"]["encoding"]["y"]["title"] == "cross-entropy (nats/token)"
    (ranking_chart,) = plots["plots/valid_ranking_loss.csv"]
    ranked = {v["run"] for v in ranking_chart["content"]["data"]["values"]}
    assert spec["facet"]["field"] == "run"  # a panel per run, titled with its name
    assert spec["spec"]["encoding"]["color"]["field"] == "series"  # "<run> @ <revision>"
    values = spec["data"]["values"]
    assert {v["run"] for v in values} | ranked == set(keys) and ranked
    assert not {v["run"] for v in values} & ranked
    assert {v["rev"] for v in values} == {"workspace", "HEAD"}

    # 4. tracking settings record results and placement settings place runs: they do not
    # change them
    edit_params(root, "tracking.log_model", True)
    edit_params(root, "tracking.sample_generations", 3)
    edit_params(root, "train.placement.cpus_per_worker", 2)
    edit_params(root, "train.placement.max_failures", 1)
    assert set(dvc_json(root, env, "status")) <= {"check"}

    # A tokenize param: tokenize re-runs, download does not; its new shards put every
    # downstream stage out of date (checked with `dvc status`, not paid for again).
    edit_params(root, "tokenize.on_error", "skip")
    third = run(root, env, DVC, "repro", "--single-item", "tokenize@chitchat")
    assert ran(third) == {"tokenize@chitchat"}
    stale = set(dvc_json(root, env, "status"))
    assert "download@chitchat" not in stale and "tokenize@chitchat" not in stale
    assert {"train@transformer-chitchat", "tune@hier-chitchat", "report"} <= stale
    print(f"end-to-end: {time.perf_counter() - started:.0f} s")


# --------------------------------------------------------------------------- the interpreter
# What `python -m stages.<name>` does when the `python` on PATH lacks the project (fast:
# a stand-in stage in a tmp project that has only the stages package).

BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"
# A stage as stages/<name>.py are written: the explicit entry first, then the work.
HELLO = """import sys

from stages import ensure_project_interpreter

if __name__ == "__main__":
    ensure_project_interpreter("stages.hello")

print("stage ran in", sys.prefix)
"""


def stand_in_project(root: Path) -> Path:
    (root / "stages").mkdir(parents=True)
    shutil.copy2(REPO / "stages" / "__init__.py", root / "stages" / "__init__.py")
    (root / "stages" / "hello.py").write_text(HELLO)
    return root


def base_python_lacks_project() -> bool:
    probe = "import importlib.metadata as m; m.distribution('hiertx')"
    # not from the project root: its hiertx.egg-info (`pip install -e`) would be found
    done = subprocess.run([str(BASE_PYTHON), "-c", probe], cwd="/", capture_output=True)
    return done.returncode != 0


needs_bare_python = pytest.mark.skipif(
    sys.prefix == sys.base_prefix or not BASE_PYTHON.is_file() or not base_python_lacks_project(),
    reason="needs a venv and a base Python without the project",
)


def run_stage(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in NOT_FROM_USER_SHELL}
    env.pop("HIERTX_STAGE_REEXEC_FROM", None)
    return subprocess.run(
        [str(BASE_PYTHON), "-m", "stages.hello", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_bare_python
def test_stage_reruns_itself_with_the_project_venv(tmp_path):
    root = stand_in_project(tmp_path / "project")
    (root / ".venv").symlink_to(sys.prefix)
    result = run_stage(root, "--flag")
    assert result.returncode == 0, result.stderr
    assert f"re-running with {root / '.venv' / 'bin' / 'python'}" in result.stderr
    assert result.stdout.strip() == f"stage ran in {root / '.venv'}"


@needs_bare_python
def test_temp_experiment_copy_uses_the_enclosing_projects_venv(tmp_path):
    """``dvc exp run --temp`` runs the stages in ``<project>/.dvc/tmp/exps/<name>/``."""
    project = tmp_path / "project"
    (project / ".dvc").mkdir(parents=True)
    (project / ".venv").symlink_to(sys.prefix)
    root = stand_in_project(project / ".dvc" / "tmp" / "exps" / "tmpabc")
    result = run_stage(root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"stage ran in {project / '.venv'}"


@needs_bare_python
def test_stage_without_a_venv_says_what_to_do(tmp_path):
    root = stand_in_project(tmp_path / "project")
    result = run_stage(root)
    assert result.returncode == 1 and not result.stdout
    message = result.stderr
    assert message.startswith(f"stages.hello: the Python that ran this stage, {BASE_PYTHON}")
    assert "lacks hiertx" in message and "`make repro`" in message
    assert "`make setup`" in message and "`source .venv/bin/activate`" in message


@needs_bare_python
def test_broken_venv_is_not_re_run_twice(tmp_path):
    """A ``.venv`` without the project: one re-run, then the advice names that venv."""
    root = stand_in_project(tmp_path / "project")
    subprocess.run(
        [str(BASE_PYTHON), "-m", "venv", "--without-pip", str(root / ".venv")], check=True
    )
    result = run_stage(root)
    assert result.returncode == 1
    assert result.stderr.count("re-running with") == 1
    assert f"{root / '.venv' / 'bin' / 'python'} lacks them too: run `make setup`" in result.stderr


@needs_bare_python
def test_importing_the_stages_package_runs_nothing(tmp_path):
    """Only a stage's explicit entry re-runs it: a module of the package without that call
    runs in whatever Python started it, though a project venv is there."""
    root = stand_in_project(tmp_path / "project")
    (root / ".venv").symlink_to(sys.prefix)
    (root / "stages" / "hello.py").write_text("import sys\nprint('ran in', sys.prefix)\n")
    result = run_stage(root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ran in {sys.base_prefix}" and not result.stderr


STAGE_SCRIPTS = sorted((REPO / "stages").glob("[!_]*.py"))


@pytest.mark.parametrize("script", STAGE_SCRIPTS, ids=lambda p: p.stem)
def test_every_stage_ensures_its_interpreter_before_importing_the_project(script: Path):
    """``ensure_project_interpreter("stages.<name>")`` under ``if __name__ ==
    "__main__":``, before any import but the standard library's and ``stages``'; and the
    script parses on an old Python, which runs it up to there."""
    import ast

    tree = ast.parse(script.read_text(), feature_version=(3, 8))
    first = next(i for i, node in enumerate(tree.body) if isinstance(node, ast.If))
    guard = tree.body[first]
    assert ast.unparse(guard.test) == "__name__ == '__main__'"
    assert ast.unparse(guard.body[0]) == f"ensure_project_interpreter('stages.{script.stem}')"
    before = [n for n in tree.body[:first] if isinstance(n, ast.Import | ast.ImportFrom)]
    modules = {a.name for n in before if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in before if isinstance(n, ast.ImportFrom)}
    assert modules <= set(sys.stdlib_module_names) | {"__future__", "stages"}, modules
