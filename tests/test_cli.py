"""``python -m pipeline chat`` / ``rank`` on really trained tiny models (local checkpoints)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from pipeline import cli, tracking
from pipeline.data.loader import load_vocab
from pipeline.data.tokenize import tokenize_corpus
from pipeline.decode import DecodeConfig, generate
from pipeline.models.saved import load_model
from pipeline.names import Task
from pipeline.plan import RunRequest, checked
from pipeline.serving import ServingSpec, generate_batch, log_pyfunc, select_batch
from pipeline.train.training import train_seeds
from tests.eval.test_evaluate import project_params
from tests.test_serving import tiny_checkpoint
from tests.train.conftest import TINY_TRANSFORMER
from tests.trained import write_trained

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """Tokenized chitchat, a tiny transformer and a tiny ranker, and a params.yaml."""
    root = tmp_path_factory.mktemp("cliproject")
    raw = project_params()
    params = checked(raw)
    tokenize_corpus("chitchat", None, root / "data" / "shards" / "chitchat", params)
    for name in ("transformer", "transformer_ranker"):
        train_seeds(RunRequest.of(params, f"{name}-chitchat"), root, show_progress=False)
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    return root


def run_cli(root: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=120,
    )


def spec() -> ServingSpec:
    return ServingSpec.of(Task.GENERATE, checked(project_params()).corpus("chitchat"))


@pytest.mark.slow  # logs a pyfunc: about 20 s
def test_a_registered_model_loads_from_its_store_leaving_mlflow_s_uri_alone(tmp_path, monkeypatch):
    """A run's registered model loads from the store its record names (``chat --run``),
    without setting MLflow's process-wide tracking URI or the ``MLFLOW_TRACKING_URI`` that
    ``mlflow.set_tracking_uri`` exports: what runs after it in the process (a training,
    a test) still tracks into its own store."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    checkpoint, vocab = tiny_checkpoint(tmp_path)
    tracker = tracking.Tracker.start(uri, uri, "e", "r")
    version = tracker.call(
        lambda client, run_id: log_pyfunc(
            client.tracking_uri, run_id, "m", checkpoint=checkpoint, vocab=vocab, spec=spec()
        )
    )
    tracker.end()
    before = mlflow.get_tracking_uri()
    model, store = cli._mlflow_model(f"models:/m/{version}", uri)
    assert model.spec == spec() and store == uri
    assert mlflow.get_tracking_uri() == before and "MLFLOW_TRACKING_URI" not in os.environ


@pytest.mark.slow
def test_unknown_run_lists_the_runs_that_exist(project):
    done = run_cli(project, "chat", "--run", "unet-chitchat")
    assert done.returncode == 2
    assert "unet-chitchat" in done.stderr
    assert "transformer-chitchat" in done.stderr and "transformer_ranker-chitchat" in done.stderr


def test_argument_errors_say_what_to_do(tmp_path, capsys):
    assert cli.main(["rank", "--run", "transformer-chitchat", "--root", str(tmp_path)]) == 2
    assert "--candidates" in capsys.readouterr().err
    args = ["chat", "--run", "transformer-chitchat", "--beam", "5", "--top-p", "0.9"]
    assert cli.main(args) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.slow  # trains two tiny models, then starts Python twice
