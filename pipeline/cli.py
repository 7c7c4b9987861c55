"""Talk to a trained model: ``python -m pipeline chat`` and ``python -m pipeline rank``.

    python -m pipeline chat --run <model>-<corpus> [--beam 5 | --top-p 0.9 | --top-k 20] [--local]
    python -m pipeline chat --model-uri models:/hiertx-<model>-<corpus>/<version>
    python -m pipeline rank --run <key> --context "a|b|c" --candidates "x|y|z"
    python -m pipeline rank --run <key> --input file.json   # {"context": [..], "candidates": [..]}
    python -m pipeline sync-mlflow [--to URI]   # fallback runs -> the server (tracking.sync)
    python -m pipeline score multiwoz --predictions FILE.json --data DIR   # (multiwoz_score)

A run's model is the pyfunc registered in MLflow (the version its train manifest names),
or its local checkpoint when MLflow has none (or with ``--local``). ``chat`` reads user
lines from stdin, keeps the dialogue history and prints one response per line (greedy by
default); ``/reset`` starts a new dialogue. A response that is empty (the model ended it
at once) prints as ``(empty reply)``. Sampling (``--top-p``/``--top-k``) draws each turn's
seed from one generator seeded once with ``--seed``: every turn samples afresh, and the same
``--seed`` and inputs repeat the whole conversation. ``rank`` prints the candidates best
first.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.artifacts import VOCAB_FILE, Layout, TrainRecord, read_train
from pipeline.errors import ConfigError, DataError, HiertxError
from pipeline.eval import multiwoz_score
from pipeline.tracking import store, sync

RESET = "/reset"
EMPTY_REPLY = "(empty reply)"  # what chat prints for a response with no tokens
SAMPLING = ("nucleus", "top_k")


def read_record(layout: Layout, key: str) -> TrainRecord:
    """Run ``key``'s train record; ``--run`` names a run that has none: say which do."""
    if key not in layout.trained_runs():
        runs = layout.trained_runs()
        have = ", ".join(runs) if runs else "none (train one: dvc repro train@<model>-<corpus>)"
        raise ConfigError(
            "--run",
            f"no trained run {key!r} under {layout.train_out('')}; runs that exist: {have}",
        )
    return read_train(layout, key)


def _local_model(layout: Layout, record: TrainRecord, params_file: Path) -> Any:
    """The run's (first seed's) exported model behind the same ``HiertxModel`` as the
    pyfunc."""
    from pipeline.config import load_params
    from pipeline.serving import HiertxModel, ServingSpec

    checkpoint = layout.resolve(record.seeds[0].checkpoint)
    corpus = record.corpus
    spec = ServingSpec(task=record.task)
    if params_file.is_file():
        params = load_params(params_file)
        if corpus in params.tokenize.corpora:
            spec = ServingSpec.of(record.task, params.corpus(corpus))
    model = HiertxModel()
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "serving.json"
        spec_file.write_text(json.dumps(asdict(spec)))
        model.load(checkpoint, layout.shards(corpus) / VOCAB_FILE, spec_file)
    return model


def _mlflow_model(uri: str, tracking_uri: str | None = None) -> Any:
    """The ``HiertxModel`` inside a logged pyfunc (called directly, so decoding params pass
    without a signature)."""
    import mlflow

    store.configure_env()
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
        store.follow_move(tracking_uri)  # a moved project's store: models beside it
    try:
        return mlflow.pyfunc.load_model(uri).unwrap_python_model()
    except Exception as err:  # mlflow raises many types for a missing model or store
        raise ConfigError(
            "--model-uri", f"cannot load {uri} ({type(err).__name__}: {err})"
        ) from None


def load(args: argparse.Namespace) -> Any:
    """The model ``--model-uri`` or ``--run`` names (see the module docstring)."""
    root = Path(args.root).resolve()
    if args.model_uri:
        return _mlflow_model(args.model_uri)
    layout = Layout(root)
    record = read_record(layout, args.run)
    info = record.seeds[0].mlflow
    if not args.local and info and info.registered_model and info.model_version:
        uri = f"models:/{info.registered_model}/{info.model_version}"
        return _mlflow_model(uri, store.resolve_uri(info.tracking_uri, root))
    return _local_model(layout, record, Path(args.params))


def _task(model: Any) -> str:
    return str(model.spec.task)


