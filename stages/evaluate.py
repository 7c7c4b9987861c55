"""Stage ``evaluate``: every trained seed of one run, scored on the test split.

    python -m stages.evaluate <model> <corpus> [--params params.yaml] [--no-progress]

Reads ``data/train/<model>-<corpus>/`` and ``data/shards/<corpus>/``; writes
``metrics/<model>-<corpus>.json`` (git-tracked: ``dvc metrics show``, ``dvc exp show``) and
``data/eval/<model>-<corpus>/{seeds.json,per_example.jsonl,samples.md}``
(``pipeline.eval.evaluate`` does the work) and logs the metrics to the training runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.artifacts import Layout
from pipeline.config import CorpusName, Params, load_params, run_key
from pipeline.errors import ConfigError, HiertxError
from pipeline.eval.evaluate import EvalSettings, evaluate_run


def select_params(params: Params, key: str) -> EvalSettings:
    """What this stage reads (``params:`` of ``evaluate`` in dvc.yaml): ``evaluate`` and
    the corpus' tokenize settings; and ``tracking``, which only says where the metrics are
    also logged (``stages.RECORDING_PARAMS``). ``key`` is ``<model>-<corpus>``."""
    corpus = key.rsplit("-", 1)[-1]
    try:
        corpus_name = CorpusName(corpus)
    except ValueError:
        raise ConfigError("evaluate", f"{key!r} does not end in a corpus name") from None
    return EvalSettings(
        evaluate=params.evaluate.for_corpus(corpus_name),
        corpus=params.tokenize.corpora[corpus_name],
        tracking=params.tracking,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("corpus", choices=[c.value for c in CorpusName])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (terminal) or lines (log)"
    )
    args = parser.parse_args(argv)
    key = run_key(args.model, args.corpus)
    try:
        params = load_params(args.params)
        if CorpusName(args.corpus) not in params.tokenize.corpora:
            raise ConfigError("tokenize.corpora", f"no entry for {args.corpus}")
        metrics = evaluate_run(
            select_params(params, key), args.model, args.corpus, progress=not args.no_progress
        )
    except HiertxError as err:
        print(f"evaluate {key}: {err}", file=sys.stderr)
        return 1
    shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.endswith("_ci95"))
    print(f"{key}: {shown} -> {Layout(Path('.')).metrics(key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
