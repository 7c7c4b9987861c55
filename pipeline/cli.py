"""After a run: talk to a trained model (``chat``, ``rank``), compare the runs' metrics
(``compare``), copy fallback MLflow runs to the server (``sync-mlflow``), score a predictions
file (``score``), push a cluster run's results to a bucket and pull them into a clone
(``results``).

    python -m pipeline chat --run <model>-<corpus> [--beam 5 | --top-p 0.9 | --top-k 20] [--local]
    python -m pipeline chat --model-uri models:/hiertx-<model>-<corpus>/<version>
    python -m pipeline rank --run <key> --context "a|b|c" --candidates "x|y|z"
    python -m pipeline rank --run <key> --input file.json   # {"context": [..], "candidates": [..]}
    python -m pipeline compare [--rev REV]   # the runs' key metrics side by side (report.compare)
    python -m pipeline sync-mlflow [--to URI]   # fallback runs -> the server (tracking.sync)
    python -m pipeline score multiwoz --predictions FILE.json --data DIR   # (multiwoz_score)
    python -m pipeline results push|pull|check s3://BUCKET/PREFIX   # a run's results (results)

A run's model is the pyfunc registered in MLflow (the version its train manifest names),
or its local checkpoint when MLflow has none (or with ``--local``). ``chat`` first prints a
banner on stderr (the model and where it came from, the decoding, how to quit), then reads
user lines from stdin, keeps the dialogue history and prints one line on stdout per line
read (greedy by default), so ``chat < lines.txt > replies.txt`` keeps replies only, line
for line: the model's response, or an empty line for a blank line (nothing said: not sent
to the model, the history unchanged) and for ``/reset`` (starts a new dialogue); ``/quit``
(or Ctrl-D, Ctrl-C) ends. A response that is empty (the model ended it at once) prints as
``(empty reply)``. Sampling
(``--top-p``/``--top-k``) draws each turn's seed from one generator seeded once with
``--seed``: every turn samples afresh, and the same ``--seed`` and inputs repeat the whole
conversation. ``rank`` prints the candidates best first, each after its score (the model's
logit: higher is better; ``rank --help`` says more); an empty candidate is refused, from
``--candidates`` as from ``--input`` (and by the served model), as it cannot be scored.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline import results
from pipeline.artifacts import VOCAB_FILE, Layout, TrainRecord, read_train
from pipeline.errors import ConfigError, DataError, HiertxError
from pipeline.eval import multiwoz_score
from pipeline.helpformat import HelpFormatter, describe
from pipeline.report import compare
from pipeline.tracking import store, sync

RESET = "/reset"
QUIT = "/quit"
EMPTY_REPLY = "(empty reply)"  # what chat prints for a response with no tokens
REQUEST = '{"context": [strings], "candidates": [strings]}'  # what rank --input reads
SAMPLING = ("nucleus", "top_k")
RANK_SCORES = (
    "Each score is the model's logit for the candidate: higher is better, and only the "
    "order among one request's candidates means something. Trained with the default "
    "binary cross-entropy loss, sigmoid(score) is the model's probability that the "
    "candidate is a right response; with the LSE ranking loss only the order is trained."
)


@dataclass(frozen=True)
class Loaded:
    """A model ready to answer, and where it came from (for ``chat``'s banner)."""

    model: Any
    source: str


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


def _mlflow_model(uri: str, tracking_uri: str | None = None) -> tuple[Any, str]:
    """The ``HiertxModel`` inside a logged pyfunc (called directly, so decoding params pass
    without a signature), and the tracking store it came from: ``tracking_uri`` (a run's
    record names it: its registered models are there), set for the loading alone
    (``serving.tracking_uri_set``), or MLflow's own default."""
    import mlflow

    from pipeline.serving import tracking_uri_set

    store.configure_env()
    if tracking_uri:
        store.follow_move(tracking_uri)  # a moved project's store: models beside it
    scope = tracking_uri_set(tracking_uri) if tracking_uri else contextlib.nullcontext()
    try:
        with scope:
            model = mlflow.pyfunc.load_model(uri).unwrap_python_model()
    except Exception as err:  # mlflow raises many types for a missing model or store
        raise ConfigError(
            "--model-uri", f"cannot load {uri} ({type(err).__name__}: {err})"
        ) from None
    return model, tracking_uri or mlflow.get_tracking_uri()


def load(args: argparse.Namespace) -> Any:
    """The model ``--model-uri`` or ``--run`` names (see the module docstring)."""
    return load_named(args).model


def load_named(args: argparse.Namespace) -> Loaded:
    """:func:`load`'s model and where it came from."""
    root = Path(args.root).resolve()
    if args.model_uri:
        model, tracking = _mlflow_model(args.model_uri)
        return Loaded(model, f"MLflow model {args.model_uri} (store {tracking})")
    layout = Layout(root)
    record = read_record(layout, args.run)
    seed = record.seeds[0]
    info = seed.mlflow
    if not args.local and info and info.registered_model and info.model_version:
        uri = f"models:/{info.registered_model}/{info.model_version}"
        model, tracking = _mlflow_model(uri, store.resolve_uri(info.tracking_uri, root))
        return Loaded(
            model,
            f"run {args.run} (training seed {seed.seed}): MLflow model {uri} (store {tracking})",
        )
    why = "--local" if args.local else "no registered MLflow model"
    checkpoint = layout.resolve(seed.checkpoint)
    return Loaded(
        _local_model(layout, record, Path(args.params)),
        f"run {args.run} (training seed {seed.seed}): local checkpoint {checkpoint} ({why})",
    )


def _task(model: Any) -> str:
    return str(model.spec.task)


def decode_params(args: argparse.Namespace) -> dict[str, Any]:
    """The decoding ``chat`` asks for (greedy by default); a sampled turn adds its seed."""
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise ConfigError("--top-p", f"must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ConfigError("--top-k", f"must be >= 0 (0 = off), got {args.top_k}")
    if args.beam < 0:
        raise ConfigError("--beam", f"must be >= 1 (0 = off), got {args.beam}")
    if args.temperature <= 0:
        raise ConfigError("--temperature", f"must be > 0, got {args.temperature}")
    sampling = args.top_p is not None or args.top_k > 0
    if args.beam and sampling:
        raise ConfigError("--beam", "choose beam search or sampling (--top-p/--top-k), not both")
    if args.temperature != 1.0 and not sampling:
        raise ConfigError("--temperature", "applies to sampling: add --top-p or --top-k")
    if args.beam:
        return {"strategy": "beam", "beam_size": args.beam}
    temperature = {"temperature": args.temperature} if args.temperature != 1.0 else {}
    if args.top_p is not None:  # with --top-k too: the k best, then the nucleus of those
        return {"strategy": "nucleus", "top_p": args.top_p, "top_k": args.top_k, **temperature}
    if args.top_k:
        return {"strategy": "top_k", "top_k": args.top_k, **temperature}
    return {}


def describe_decoding(params: dict[str, Any], seed: int, max_length: int) -> str:
    """``decode_params``' decoding in words, for the banner."""
    strategy = params.get("strategy", "greedy")
    if strategy == "beam":
        how = f"beam search, width {params['beam_size']}"
    elif strategy in SAMPLING:
        cut = []
        if params.get("top_k"):
            cut.append(f"top-k {params['top_k']}")
        if strategy == "nucleus":
            cut.append(f"top-p {params['top_p']}")
        how = (
            f"sampling ({', '.join(cut)}), temperature {params.get('temperature', 1.0)}, "
            f"seed {seed} (each turn draws its own seed from it)"
        )
    else:
        how = "greedy (the most likely token at each step)"
    return f"{how}; at most {max_length} tokens per reply"


def banner(loaded: Loaded, params: dict[str, Any], seed: int) -> str:
    """What ``chat`` prints on stderr before the first turn: the model, the decoding, how
    to reset and quit."""
    spec = loaded.model.spec
    return "\n".join(
        (
            f"hiertx chat: {loaded.source}",
            f"decoding: {describe_decoding(params, seed, spec.max_response)}",
            f"type a line and press Enter; {RESET} starts a new dialogue; "
            f"{QUIT}, Ctrl-D or Ctrl-C quits",
        )
    )


def turn_seeds(seed: int) -> Iterator[int]:
    """The sampling seed of each turn, drawn from one generator seeded once with ``seed``:
    turns differ, and the same ``seed`` gives the same sequence."""
    rng = random.Random(seed)
    while True:
        yield rng.getrandbits(63)  # a non-negative int64, as torch.Generator takes


def chat(args: argparse.Namespace) -> int:
    """Run ``chat`` (see the module docstring): replies on stdout, the banner on stderr."""
    params = decode_params(args)
    loaded = load_named(args)
    model = loaded.model
    if _task(model) != "generate":
        raise ConfigError(
            "--run",
            f"chat needs a generate model; this one is {_task(model)} "
            "(use `python -m pipeline rank` for select models)",
        )
    print(banner(loaded, params, args.seed), file=sys.stderr, flush=True)
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
        if line == QUIT:
            return 0
        if not line or line == RESET:  # a line out all the same: replies line up with input
            history = [] if line == RESET else history
            print(flush=True)
            continue
        history.append(line)
        turn = {**params, "seed": next(seeds)} if params.get("strategy") in SAMPLING else params
        response = model.predict(None, [{"history": history}], turn)[0]
        history.append(response)
        print(response if response.strip() else EMPTY_REPLY, flush=True)


def _read_request(path: Path) -> tuple[list[str], list[str]]:
    """The context and candidates of ``rank --input``'s JSON file (see ``REQUEST``)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(path, "file not found") from None
    except OSError as err:
        raise DataError(path, f"cannot read it ({err.strerror}); expected a JSON file") from None
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DataError(
            path,
            f"not a text file (byte {data[err.start]:#04x} at offset {err.start} is not "
            f"UTF-8); expected a JSON file {REQUEST}",
        ) from None
    except json.JSONDecodeError as err:
        raise DataError(path, f"invalid JSON ({err.msg})", line=err.lineno) from None
    context, candidates = (
        (raw.get("context", []), raw.get("candidates")) if isinstance(raw, dict) else (None, None)
    )
    for texts in (context, candidates):
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise DataError(path, f"expected {REQUEST}")
    return context, candidates


def rank_inputs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """``rank``'s context and candidates, from ``--input`` or the ``|``-separated flags;
    candidates that cannot be scored (``serving.candidates_problem``) are refused, naming
    the file or the flag."""
    from pipeline.serving import candidates_problem

    if args.input:
        path = Path(args.input)
        context, candidates = _read_request(path)
        problem = candidates_problem(candidates)
        if problem is not None:
            raise DataError(path, problem)
        return context, candidates
    if args.candidates is None:
        raise ConfigError("--candidates", 'give candidates ("x|y|z") or --input FILE.json')
    candidates = [part.strip() for part in args.candidates.split("|")]
    problem = candidates_problem(candidates)
    if problem is not None:
        raise ConfigError("--candidates", problem)
    context = [part.strip() for part in args.context.split("|") if part.strip()]
    return context, candidates


def rank(args: argparse.Namespace) -> int:
    """Run ``rank``: ``<score>\\t<candidate>`` lines, best first (see ``RANK_SCORES``)."""
    context, candidates = rank_inputs(args)
    model = load(args)
    if _task(model) != "select":
        raise ConfigError("--run", f"rank needs a select model; this one is {_task(model)}")
    scores = model.predict(None, [{"history": context, "candidates": candidates}])[0]
    for score, candidate in sorted(zip(scores, candidates, strict=True), key=lambda p: -p[0]):
        print(f"{score:.4f}\t{candidate}")
    return 0


CHAT_HELP = f"""Chat with a generate model: one reply (stdout) per line you type (stdin).

A banner on stderr names the model, the decoding and how to quit; stdout carries replies
only, one line per line read, so `chat < lines.txt > replies.txt` lines up line for line.
A blank line is not sent to the model and gets an empty line; so does /reset, which
starts a new dialogue; a reply the model ends at once prints as {EMPTY_REPLY}. /quit,
Ctrl-D (end of input) or Ctrl-C ends. Greedy decoding unless --beam, --top-p or --top-k
is given."""

RANK_HELP = f"""Rank candidate responses to a context with a select model.

Prints one line per candidate, best first: the score, a tab, the candidate.
{textwrap.fill(RANK_SCORES, 88)}

An empty candidate (no words) cannot be scored: it is refused, from --candidates ("a||b")
as from --input, and by the served model."""


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every parser under ``parser`` (the subcommands' included, wherever they were built)
    shows its options' defaults, keeps its description's line breaks and reads as text
    (:func:`describe`: no reST markup, no example lines repeating the usage line)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                sub.description = describe(sub.description) or None
                if not sub.description and helps.get(name):  # `score --help` said nothing
                    sub.description = f"{helps[name][0].upper()}{helps[name][1:]}."
                _show_defaults(sub)


def parser() -> argparse.ArgumentParser:
    """``python -m pipeline``'s parser: ``chat``, ``rank``, ``compare``, ``sync-mlflow``,
    ``score``, ``results``."""
    # the examples of every command stay: the top usage line names none of them
    top = argparse.ArgumentParser(
        prog="python -m pipeline", description=describe(__doc__, drop_usage=False)
    )
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, description in (
        ("chat", "chat with a generate model", CHAT_HELP),
        ("rank", "rank candidate responses with a select model", RANK_HELP),
    ):
        sub = commands.add_parser(name, help=help_text, description=description)
        which = sub.add_mutually_exclusive_group(required=True)
        which.add_argument(
            "--run", help="<model>-<corpus>[-<variant>]: a trained run of data/train"
        )
        which.add_argument("--model-uri", help="an MLflow model URI (models:/<name>/<version>)")
        sub.add_argument(
            "--local",
            action="store_true",
            help="use the run's local checkpoint even when MLflow has its registered model",
        )
        sub.add_argument("--root", default=".", help="project folder (holds data/)")
        sub.add_argument(
            "--params",
            default="params.yaml",
            help="params file whose corpus limits cut the history (local checkpoints only)",
        )
    chat_args = commands.choices["chat"]
    chat_args.add_argument(
        "--beam", type=int, default=0, help="beam search of this width (0: off, greedy)"
    )
    chat_args.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling: sample from the smallest set of tokens whose probability "
        "reaches this, in (0, 1] (default: off)",
    )
    chat_args.add_argument(
        "--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)"
    )
    chat_args.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="divides the logits before sampling (> 0; with --top-p or --top-k)",
    )
    chat_args.add_argument(
        "--seed", type=int, default=0, help="seeds the sampling of the whole conversation"
    )
    rank_args = commands.choices["rank"]
    rank_args.add_argument(
        "--context", default="", help='the dialogue so far, oldest first: "a|b|c" (default: none)'
    )
    rank_args.add_argument("--candidates", help='the candidates to rank: "x|y|z"')
    rank_args.add_argument("--input", help=f"JSON file {REQUEST} instead of the flags")
    compare.add_parser(commands)
    sync.add_parser(commands)
    # its module docstring's first line alone stops mid-sentence: the whole story
    commands.choices[sync.COMMAND].description = describe(sync.__doc__)
    multiwoz_score.add_parser(commands)
    results.add_parser(commands)
    _show_defaults(top)
    return top


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline``: exit 0, 2 on a usage or config error, 130 on Ctrl-C."""
    args = parser().parse_args(argv)
    try:
        if args.command == compare.COMMAND:
            return compare.run_command(args)
        if args.command == sync.COMMAND:
            return sync.run_command(args)
        if args.command == multiwoz_score.COMMAND:
            return multiwoz_score.run_command(args)
        if args.command == results.COMMAND:
            return results.run_command(args)
        return chat(args) if args.command == "chat" else rank(args)
    except HiertxError as err:
        print(f"{args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
