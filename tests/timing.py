"""The suite's time, kept visible and bounded (a plugin ``tests/conftest.py`` registers).

- ``--time-report``: after the run, every test's time (set-up + call + teardown, slowest
  first) and each test file's total, gathered from the reports in the process that
  started the xdist workers.
- ``--time-limit S``: the run fails where a test outside :data:`OVER_A_MINUTE` took more
  than ``S`` seconds of the reference machine, or a shared (module- or session-scoped)
  fixture took more than that to set up. A test's own time leaves out the shared fixtures
  it happened to set up first (or to wait for, built by another worker): those are checked
  on their own, by name, so the verdict does not depend on which test ran first.
- The reference machine: one that runs :func:`calibration_workload` in
  :data:`REFERENCE_CALIBRATION_S`. The 2-core machines this suite runs on differ by up to
  2x from one instance to the next, the same code slower by about the same factor in every
  test; a limit in wall seconds fails a test for the machine it drew. So the controller
  times the workload before the run (the median of a few tries: single runs here vary by
  1.5x from one second to the next) and scales the limit by how much slower this machine
  is, never below ``S``, and prints both. ``--time-scale F`` fixes the factor instead
  (``1``: wall seconds).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import pytest

# Each test allowed over the limit, by node id (or a prefix of ids: a file, a test with its
# parameters), with what it proves that a shorter test could not. Longest first: the order
# xdist starts them in. Every one is marked ``slow`` (checked at collection). A shared
# fixture is named "<file>::<fixture>".
OVER_A_MINUTE: dict[str, str] = {
    "tests/bench/test_gpu_check.py::test_smoke_run_on_a_bare_machine": (
        "python -m bench.gpu_check --device cpu --smoke on a simulated bare machine (torch, "
        "numpy, pydantic and transformers only): every part's code path at toy sizes, the "
        "loop's step compiled by Inductor from a cold cache, as the GPU kit runs it"
    ),
    "tests/infra/test_cluster_repro.py::test_make_repro_jobs_2_on_the_cluster_equals_the_serial_run_and_outlives_it": (  # noqa: E501
        "make repro JOBS=2 on a three-node local Ray cluster, Ray Train's storage in a "
        "bucket: the search, trainings and evaluations; trainings overlap up to the slots, "
        "every seed's weights equal a serial run's (its module fixture), no MLflow run, "
        "metric or model version lost to concurrent writers; dvc status clean; then the "
        "results pushed, the project deleted and pulled into a fresh clone whole"
    ),
    "tests/test_pipeline.py::test_make_repro_as_a_user_then_compare_experiments": (
        "the README's make repro from a fresh clone at profiles/tiny.yaml, from a shell "
        "without the venv: every stage, tune included, then a DVC experiment compared with "
        "exp show, metrics/params/plots diff, make compare, and what invalidates what"
    ),
    "tests/infra/test_cluster_repro.py::test_ddp_places_one_worker_per_node_and_the_probe_sees_what_nodes_share": (  # noqa: E501
        "a DDP TorchTrainer puts one worker on each worker node of the module's three-node "
        "local_cluster.sh cluster (gradients all-reduced), and the shared-disk probe; it "
        "comes before the killed-node test, which costs the cluster a node (a group's "
        "tests run in this order)"
    ),
    "tests/infra/test_cluster_repro.py::test_a_killed_worker_node_resumes_to_the_serial_weights": (
        "a worker node's raylet killed mid-training: the run resumes from its checkpoint "
        "on the other node and ends with the serial run's weights"
    ),
    "tests/infra/test_gpu_placement.py::test_jobs_4_on_8_gpus_gives_every_training_its_own_gpu_share": (  # noqa: E501
        "the real pipeline.repro --jobs 4 on 8 logical GPUs: one Ray instance for the run, "
        "whole-GPU trainings on distinct GPUs, quarter-GPU ones packed on one, an "
        "in-process training leasing its own"
    ),
    "tests/infra/test_slurm.py::test_sbatch_starts_a_head_and_a_worker_and_runs_the_command_on_them": (  # noqa: E501
        "infra/slurm/hiertx.sbatch with stand-ins for srun and scontrol starts a real "
        "2-node Ray cluster and runs a driver that joins it with the job's token"
    ),
    "tests/test_custom_profile.py::test_custom_profile_from_a_fresh_clone": (
        "profiles/custom.yaml from a fresh clone: a chat_jsonl corpus of the user's declared, "
        "downloaded, tokenized; four models trained and evaluated; the report's own tables; "
        "editing the file puts exactly its stages out of date"
    ),
    "tests/data/test_tokenize_streaming.py::test_split_variants_stream_to_the_files_of_their_splits_built_whole": (  # noqa: E501
        "the split variants on real corpora (train_on: valid on MultiWOZ 2.1 with its acts, "
        "resplit_train on PersonaChat) stream to the files of their splits built whole"
    ),
    "tests/test_results_follow_code.py::test_kill_9_then_repro_resumes_to_the_uninterrupted_weights": (  # noqa: E501
        "kill -9 mid-training, then dvc repro resumes to the weights of an uninterrupted "
        "run (two trainings of 120 steps); a torn checkpoint falls back to the one before; "
        "none intact: the stage says how to start over, and that works"
    ),
    "tests/infra/test_fractional_gpus.py::test_gpus_per_worker_packs_n_trainings_onto_one_gpu": (
        "gpus_per_worker 1/N on a Ray instance with one GPU: N Ray Train runs share it at "
        "once, the (N+1)-th waits for one of them"
    ),
    "tests/execution/test_recompiles.py::test_ptb_batches_compile_one_inductor_graph": (
        "Inductor (C++ on CPU, as the loop compiles on a GPU) meets an epoch of PTB's batch "
        "geometry, its short last batch and the next epoch's first in one graph per model: "
        "Inductor's own size specialisations, which dynamo's eager backend does not make"
    ),
    "tests/infra/test_cluster_repro.py::serial": (
        "the serial reference of the JOBS=2 and killed-node tests: every seed trained "
        "in-process once, the weights both tests compare against"
    ),
    "tests/train/test_distributed.py::test_two_workers_match_one_and_ray_matches_local": (
        "Ray Train DDP with two workers takes the steps of one worker with both batches, and "
        "a one-worker Ray run equals the in-process run, weights torch.equal"
    ),
    "tests/train/test_distributed.py::test_a_torn_ray_checkpoint_resumes_from_the_one_before_and_none_intact_fails": (  # noqa: E501
        "three Ray Train runs of one name: a finished one, its resume past a torn newest "
        "checkpoint to the same weights, and the refusal once no checkpoint is intact"
    ),
    "tests/infra/test_join_cluster.py::on_a_head": (
        "beside a plain `ray start --head` in a private network namespace: without "
        "RAY_ADDRESS a stage's cluster is a private one, not that head; with "
        "RAY_ADDRESS=auto a fresh clone's train stage trains on that head's cluster"
    ),
    "tests/infra/test_mlflow_hosts.py::server": (
        "a real mlflow server on a new sqlite store (its migrations, uvicorn): about 15 s "
        "alone, 50 s beside two other workers on 2 cores"
    ),
    "tests/test_results_follow_code.py::test_a_code_change_retrains": (
        "a change to the loop's code retrains its stage under dvc repro, as a new run with "
        "other weights; the same code resumes to the same weights (three trainings)"
    ),
    "tests/tracking/test_mlflow_ui.py::test_the_experiment_opens_on_its_runs_table_in_a_browser": (
        "the MLflow UI of a real server opens the experiment on its runs table in headless "
        "Chromium (run, source, description) and a run's charts in the curves-then-eval order"
    ),
    "tests/train/test_mlflow_server.py::test_server_shows_run_metrics_and_registered_model": (
        "a training logs to a real MLflow server (sqlite and PostgreSQL stores): its params, "
        "its metrics' history, its registered model version"
    ),
    "tests/train/test_mlflow_server.py::test_server_dying_mid_run_then_sync_mlflow_carries_the_whole_run": (  # noqa: E501
        "an MLflow server killed mid-run: the run goes on in the local store, and "
        "`hiertx sync-mlflow` carries it, its children and its registered model whole to the "
        "server once it is back (two server starts, a pyfunc logged and served)"
    ),
    "tests/test_repro.py::test_jobs_2_trains_two_runs_at_once_in_processes_without_ray": (
        "make repro JOBS=2 without Ray: two trainings overlap, each in its stage's process "
        "(160 steps each, long enough to overlap)"
    ),
    "tests/train/test_tune.py::test_tune_stage_runs_trials_as_child_runs_writes_best_and_resumes": (
        "the tune stage's search of three trials, two at once, on the shared Ray instance: "
        "the trials as MLflow child runs, the best trial's record, and a rerun that "
        "restores the search (no new trial, the same answer, the same parent run)"
    ),
}
# The median seconds of CALIBRATION_TRIES runs of calibration_workload on the reference
# machine: a definition, near what a 2-core EPYC instance that ran the suite in 27.5 min
# measured (0.27-0.32 s before two runs of the suite; single tries 0.23-0.48 s).
REFERENCE_CALIBRATION_S = 0.3
CALIBRATION_TRIES = 7
# The reports' user property holding the seconds a test spent setting up shared fixtures.
SHARED = "shared_fixture_setup_s"

PHASES = ("setup", "call", "teardown")
REPO = Path(__file__).resolve().parents[1]


def declared(nodeid: str) -> str | None:
    """The :data:`OVER_A_MINUTE` entry that covers ``nodeid``, if any (``--dist loadgroup``
    suffixes the ids of an xdist group's tests with ``@<group>``: left out)."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        nodeid = nodeid[: nodeid.rfind("@")]
    for key in OVER_A_MINUTE:
        if nodeid == key or nodeid.startswith((f"{key}[", f"{key}::")):
            return key
    return None


def calibration_workload() -> None:
    """A fixed single-threaded piece of what the suite's tests spend their time on: a small
    Transformer layer's forward and backward passes in torch, then Python-level dict and
    string work."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        x = torch.randn(8, 32, 64, generator=generator)
        for _ in range(100):
            layer(x).sum().backward()
    finally:
        torch.set_num_threads(threads)
    counts: dict[str, int] = {}
    for i in range(500_000):
        key = str(i % 5000)
        counts[key] = counts.get(key, 0) + len(key)


def calibrate(tries: int = CALIBRATION_TRIES) -> float:
    """The median seconds of ``tries`` runs of :func:`calibration_workload` here."""
    seconds = []
    for _ in range(tries):
        started = time.perf_counter()
        calibration_workload()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class Timing:
    """Times each shared fixture's set-up where it runs (every process), and collects each
    test's phases from the reports (in the controller under xdist, where every worker's
    reports arrive) to report or enforce at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.limit: float | None = config.getoption("time_limit")
        # how many of this machine's seconds make one of the reference machine's
        self.scale: float = config.getoption("time_scale") or 1.0
        self.calibrated: float | None = None
        calibrating = self.limit is not None and config.getoption("time_scale") is None
        if calibrating and not _is_worker(config):
            self.calibrated = calibrate()
            self.scale = max(1.0, self.calibrated / REFERENCE_CALIBRATION_S)
        self.report = bool(config.getoption("time_report"))
        self.phases: dict[str, dict[str, float]] = defaultdict(dict)
        self.fixtures: dict[str, tuple[float, str]] = {}  # name -> (seconds, first user)
        self.started = time.monotonic()
        self._setting_up: pytest.Item | None = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list) -> None:
        unmarked = [
            item.nodeid
            for item in items
            if declared(item.nodeid) and item.get_closest_marker("slow") is None
        ]
        if unmarked:
            raise pytest.UsageError(
                "tests/timing.py's OVER_A_MINUTE lists tests not marked slow (mark them "
                f"@pytest.mark.slow): {', '.join(unmarked)}"
            )
        if getattr(config.option, "loadgroup", False):  # xdist workers under loadgroup
            keep_xdist_groups(items)
        if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike
            order = {key: i for i, key in enumerate(OVER_A_MINUTE)}
            rank = {item.nodeid: order.get(declared(item.nodeid), len(order)) for item in items}
            items.sort(key=lambda item: rank[item.nodeid])

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        self._setting_up = item
        try:
            return (yield)
        finally:
            self._setting_up = None

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        started = time.perf_counter()
        try:
            return (yield)
        finally:
            item = self._setting_up
            if fixturedef.scope != "function" and item is not None:
                seconds = time.perf_counter() - started
                name = f"{fixture_file(fixturedef)}::{fixturedef.argname}"
                item.user_properties.append((SHARED, {name: seconds}))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if _is_worker(self.config):
            return
        self.phases[report.nodeid][report.when] = report.duration
        if report.when == "setup":
            for key, value in report.user_properties:
                if key == SHARED:
                    for name, seconds in value.items():
                        self.phases[report.nodeid]["shared"] = (
                            self.phases[report.nodeid].get("shared", 0.0) + seconds
                        )
                        if seconds > self.fixtures.get(name, (0.0, ""))[0]:
                            self.fixtures[name] = (seconds, report.nodeid)

    @property
    def limit_here(self) -> float | None:
        """The limit in this machine's seconds."""
        return None if self.limit is None else self.limit * self.scale

    def describe_limit(self) -> str:
        """What the limit is here, and why."""
        if self.calibrated is None:
            return f"time limit: {self.limit_here:g} s"
        slower = self.calibrated / REFERENCE_CALIBRATION_S
        return (
            f"time limit: {self.limit:g} s of the reference machine, {self.limit_here:.0f} s "
            f"here (the calibration workload took {self.calibrated:.3f} s, "
            f"{REFERENCE_CALIBRATION_S:g} s there: {slower:.2f}x)"
        )

    def over_the_limit(self) -> list[str]:
        limit = self.limit_here
        if limit is None:
            return []
        lines = []
        for nodeid, phases in self.phases.items():
            own = sum(phases.get(p, 0.0) for p in PHASES) - phases.get("shared", 0.0)
            if own > limit and declared(nodeid) is None:
                parts = ", ".join(f"{p} {phases[p]:.1f} s" for p in PHASES if p in phases)
                if shared := phases.get("shared", 0.0):
                    parts += f"; not counted: {shared:.1f} s setting up shared fixtures"
                lines.append(f"{nodeid}: {own:.1f} s ({parts})")
        for name, (seconds, first) in self.fixtures.items():
            if seconds > limit and declared(name) is None:
                lines.append(f"{name} (a shared fixture): {seconds:.1f} s to set up, for {first}")
        return sorted(lines)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not _is_worker(self.config) and self.over_the_limit() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if _is_worker(self.config):
            return
        write = terminalreporter.write_line
        totals = {
            nodeid: sum(phases.get(p, 0.0) for p in PHASES)
            for nodeid, phases in self.phases.items()
        }
        if self.report and totals:
            terminalreporter.write_sep("=", "every test's time (set-up + call + teardown)")
            for nodeid, total in sorted(totals.items(), key=lambda kv: -kv[1]):
                shared = self.phases[nodeid].get("shared", 0.0)
                note = f"  ({shared:.1f} s setting up shared fixtures)" if shared >= 0.1 else ""
                write(f"{total:8.2f} s  {nodeid}{note}")
            per_file: dict[str, list[float]] = defaultdict(list)
            for nodeid, total in totals.items():
                per_file[nodeid.split("::")[0]].append(total)
            terminalreporter.write_sep("=", "time per test file (its tests' times summed)")
            for path, times in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
                write(f"{sum(times):8.1f} s  {len(times):4d} tests  {path}")
            workers = getattr(self.config.option, "numprocesses", None) or 1
            write(
                f"{sum(totals.values()):8.1f} s  {len(totals):4d} tests in all, "
                f"{time.monotonic() - self.started:.1f} s of wall time on {workers} worker(s)"
            )
        if self.limit is not None:
            write(self.describe_limit())
        over = self.over_the_limit()
        if over:
            terminalreporter.write_sep(
                "=",
                f"FAILED: over {self.limit_here:.0f} s and not in tests/timing.py's OVER_A_MINUTE",
            )
            for line in over:
                write(line, red=True)
            write(
                "make the test faster (share a fixture, shrink its sizes), or declare it in "
                "OVER_A_MINUTE with what it proves"
            )


