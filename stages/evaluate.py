"""Stage ``evaluate``: every trained seed of one run, scored on the test split.

    python -m stages.evaluate <run> [--params params.yaml] [--no-progress]

``<run>`` is a trained run's key, ``<model>-<corpus>[-<variant>]``. Reads
``data/train/<run>/`` and ``data/shards/<corpus>/``; writes ``metrics/<run>.json``
(git-tracked: ``dvc metrics show``, ``dvc exp show``) and
``data/eval/<run>/{seeds.json,per_example.jsonl,samples.md}``
(``pipeline.eval.stage.evaluate_run`` does the work) and logs the metrics to the training runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from stages import ensure_project_interpreter

if __name__ == "__main__":  # first: the imports below need the project's packages
    ensure_project_interpreter("stages.evaluate")

from pipeline.artifacts import Layout
from pipeline.config import Params, parse_run_key
from pipeline.errors import ConfigError, HiertxError
from pipeline.eval.stage import EvalSettings, evaluate_run
from pipeline.helpformat import command_parser
from pipeline.plan import load_checked


def select_params(params: Params, key: str) -> EvalSettings:
    """What this stage reads (``params:`` of ``evaluate`` in dvc.yaml): ``evaluate`` and
    the corpus' tokenize settings; and ``tracking``, which only says where the metrics are
    also logged (``stages.UNDECLARED_PARAMS``). ``key`` is ``<model>-<corpus>[-<variant>]``."""
    _, corpus, _ = parse_run_key(key)
    if corpus not in params.tokenize.corpora:
        raise ConfigError("tokenize.corpora", f"no entry for {corpus}")
    return EvalSettings(
        evaluate=params.evaluate.for_corpus(corpus),
        corpus=params.tokenize.corpora[corpus],
        tracking=params.tracking,
    )


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("python -m stages.evaluate", __doc__)
    parser.add_argument("run", help="a trained run's key: <model>-<corpus>[-<variant>]")
    parser.add_argument("--params", default="params.yaml", help="the params file")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (terminal) or lines (log)"
    )
    args = parser.parse_args(argv)
    key = args.run
    try:
        model, corpus, variant = parse_run_key(key)
        settings = select_params(load_checked(args.params), key)
        metrics = evaluate_run(
            settings, model, corpus, progress=not args.no_progress, variant=variant
        )
    except HiertxError as err:
        print(f"evaluate {key}: {err}", file=sys.stderr)
        return 1
    shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.endswith("_ci95"))
    print(f"{key}: {shown} -> {Layout(Path('.')).metrics(key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