def test_chat_keeps_the_history_and_answers_like_generate(project, monkeypatch, capsys):
    lines = ["hi , how are you ?", "what do you do for fun ?"]
    done = run_cli(project, "chat", "--run", "transformer-chitchat", stdin="\n".join(lines) + "\n")
    assert done.returncode == 0, done.stderr
    answers = done.stdout.splitlines()
    assert len(answers) == 2
    # stderr: the banner (3 lines) and nothing else, no library warning
    assert done.stderr.startswith("hiertx chat: run transformer-chitchat (training seed "), (
        done.stderr
    )
    assert len(done.stderr.splitlines()) == 3 and "Warning" not in done.stderr, done.stderr

    # the same responses, decoded in-process from the checkpoint with the growing history
    model = load_model(project / "data" / "train" / "transformer-chitchat" / "model.pt")
    vocab = load_vocab(project / "data" / "shards" / "chitchat")
    history: list[str] = []
    expected = []
    for line in lines:
        history.append(line)
        with torch.no_grad():
            out = generate(model, generate_batch([history], vocab, spec()), DecodeConfig(
                max_length=spec().max_response))  # fmt: skip
        response = vocab.decode(out.tokens[0][: int(out.lengths[0])].tolist())
        expected.append(response)
        history.append(response)
    assert answers == expected

    # in-process (no second interpreter start): beam search, and a select model refused
    args = ["chat", "--run", "transformer-chitchat", "--root", str(project), "--beam", "3"]
    monkeypatch.setattr("sys.stdin", io.StringIO(lines[0] + "\n"))
    assert cli.main([*args, "--params", str(project / "params.yaml")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert cli.main(["chat", "--run", "transformer_ranker-chitchat", "--root", str(project)]) == 2
    assert "rank" in capsys.readouterr().err


@pytest.mark.slow
def test_rank_orders_candidates_by_model_score(project, capsys, tmp_path):
    context = ["hi , how are you ?", "good thanks , and you ?"]
    candidates = ["i am fine", "the weather is nice", "what ?", "i like dogs"]
    args = ["rank", "--run", "transformer_ranker-chitchat", "--root", str(project)]
    args += ["--params", str(project / "params.yaml")]
    assert (
        cli.main([*args, "--context", "|".join(context), "--candidates", "|".join(candidates)]) == 0
    )
    printed = [line.split("\t") for line in capsys.readouterr().out.splitlines()]

    model = load_model(project / "data" / "train" / "transformer_ranker-chitchat" / "model.pt")
    vocab = load_vocab(project / "data" / "shards" / "chitchat")
    batch = select_batch([context], [candidates], vocab, spec())
    with torch.no_grad():
        scores = model.score(batch)[0].tolist()
    order = sorted(range(len(candidates)), key=lambda i: -scores[i])
    assert [p[1] for p in printed] == [candidates[i] for i in order]
    assert [float(p[0]) for p in printed] == pytest.approx([scores[i] for i in order], abs=1e-4)

    request = tmp_path / "rank.json"
    request.write_text('{"context": ["hi"], "candidates": ["a", "b"]}')
    assert cli.main([*args, "--input", str(request)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


# --------------------------------------------------------------------------- chat output


@pytest.fixture(scope="module")
def random_project(tmp_path_factory) -> Path:
    """Tokenized chitchat and a randomly initialised tiny transformer as a trained run."""
    from pipeline.models import registry

    root = tmp_path_factory.mktemp("chatproject")
    shards = root / "data" / "shards" / "chitchat"
    tokenize_corpus("chitchat", None, shards, checked(project_params()))
    torch.manual_seed(0)
    model = registry.build("transformer", len(load_vocab(shards)), **TINY_TRANSFORMER)
    write_trained(root, "transformer", model)
    return root


def chat_in_process(root: Path, monkeypatch, capsys, lines: list[str], *args: str) -> list[str]:
    """``python -m pipeline chat`` through ``cli.main``, ``lines`` on stdin; the replies."""
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    argv = ["chat", "--run", "transformer-chitchat", "--root", str(root), "--local", *args]
    assert cli.main([*argv, "--params", str(root / "missing.yaml")]) == 0
    replies = capsys.readouterr().out.splitlines()
    assert len(replies) == len(lines)
    return replies


def test_an_empty_reply_is_shown_as_empty(random_project, monkeypatch, capsys):
    from pipeline.data.special import EOS_ID
    from pipeline.models.seq2seq import EncoderDecoder

    decode = EncoderDecoder.decode

    def ends_at_once(self, tokens, memory, state=None):  # the model answers <eos> first
        logits, state = decode(self, tokens, memory, state)
        logits = logits.clone()
        logits[..., EOS_ID] += 1e4
        return logits, state

    monkeypatch.setattr(EncoderDecoder, "decode", ends_at_once)
    replies = chat_in_process(random_project, monkeypatch, capsys, ["hi", "hello ?"])
    assert replies == [cli.EMPTY_REPLY, cli.EMPTY_REPLY]


def test_every_line_gets_a_line_blank_ones_and_resets_included(random_project, monkeypatch, capsys):
    """A blank line (or one of spaces) and /reset each print an empty line, so replies
    line up with the input; neither reaches the model: the history is as without them."""
    from pipeline.serving import HiertxModel

    asked: list[list[str]] = []
    predict = HiertxModel.predict

    def recording(self, context, model_input, params=None):
        asked.append(list(model_input[0]["history"]))
        return predict(self, context, model_input, params)

    monkeypatch.setattr(HiertxModel, "predict", recording)
    lines = ["hi", "", "how are you ?", " ", "/reset", "what do you do ?"]
    replies = chat_in_process(random_project, monkeypatch, capsys, lines)
    assert [replies[i] for i in (1, 3, 4)] == ["", "", ""]
    assert all(replies[i] for i in (0, 2, 5))
    assert asked == [["hi"], ["hi", replies[0], "how are you ?"], ["what do you do ?"]]


@pytest.mark.slow  # starts Python
def test_chat_from_a_file_to_a_file_lines_up(random_project, tmp_path):
    """``chat < lines.txt > replies.txt``, through the shell: one reply line per line."""
    (tmp_path / "lines.txt").write_text("a\n\nb\n \nc\n")
    command = (
        f"{sys.executable} -m pipeline chat --run transformer-chitchat --root {random_project} "
        f"--params missing.yaml < {tmp_path / 'lines.txt'} > {tmp_path / 'replies.txt'}"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    replies = (tmp_path / "replies.txt").read_text().split("\n")
    assert replies[-1] == "" and len(replies[:-1]) == 5
    assert [bool(r) for r in replies[:-1]] == [True, False, True, False, True]


def record_decode_configs(monkeypatch) -> list:
    """The ``DecodeConfig`` of every ``generate`` call chat makes from now on."""
    import pipeline.decode

    configs: list = []
    real = pipeline.decode.generate

    def spy(model, batch, config):
        configs.append(config)
        return real(model, batch, config)

    monkeypatch.setattr(pipeline.decode, "generate", spy)
    return configs


def test_sampling_varies_across_turns_and_repeats_with_the_seed(
    random_project, monkeypatch, capsys
):
    configs = record_decode_configs(monkeypatch)
    lines = ["hi , how are you ?", "what do you do for fun ?", "tell me more"]

    def chat(*args: str) -> tuple[list[str], list[int]]:
        configs.clear()
        return chat_in_process(random_project, monkeypatch, capsys, lines, *args), [
            c.seed for c in configs
        ]

    for sampling in (["--top-p", "0.9"], ["--top-k", "50"], ["--top-p", "0.9", "--top-k", "50"]):
        first, turn_seeds = chat(*sampling, "--seed", "7")
        assert len(set(turn_seeds)) == 3, sampling  # a fresh seed every turn
        assert len(set(first)) == 3, (sampling, first)  # so the replies differ
        assert chat(*sampling, "--seed", "7") == (first, turn_seeds)  # the conversation repeats
        other, other_seeds = chat(*sampling, "--seed", "8")
        assert other_seeds != turn_seeds and other != first, sampling


def test_bad_sampling_arguments_name_the_flag(capsys):
    for args, flag in ((["--top-p", "0"], "--top-p"), (["--top-k", "-1"], "--top-k"),
                       (["--beam", "3", "--top-k", "5"], "--beam")):  # fmt: skip
        assert cli.main(["chat", "--run", "transformer-chitchat", *args]) == 2
        assert flag in capsys.readouterr().err


# --------------------------------------------------------------------------- rank's input


def rank_error(tmp_path: Path, capsys, *args: str) -> str:
    """``rank``'s exit 2 and its one-line message (no trained run is needed: the input is
    refused before any model is loaded)."""
    argv = ["rank", "--run", "transformer_ranker-chitchat", "--root", str(tmp_path), *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.rstrip("\n")


def test_a_binary_input_file_is_refused_in_one_line(tmp_path, capsys):
    blob = tmp_path / "model.pt"
    blob.write_bytes(b"PK\x03\x04\x89\xffbinary")
    assert rank_error(tmp_path, capsys, "--input", str(blob)) == (
        f"rank: {blob}: not a text file (byte 0x89 at offset 4 is not UTF-8); expected a JSON "
        f"file {cli.REQUEST}"
    )
    request = tmp_path / "rank.json"
    for shape in ('["a"]', '{"candidates": "a|b"}', '{"context": "hi", "candidates": ["a"]}',
                  '{"candidates": ["a", null]}', "3"):  # fmt: skip
        request.write_text(shape)
        assert rank_error(tmp_path, capsys, "--input", str(request)).endswith(cli.REQUEST)


def test_empty_candidates_are_refused_alike_from_the_flags_and_a_file(tmp_path, capsys):
    """One rule, one message shape (the served model's, ``serving.candidates_problem``):
    the flag or the file, then the first empty candidate."""
    why = "an empty candidate cannot be scored; give it words or leave it out"
    request = tmp_path / "rank.json"
    request.write_text('{"context": ["hi"], "candidates": ["", ""]}')
    assert rank_error(tmp_path, capsys, "--input", str(request)) == (
        f"rank: {request}: candidates[0] is empty (''): {why}"
    )
    assert rank_error(tmp_path, capsys, "--candidates", "") == (
        f"rank: --candidates: candidates[0] is empty (''): {why}"
    )
    assert rank_error(tmp_path, capsys, "--candidates", "fine| |nice") == (
        f"rank: --candidates: candidates[1] is empty (''): {why}"
    )
    request.write_text('{"candidates": []}')
    assert rank_error(tmp_path, capsys, "--input", str(request)) == (
        f"rank: {request}: no candidates; valid: 1 or more strings with words"
    )


# --------------------------------------------------------------------------- the banner


def chat_banner(root: Path, monkeypatch, capsys, lines: list[str], *args: str) -> tuple:
    """``chat`` on ``random_project``'s run: (exit code, replies on stdout, stderr)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    argv = ["chat", "--run", "transformer-chitchat", "--root", str(root), *args]
    code = cli.main([*argv, "--params", str(root / "missing.yaml")])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def test_chat_banner_names_the_model_the_decoding_and_how_to_quit(
    random_project, monkeypatch, capsys
):
    code, replies, err = chat_banner(random_project, monkeypatch, capsys, ["hi", "/quit", "x"])
    assert code == 0
    assert len(replies) == 1  # /quit ended the chat before "x"; stdout holds replies only
    banner = err.splitlines()
    assert len(banner) == 3, err
    checkpoint = random_project / "data" / "train" / "transformer-chitchat" / "model.pt"
    assert banner[0] == (
        "hiertx chat: run transformer-chitchat (training seed 0): local checkpoint "
        f"{checkpoint} (no registered MLflow model)"
    )
    # the history limits of a params file that is missing: ServingSpec's defaults
    assert (
        banner[1]
        == "decoding: greedy (the most likely token at each step); at most 30 tokens per reply"
    )
    assert banner[2] == (
        "type a line and press Enter; /reset starts a new dialogue; /quit, Ctrl-D or Ctrl-C quits"
    )

    sampled = ["--top-p", "0.9", "--top-k", "5", "--temperature", "0.7", "--seed", "3"]
    _, _, err = chat_banner(random_project, monkeypatch, capsys, ["hi"], "--local", *sampled)
    assert "(--local)" in err.splitlines()[0]
    assert err.splitlines()[1] == (
        "decoding: sampling (top-k 5, top-p 0.9), temperature 0.7, seed 3 "
        "(each turn draws its own seed from it); at most 30 tokens per reply"
    )
    _, _, err = chat_banner(random_project, monkeypatch, capsys, ["hi"], "--beam", "4")
    assert err.splitlines()[1].startswith("decoding: beam search, width 4;")


def test_temperature_is_passed_to_sampling_and_refused_without_it(
    random_project, monkeypatch, capsys
):
    configs = record_decode_configs(monkeypatch)
    chat_banner(random_project, monkeypatch, capsys, ["hi"], "--top-k", "5", "--temperature", "0.5")
    assert [c.temperature for c in configs] == [0.5]
    code, _, err = chat_banner(random_project, monkeypatch, capsys, ["hi"], "--temperature", "0.5")
    assert code == 2 and "--temperature" in err and "--top-p or --top-k" in err