def decode_params(args: argparse.Namespace) -> dict[str, Any]:
    """The decoding ``chat`` asks for (greedy by default); a sampled turn adds its seed."""
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise ConfigError("--top-p", f"must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ConfigError("--top-k", f"must be >= 0 (0 = off), got {args.top_k}")
    if args.beam and (args.top_p is not None or args.top_k):
        raise ConfigError("--beam", "choose beam search or sampling (--top-p/--top-k), not both")
    if args.beam:
        return {"strategy": "beam", "beam_size": args.beam}
    if args.top_p is not None:  # with --top-k too: the k best, then the nucleus of those
        return {"strategy": "nucleus", "top_p": args.top_p, "top_k": args.top_k}
    if args.top_k:
        return {"strategy": "top_k", "top_k": args.top_k}
    return {}


def turn_seeds(seed: int) -> Iterator[int]:
    """The sampling seed of each turn, drawn from one generator seeded once with ``seed``:
    turns differ, and the same ``seed`` gives the same sequence."""
    rng = random.Random(seed)
    while True:
        yield rng.getrandbits(63)  # a non-negative int64, as torch.Generator takes


def chat(args: argparse.Namespace) -> int:
    params = decode_params(args)
    model = load(args)
    if _task(model) != "generate":
        raise ConfigError(
            "--run",
            f"chat needs a generate model; this one is {_task(model)} "
            "(use `python -m pipeline rank` for select models)",
        )
    history: list[str] = []
    seeds = turn_seeds(args.seed)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        if line == RESET:
            history = []
            continue
        history.append(line)
        turn = {**params, "seed": next(seeds)} if params.get("strategy") in SAMPLING else params
        response = model.predict(None, [{"history": history}], turn)[0]
        history.append(response)
        print(response if response.strip() else EMPTY_REPLY, flush=True)


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split("|") if part.strip()]


def rank_inputs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    if args.input:
        path = Path(args.input)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise DataError(path, "file not found") from None
        except json.JSONDecodeError as err:
            raise DataError(path, f"invalid JSON ({err.msg})", line=err.lineno) from None
        if not isinstance(raw, dict) or not isinstance(raw.get("candidates"), list):
            raise DataError(path, 'expected {"context": [...], "candidates": [...]}')
        return [str(c) for c in raw.get("context", [])], [str(c) for c in raw["candidates"]]
    if not args.candidates:
        raise ConfigError("--candidates", 'give candidates ("x|y|z") or --input FILE.json')
    return _split(args.context or ""), _split(args.candidates)


def rank(args: argparse.Namespace) -> int:
    context, candidates = rank_inputs(args)
    if not candidates:
        raise ConfigError("--candidates", "no candidates to rank")
    model = load(args)
    if _task(model) != "select":
        raise ConfigError("--run", f"rank needs a select model; this one is {_task(model)}")
    scores = model.predict(None, [{"history": context, "candidates": candidates}])[0]
    for score, candidate in sorted(zip(scores, candidates, strict=True), key=lambda p: -p[0]):
        print(f"{score:.4f}\t{candidate}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)
    for name, help_text in (("chat", "chat with a generate model"), ("rank", "rank candidates")):
        sub = commands.add_parser(name, help=help_text)
        which = sub.add_mutually_exclusive_group(required=True)
        which.add_argument("--run", help="<model>-<corpus>: a trained run of data/train")
        which.add_argument("--model-uri", help="an MLflow model URI (models:/name/version)")
        sub.add_argument("--local", action="store_true", help="use the local checkpoint")
        sub.add_argument("--root", default=".", help="project folder (holds data/)")
        sub.add_argument("--params", default="params.yaml", help="for the corpus' limits")
    chat_args = commands.choices["chat"]
    chat_args.add_argument("--beam", type=int, default=0, help="beam search of this width")
    chat_args.add_argument("--top-p", type=float, default=None, help="nucleus sampling")
    chat_args.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    chat_args.add_argument(
        "--seed", type=int, default=0, help="seeds the sampling of the whole conversation"
    )
    rank_args = commands.choices["rank"]
    rank_args.add_argument("--context", default="", help='utterances, oldest first: "a|b|c"')
    rank_args.add_argument("--candidates", default="", help='"x|y|z"')
    rank_args.add_argument("--input", help='JSON file {"context": [..], "candidates": [..]}')
    sync.add_parser(commands)
    multiwoz_score.add_parser(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == sync.COMMAND:
            return sync.run_command(args)
        if args.command == multiwoz_score.COMMAND:
            return multiwoz_score.run_command(args)
        return chat(args) if args.command == "chat" else rank(args)
    except HiertxError as err:
        print(f"{args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