def keep_xdist_groups(items: list) -> None:
    """Suffix each grouped test's id with ``@<group>``, as xdist's worker means to (the
    scheduler groups by that suffix): pytest-xdist 3.8 writes it to ``item._nodeid``, which
    pytest 9.2 no longer reads (its ids are structured, ``item._id``), so every group would
    be split silently (pytest-dev/pytest-xdist#1386). Does nothing where xdist did it."""
    from _pytest.nodeid import NodeId

    for item in items:
        groups = {
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        }
        if groups and item.nodeid.rfind("@") <= item.nodeid.rfind("]"):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(groups))}")


def fixture_file(fixturedef) -> str:
    """Where a fixture is defined, relative to the repository (as node ids spell files)."""
    path = Path(fixturedef.func.__code__.co_filename)
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return path.name


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("hiertx timing")
    group.addoption(
        "--time-report",
        action="store_true",
        help="print every test's time and each test file's total at the end",
    )
    group.addoption(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail the run where a test outside tests/timing.py's OVER_A_MINUTE takes longer "
        "(seconds of the reference machine: scaled by this machine's calibration)",
    )
    group.addoption(
        "--time-scale",
        type=float,
        default=None,
        metavar="FACTOR",
        help="this machine's seconds per reference second, instead of calibrating (1: the "
        "limit in wall seconds)",
    )
