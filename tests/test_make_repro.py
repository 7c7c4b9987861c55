"""``make repro`` runs the params check before DVC reads ``params.yaml``: a hostile or
malformed file stops make with the check's one line, and DVC (whose own parser took 76 s
over a 20 MB file and failed a "billion laughs" with "unexpected error") never starts.
The whole pipeline under ``make repro`` is ``tests/test_pipeline.py``'s."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.test_config import billion_laughs

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)


def _duplicate(path: Path) -> str:
    text = (REPO / "params.yaml").read_text()
    path.write_text(text.replace("tune:\n", "tune:\n  runs: {}\n", 1))
    return "check params.yaml: tune.runs: written twice, at lines "


def _large(path: Path) -> str:
    with path.open("w") as out:
        out.writelines(f"key_{i}: a value of a very long file\n" for i in range(700_000))
    return "check params.yaml: params: params.yaml is 2"


def _laughing(path: Path) -> str:
    path.write_text(billion_laughs(9))
    return "check params.yaml: params: params.yaml: its aliases (*name) expand it by "


@pytest.mark.slow  # a few seconds each: the check imports the model registry (torch)
@pytest.mark.parametrize("hostile", [_duplicate, _large, _laughing])
def test_a_hostile_params_file_stops_make_repro_before_dvc(
    tmp_path: Path, hostile: Callable[[Path], str]
) -> None:
    """The Makefile's own ``repro`` recipe, with its set-up step taken as done (``-o``) and
    ``BIN`` a folder whose ``python`` is this venv's and whose ``dvc`` leaves a mark."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs the project's venv (run through `make test`)")
    shutil.copy2(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "stages").symlink_to(REPO / "stages")
    said = hostile(tmp_path / "params.yaml")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python").write_text(f'#!/bin/sh\nexec "{VENV / "bin" / "python"}" "$@"\n')
    (bin_ / "dvc").write_text(f'#!/bin/sh\ntouch "{tmp_path / "dvc-ran"}"\n')
    for tool in bin_.iterdir():
        tool.chmod(0o755)
    make = ["make", "-o", str(VENV / ".installed"), f"VENV={VENV}", f"BIN={bin_}", "repro"]
    result = subprocess.run(make, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert said in result.stderr
    assert not (tmp_path / "dvc-ran").exists()


def _planned(*args: str, target: str = "repro", **env: str) -> str:
    """What ``make <target>`` would run, as typed in a shell (not as a sub-make of ``make
    test``, which passes its flags and prints the directories it enters), with ``env``."""
    make = ["make", "-n", "-o", str(VENV / ".installed"), f"VENV={VENV}", target, *args]
    inherited = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    }
    return subprocess.run(
        make, cwd=REPO, env=inherited | env, capture_output=True, text=True, check=True
    ).stdout


def test_make_repro_runs_a_stage_per_core_and_jobs_1_is_a_plain_dvc_repro() -> None:
    """Every training computes on one core (``train.placement.cpus_per_worker: 1`` is its
    torch threads), so ``make repro`` keeps each core busy with a stage of its own: as many
    at once as this process may use cores (``nproc``)."""
    cores = len(os.sched_getaffinity(0))
    planned = _planned()
    if cores > 1:
        assert f"-m pipeline.repro --jobs {cores}\n" in planned
    else:
        assert "pipeline.repro" not in planned
    plain = _planned("JOBS=1")
    assert "pipeline.repro" not in plain and plain.rstrip().endswith("/dvc repro")


def test_a_shell_exporting_omp_num_threads_still_gets_a_stage_and_a_test_worker_per_core() -> None:
    """GNU ``nproc`` prints ``$OMP_NUM_THREADS`` where it is set (HPC login shells export
    1, as the suite does): ``JOBS`` and ``TEST_WORKERS`` count the cores without it."""
    cores = len(os.sched_getaffinity(0))
    one_thread = {"OMP_NUM_THREADS": "1", "OMP_THREAD_LIMIT": "1"}
    if cores > 1:
        assert f"-m pipeline.repro --jobs {cores}\n" in _planned(**one_thread)
    assert f" -n {cores + 1} " in _planned(target="test-fast", **one_thread)
