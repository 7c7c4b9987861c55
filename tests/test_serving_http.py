"""The logged pyfunc behind a real ``mlflow models serve`` (``--env-manager local``): good
requests answer, bad ones get HTTP 400 with a one-line message naming the field, the bad
value and the valid values, and no traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import tracking
from pipeline.serving import ServingSpec, log_pyfunc
from tests.test_serving import tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent  # `mlflow models serve` runs `uvicorn` from PATH
SERVED_FOLDER: list[Path] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(port: int, body: dict) -> tuple[int, dict]:
    """POST ``body`` to ``/invocations``; the HTTP status and the JSON answer."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[int]:
    """A tiny generate model logged by ``log_pyfunc`` and served on a free port (its
    store and artifacts in the folder ``SERVED_FOLDER`` names)."""
    folder = tmp_path_factory.mktemp("served")
    SERVED_FOLDER.append(folder)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    ckpt, vocab = tiny_checkpoint(folder)
    tracker = tracking.Tracker.start(uri, uri, "e", "r")
    spec = ServingSpec("generate", max_response=6)
    version = tracker.call(
        lambda client, run_id: log_pyfunc(
            client.tracking_uri, run_id, "m", checkpoint=ckpt, vocab=vocab, spec=spec
        )
    )
    port = _free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PYTHONPATH", None)  # the model loads the `pipeline` it carries (code_paths)
    log = (folder / "serve.log").open("w")
    local = ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(
        [str(VENV_BIN / "mlflow"), "models", "serve", "-m", f"models:/m/{version}", *local],
        cwd=folder,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # uvicorn is its child: stop both
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow models serve did not start:\n{log_text(folder)}")
                time.sleep(1)
        yield port
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
        log.close()


def log_text(folder: Path) -> str:
    return (folder / "serve.log").read_text()[-3000:]


HISTORY = {"dataframe_records": [{"history": ["hi there", "how are you"]}]}


@pytest.mark.slow
def test_a_good_request_answers(served):
    status, answer = post(served, {**HISTORY, "params": {"strategy": "beam", "beam_size": 2}})
    assert status == 200, answer
    assert len(answer["predictions"]) == 1 and isinstance(answer["predictions"][0], str)
    status, answer = post(served, {"inputs": [{"history": ["hi"]}, {"history": ["how"]}]})
    assert status == 200 and len(answer["predictions"]) == 2, answer


@pytest.mark.slow
@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (
            {"strategy": "bogus"},
            "params.strategy: 'bogus' is not valid; "
            "valid values: greedy, beam, hier_beam, top_k, nucleus",
        ),
        ({"top_p": 1.5}, "params.top_p: 1.5 is not valid; valid values: a number > 0.0 and <= 1.0"),
        ({"top_k": -1}, "params.top_k: -1 is not valid; valid values: an integer >= 0"),
        ({"beam_size": 0}, "params.beam_size: 0 is not valid; valid values: an integer >= 1"),
        (
            {"temperature": 0.0},
            "params.temperature: 0.0 is not valid; valid values: a number > 0.0",
        ),
        ({"max_length": 0}, "params.max_length: 0 is not valid; valid values: an integer >= 1"),
        (
            {"min_length": 9},
            "params.min_length: 9 is not valid: must not exceed max_length (max_length = 6)",
        ),
    ],
)
def test_a_bad_param_gets_one_line_naming_it_and_the_valid_values(served, params, expected):
    status, answer = post(served, {**HISTORY, "params": params})
    assert status == 400
    assert answer["error_code"] == "INVALID_PARAMETER_VALUE"
    assert answer["message"] == expected
    assert "stack_trace" not in answer and "Traceback" not in json.dumps(answer)


@pytest.mark.slow
def test_a_bad_column_is_refused_without_a_traceback(served):
    """MLflow checks the columns against the logged signature before the model runs: its
    message names the missing column (and the given one)."""
    for body, named in (
        ({"dataframe_records": [{"text": ["hi"]}]}, "history"),
        ({"dataframe_records": [{"history": "hi there"}]}, "history"),
    ):
        status, answer = post(served, body)
        assert status == 400, answer
        assert named in answer["message"]
        assert "stack_trace" not in answer and "Traceback" not in json.dumps(answer)


@pytest.mark.slow
def test_the_served_model_requirements_have_no_local_version_label(served):
    """The ``requirements.txt`` logged with the model: what ``mlflow models serve`` installs
    with ``--env-manager virtualenv``/``uv``/``conda``."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    (requirements,) = SERVED_FOLDER[0].glob("mlartifacts/**/requirements.txt")
    lines = [line for line in requirements.read_text().splitlines() if line.strip()]
    assert {Requirement(line).name for line in lines} >= {"torch", "mlflow", "tokenizers"}
    for line in lines:
        (spec,) = Requirement(line).specifier
        assert Version(spec.version).local is None, line


@pytest.mark.slow
def test_chat_with_a_logged_model_prints_the_banner_and_no_warning(served):
    """``chat --model-uri``: the model loaded through MLflow (as ``--run`` does for a run
    with a registered model), in a fresh process as a user starts it."""
    folder = SERVED_FOLDER[0]
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "chat", "--model-uri", "models:/m/1", "--beam", "2"],
        input="hi there\n",
        capture_output=True,
        text=True,
        cwd=folder,
        env={
            **os.environ,
            "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}",
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
        },
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1
    banner = done.stderr.splitlines()
    assert (
        banner[0] == f"hiertx chat: MLflow model models:/m/1 (store sqlite:///{folder}/mlflow.db)"
    )
    assert banner[1] == "decoding: beam search, width 2; at most 6 tokens per reply"
    assert len(banner) == 3 and "Warning" not in done.stderr, done.stderr
