"""``python -m bench.gpu_check``: its smoke run on a machine that has only the bare
packages (the cluster stack refused), its results section, its pieces."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.common import MetricStamps
from bench.gpu_check import cli, processes
from bench.gpu_check.cli import PARTS, Spec, parser, setup_of
from bench.gpu_check.loop import epochs_that_fit, sized_knobs
from bench.gpu_check.peers import gpt_candidates, lm_batch
from bench.gpu_check.processes import MemoryShare, Outcome, run_at_once, shared
from bench.gpu_check.report import Check, LoopRate, Part, peak_tflops, replace_section, summary
from bench.models import TOY_LM, gpt
from pipeline.config import RunParams
from pipeline.data.special import EOS_ID
from pipeline.train.loop import TrainJob
from tests.train.helpers import PoolFactory, ToyFactory

REPO = Path(__file__).resolve().parents[2]
BARE = ("torch", "numpy", "pyarrow", "pydantic", "PyYAML")  # issue 32's bare GPU machine
OPTIONAL = ("transformers",)  # the HF peer rows
PROJECT = ("pipeline", "bench", "tests")
CLUSTER = {"ray", "mlflow", "dvc", "gensim"}


def requirement_closure(roots: tuple[str, ...]) -> set[str]:
    """The installed distributions ``roots`` need (their non-extra requirements, with
    what those need), canonical names."""
    todo, seen = [canonicalize_name(r) for r in roots], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def top_levels(distributions: set[str]) -> set[str]:
    """The importable top-level names of ``distributions``."""
    return {
        top
        for top, dists in importlib.metadata.packages_distributions().items()
        if any(canonicalize_name(d) in distributions for d in dists)
    }


def vendored(tops: set[str]) -> dict[str, Path]:
    """The packages that the packages ``tops`` carry in a ``_vendor`` folder they put on
    ``sys.path`` themselves (setuptools', whose ``_distutils`` Inductor's C++ builder
    imports), by top-level name: their folder."""
    out = {}
    for top in sorted(t for t in tops if t.isidentifier()):
        spec = importlib.util.find_spec(top)
        for location in (spec.submodule_search_locations or []) if spec else []:
            folder = Path(location) / "_vendor"
            if folder.is_dir() and not (folder / "__init__.py").exists():  # not a subpackage
                names = {p.stem for p in folder.iterdir() if p.stem.isidentifier()}
                out |= dict.fromkeys(names - {"__pycache__"}, folder)
    return out


def bare_environment(log: Path, lacking: tuple[str, ...] = ()) -> dict[str, str]:
    """Environment variables that make a Python process (and those it spawns) a bare GPU
    machine's (``tests/bench/bare_site/sitecustomize.py``), with transformers optional;
    ``lacking``: top-level packages that machine does not have either."""
    allowed = top_levels(requirement_closure(BARE)) | set(PROJECT)
    optional = top_levels({canonicalize_name(name) for name in OPTIONAL})
    brought = top_levels(requirement_closure(OPTIONAL)) - allowed - optional
    installed = set(importlib.metadata.packages_distributions())
    denied = installed - allowed - optional - brought - set(sys.stdlib_module_names)
    denied |= set(lacking)
    folders = vendored(allowed)
    assert denied >= CLUSTER  # installed here, absent there
    site = REPO / "tests" / "bench" / "bare_site"
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]),
        "HIERTX_BARE_OPTIONAL": ",".join(sorted(optional)),
        "HIERTX_BARE_BROUGHT": ",".join(sorted(brought)),
        "HIERTX_BARE_DENIED": ",".join(sorted(denied)),
        "HIERTX_BARE_LOG": str(log),
        "HIERTX_BARE_VENDORED": os.pathsep.join(sorted({str(f) for f in folders.values()})),
        "OMP_NUM_THREADS": "1",
    }


def test_the_bare_machine_refuses_what_it_lacks(tmp_path: Path) -> None:
    """The guard the smoke run relies on: the cluster stack and scipy are absent (import
    fails, ``find_spec`` says None), transformers imports with what it needs (not with
    what it merely uses where present), and a package only transformers needs is refused
    to the project's code."""
    code = """
import importlib.util, sys
for name in ("ray", "mlflow", "dvc", "gensim", "scipy"):
    assert importlib.util.find_spec(name) is None, name
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(name + " imported")
assert importlib.util.find_spec("tokenizers") is None  # a requirement of transformers alone
from transformers import GPT2Config  # optional: it imports its own requirements
assert "tokenizers" not in sys.modules and "huggingface_hub" in sys.modules
assert "scipy" not in sys.modules  # transformers uses it where present: not here
print("bare")
"""
    env = bare_environment(tmp_path / "loaded.log")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "bare"
    log = (tmp_path / "loaded.log").read_text().splitlines()
    assert "refused tokenizers <- __main__" in log and "refused ray <- __main__" in log


@pytest.mark.slow
def test_smoke_run_on_a_bare_machine(shared_data: Path, tmp_path: Path) -> None:
    """``--device cpu --smoke`` runs every part to the end where only the bare packages
    (and transformers) exist, replaces the results file's GPU section and nothing else,
    and no process it started loaded anything outside those packages. Its loop part
    compiles the loop's step with Inductor (a cold compile is most of this test's time on
    a CPU: about 2 minutes on a loaded 2-core machine), so one training at a time
    (``--processes 1``): the four runs still train four at once."""
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "# Benchmarks\n\n## Before\n\nkept\n\n## GPU (old)\n\nstale\n\n## After\n\nkept too\n"
    )
    log = tmp_path / "loaded.log"
    command = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--smoke"]
    command += ["--ptb", str(shared_data / "ptb"), "--results", str(results), "--processes", "1"]
    done = subprocess.run(
        command, cwd=REPO, env=bare_environment(log), capture_output=True, text=True, timeout=1500
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    for spec in PARTS.values():
        status = out.split(f"### {spec.title}\n\n", 1)[1].split("\n", 1)[0]
        assert status.startswith("ran in "), f"{spec.title}: {status}"
    assert "## Summary" in out and "skipped" not in out
    written = results.read_text()
    assert "stale" not in written and "kept\n" in written and written.endswith("kept too\n")
    assert written.index("## Before") < written.index("## GPU (`python -m bench.gpu_check`)")
    assert written.index("## GPU (") < written.index("## After")
    assert "| GPT vs GPT-2, compiled: speed |" in written
    loop = out.split("### The loop on", 1)[1].split("###", 1)[0]
    assert "compile on" in loop  # the loop's step compiled (Inductor) where auto would not
    assert "| flex compiled |" in written  # FlexAttention built inside a compiled graph
    assert "command: `OMP_NUM_THREADS=1 python -m bench.gpu_check --device cpu --smoke" in written
    lines = [line.split() for line in log.read_text().splitlines()]
    processes = [line[2:] for line in lines if line[0] == "loaded"]
    # the check, its fork server, and the 1 and 4 trainings forked from it
    assert len(processes) >= 1 + 1 + 1 + 4
    loaded = {name for names in processes for name in names}
    allowed = top_levels(requirement_closure(BARE + OPTIONAL)) | set(PROJECT)
    allowed |= set(vendored(allowed))  # found in the _vendor folder of setuptools (torch's)
    allowed |= {"sitecustomize", "cython_runtime"}  # the guard; Cython's runtime (no package)
    assert loaded <= allowed, loaded - allowed
    assert not loaded & CLUSTER


def test_results_section_is_replaced_in_place_or_appended() -> None:
    new = "## GPU (`python -m bench.gpu_check`)\n\nfresh\n"
    document = "# B\n\n## A\n\na\n\n## GPU (issue 16)\n\nold\n\nmore old\n\n## Z\n\nz\n"
    assert replace_section(document, new) == (
        "# B\n\n## A\n\na\n\n## GPU (`python -m bench.gpu_check`)\n\nfresh\n\n## Z\n\nz\n"
    )
    last = "# B\n\n## GPU\n\nold\n"
    assert replace_section(last, new) == "# B\n\n" + new
    assert replace_section("# B\n\n## A\n\na\n", new) == "# B\n\n## A\n\na\n\n" + new


def test_summary_lists_every_part_with_its_status() -> None:
    ran = Part("gpt2", "peers", 100, seconds=12.0, compile_s=7.4)
    skipped = Part("loop", "the loop", 70, skipped="no --ptb DIR")
    failed = Part("sync", "syncs", 40, failed="RuntimeError (x.py:3): synced", seconds=41.0)
    text = summary([ran, skipped, failed])
    assert "| peers | ran in 12 s; compiling 7 s of it |  |  |  | 12 / 100 (7) |" in text
    assert "| the loop | skipped: no --ptb DIR |" in text
    assert "| syncs | FAILED: RuntimeError (x.py:3): synced |" in text
    assert failed.status.startswith("FAILED") and "over its" not in ran.status
    assert "over its 40 s budget" in Part("x", "x", 40, seconds=41.0).status


def stamps(times: list[float], tokens_per_s: float, evals: tuple[float, ...] = ()) -> tuple:
    lines = [
        {"train_loss": 1.0, "step": 10 * (i + 1), "time": t, "tokens_per_s": tokens_per_s}
        for i, t in enumerate(times)
    ]
    lines += [{"valid_loss": 1.0, "step": 0, "time": t} for t in evals]
    return tuple(sorted(lines, key=lambda line: line["time"]))


def test_shared_rates_count_the_span_where_all_processes_ran() -> None:
    # a: steady windows from t=2 to t=10 at 100 tokens/s; b starts later (t=6) at 50/s,
    # with an evaluation inside its window (7, 8]; the first window of each is warm-up.
    a = Outcome("a", stamps([1, 2, 4, 6, 8, 10], 100.0), 0.0, None)
    b = Outcome("b", stamps([5, 6, 7, 8, 9, 12], 50.0, evals=(7.5,)), 0.0, None)
    assert [(w.start, w.end) for w in b.windows(1)] == [(6, 7), (8, 9), (9, 12)]
    result = shared([a, b], warmup=1)
    # all were steady from max(2, 6) = 6 to min(10, 12) = 10, of the span 2..12
    assert result.overlap == pytest.approx(4 / 10)
    assert result.rates["a"].tokens_per_s == pytest.approx(100.0)  # windows (6,8], (8,10]
    assert result.rates["b"].tokens_per_s == pytest.approx(50.0)  # windows (6,7], (8,9]
    assert result.rates["b"].steps_per_s == pytest.approx(20 / 2)  # 10 steps a window
    with pytest.raises(RuntimeError, match="no steady training windows in c"):
        shared([a, Outcome("c", stamps([1, 2], 1.0), 0.0, None)], warmup=1)


def test_the_four_runs_take_the_epochs_that_fit() -> None:
    rate = LoopRate(processes=4, steps_per_s_each=10.0, startup_s=30.0)
    # 132 steps at 10 steps/s: 13.2 s an epoch; 0.6 of the 90 s left after start-up: 4
    assert epochs_that_fit(120.0, rate, 132, 175) == 4
    assert epochs_that_fit(120.0, None, 132, 175) == 2  # the loop did not run: the least
    fast = LoopRate(processes=4, steps_per_s_each=1e6, startup_s=30.0)
    assert epochs_that_fit(120.0, fast, 132, 30) == 30  # the profile's
    assert epochs_that_fit(10.0, rate, 132, 175) == 2  # at least two: one timed apart


def test_sized_runs_scale_the_averaged_epochs() -> None:
    averaged = RunParams(epochs=175, averaging={"kind": "uniform", "epochs": 50})
    update = sized_knobs(averaged, 7)
    assert update["epochs"] == 7
    assert update["averaging"].kind == "uniform" and update["averaging"].epochs == 2  # 7 x 50/175
    assert sized_knobs(averaged, 3)["averaging"].kind == "none"  # 3 x 50/175 < 1
    assert sized_knobs(RunParams(epochs=30), 4) == {"epochs": 4}


def test_bad_arguments_stop_before_any_compute(tmp_path: Path) -> None:
    def stop(*argv: str, device: str = "cpu") -> str:
        with pytest.raises(SystemExit) as stopped:
            setup_of(parser().parse_args(["--device", device, "--smoke", *argv]), tmp_path)
        return str(stopped.value)

    assert stop("--ptb", str(tmp_path / "nope")) == f"--ptb {tmp_path / 'nope'}: no such folder"
    (tmp_path / "ptb.train.txt").write_text(" a b \n")
    assert stop("--ptb", str(tmp_path)).startswith(
        f"--ptb {tmp_path}: no ptb.valid.txt, ptb.test.txt there; copy Mikolov's"
    )
    assert stop("--processes", "0") == "--processes 0: at least 1"
    assert stop("--profile", "nope.yaml") == "--profile nope.yaml: no such file"
    if not torch.cuda.is_available():
        assert stop(device="cuda").startswith("--device cuda: no CUDA device here; --device cpu")


def test_a_cpu_run_at_full_size_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: ``--device cpu`` without ``--smoke`` ran HIER at full size (400 s over a
    40 s budget) and ``--parts sync`` wrote its section over the committed one."""
    monkeypatch.setattr(cli, "REPO", tmp_path)  # where bench/RESULTS.md would be written
    (tmp_path / "bench").mkdir()
    profile = str(REPO / "profiles" / "paper.yaml")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--device", "cpu", "--parts", "sync", "--time-limit", "0", "--profile", profile])
    assert "add --smoke" in str(stopped.value)
    assert not (tmp_path / "bench" / "RESULTS.md").exists()


def fake_cuda(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    """A machine whose CUDA device ``cli.main`` believes in (no part may touch it), with
    ``root`` as the repository: its ``bench/RESULTS.md`` returned."""
    monkeypatch.setattr(cli, "REPO", root)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    (root / "bench").mkdir()
    results = root / "bench" / "RESULTS.md"
    results.write_text("# Benchmarks\n\n## GPU\n\ncommitted\n")
    return results


class Passing(Spec):
    """A part that runs nothing and passes."""

    def run(self, check: Check, part: Part) -> None:
        part.text.append("nothing measured")


class Failing(Spec):
    def run(self, check: Check, part: Part) -> None:
        raise RuntimeError("broken")


def test_only_a_whole_passing_cuda_run_writes_bench_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CUDA run of some parts, or one whose parts did not all run and pass, leaves
    ``bench/RESULTS.md`` as it is (main wrote a subset's section over it); ``--results``
    takes any run's section; a CUDA run of every part that passes writes it."""
    results = fake_cuda(monkeypatch, tmp_path)

    def main(*argv: str) -> int:
        return cli.main([*argv, "--profile", str(REPO / "profiles" / "paper.yaml")])

    assert main("--parts", "sync", "--time-limit", "0") == 0  # skipped: no time left
    assert results.read_text().endswith("committed\n")
    assert "not written: bench/RESULTS.md takes a CUDA run" in capsys.readouterr().out
    assert main("--time-limit", "0") == 0  # every part, none run
    assert results.read_text().endswith("committed\n")
    elsewhere = tmp_path / "mine.md"
    assert main("--parts", "sync", "--time-limit", "0", "--results", str(elsewhere)) == 0
    assert "| Sync checks" in elsewhere.read_text()
    passing = {k: Passing(s.title, s.budget_s, False, "") for k, s in PARTS.items()}
    monkeypatch.setattr(cli, "PARTS", dict(passing, hier=Failing("HIER", 1, False, "")))
    assert main() == 1
    assert results.read_text().endswith("committed\n")
    monkeypatch.setattr(cli, "PARTS", passing)
    assert main("--smoke") == 0  # toy sizes
    assert results.read_text().endswith("committed\n")
    assert main() == 0
    written = results.read_text()
    assert "committed" not in written and "## GPU (`python -m bench.gpu_check`)" in written
    assert "to measure again: `python -m bench.gpu_check" in written


def test_a_machine_without_pydantic_is_told_in_one_line(tmp_path: Path) -> None:
    """The bare GPU machine lacks pydantic: the check says so in one line, before any
    part, where main stopped with a traceback from ``pipeline.config``."""
    env = bare_environment(tmp_path / "loaded.log", lacking=("pydantic",))
    command = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--smoke"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("python -m bench.gpu_check: pydantic not installed; pip ")


def test_the_parts_run_in_the_order_a_first_gpu_run_needs(tmp_path: Path) -> None:
    """Issue 40: the loop, the four runs, then the peers, then HIER; the README gives the
    GPU kit the PHASES of that order (its default puts hier before the peers)."""
    order = list(PARTS)
    assert order.index("loop") < order.index("four") < order.index("gpt2") < order.index("hier")
    assert order.index("seq2seq") < order.index("hier")
    assert f'PHASES="{" ".join(order)}"' in (REPO / "README.md").read_text()
    assert sum(spec.budget_s for spec in PARTS.values()) <= cli.TIME_LIMIT_S


def test_parts_share_typed_results(tmp_path: Path) -> None:
    """What the loop measured reaches the four runs through ``Check.loop_rate``; the
    corpus is only read when a part asks for it, and says what is missing."""
    setup = setup_of(parser().parse_args(["--device", "cpu", "--smoke"]), tmp_path)
    check = Check(setup, deadline=time.monotonic() + 60)
    assert check.loop_rate is None and 59 < check.seconds_left() <= 60
    if setup.ptb is None:
        with pytest.raises(cli.Missing, match="no --ptb DIR"):
            check.ptb()


def test_peak_by_card_name() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A10G") is None  # the command then asks for --peak-tflops


def test_peer_rows_without_transformers_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an absent package gives
    notes: list[str] = []
    candidates = gpt_candidates(TOY_LM, notes, smoke=True)
    assert [c.label for c in candidates] == ["ours gpt"] and candidates[0].peer is None
    assert notes == [notes[0]] and notes[0].startswith(
        "the HF GPT-2 rows skipped: transformers is not installed"
    )


def test_our_gpt_trains_on_the_peer_batch_token_for_token() -> None:
    batch = lm_batch(TOY_LM)
    assert batch.flat_ids.shape == (TOY_LM.batch, TOY_LM.length)
    assert torch.equal(batch.sentences.flatten(1), batch.flat_ids)
    assert bool((batch.sentences[..., -1] == EOS_ID).all())
    model, loss_fn = gpt(TOY_LM)
    model.eval()  # no dropout: the two calls compute the same
    out = model.loss(batch)
    assert int(out.n_tokens) == TOY_LM.batch * TOY_LM.length  # what tokens/s counts
    assert torch.allclose(loss_fn(batch), out.loss)


@pytest.mark.slow
def test_a_training_past_the_time_limit_is_killed(tmp_path: Path) -> None:
    """``run_at_once`` kills what outlives its limit and says so; what it stamped stays."""
    folder = tmp_path / "endless"
    folder.mkdir()
    job = TrainJob(
        name="endless",
        model_name="toy",
        model=ToyFactory(),
        data=PoolFactory(),
        params=RunParams(epochs=10**6, patience=None, log_every=1, checkpoint_every=None),
        run_dir=str(folder),
        sink=MetricStamps(str(folder / "stamps.jsonl")),
        show_progress=False,
    )
    start = time.monotonic()
    (outcome,) = run_at_once({"endless": job}, "cpu", timeout_s=8.0)  # a core busy till then
    assert 8.0 <= time.monotonic() - start < 48.0
    assert outcome.killed
    assert outcome.error == "the process killed at the time limit (8 s), exit code -9"
    assert outcome.lines == tuple(MetricStamps(str(folder / "stamps.jsonl")).read())


class OutOfMemory(ToyFactory):
    """A model whose training step runs out of (CUDA) memory."""

    def __call__(self) -> torch.nn.Module:
        model = super().__call__()

        def loss(batch: object) -> None:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

        model.loss = loss  # type: ignore[method-assign]
        return model


def test_a_training_out_of_memory_in_its_share_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: four trainings on one GPU could run out of memory and nothing handled
    it. Each process takes its share of the free memory; one that runs out within it
    reports that, and what to do, as its outcome."""
    fractions: list[float] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fractions.append)
    job = TrainJob(
        name="oom",
        model_name="toy",
        model=OutOfMemory(),
        data=PoolFactory(),
        params=RunParams(epochs=1, patience=None, log_every=1, checkpoint_every=None),
        run_dir=str(tmp_path),
        show_progress=False,
    )
    share = MemoryShare(fraction=0.25, gib=19.5, processes=4)
    processes._child(job, "cpu", 1, share, str(tmp_path / "result.json"))
    out = json.loads((tmp_path / "result.json").read_text())
    assert fractions == [0.25]
    assert out["error"].startswith("out of memory (")
    assert out["error"].endswith(
        "within its share, 19.5 GiB (1/4 of the free memory): train fewer at once "
        "(--processes) or smaller batches (train.defaults.batch_tokens)"
    )
