"""Stage ``tune``: search one model's hyper-parameters on one corpus (Optuna + ASHA).

    python -m stages.tune <model> <corpus> [--params params.yaml] [--no-progress]

Writes ``data/tune/<model>-<corpus>/best.json``; an interrupted search resumes.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.config import Params, load_params, run_key, run_slice
from pipeline.errors import HiertxError
from pipeline.train.run import tune_run


def select_params(params: Params, key: str) -> Params:
    """What this stage reads (``params:`` of ``tune`` in dvc.yaml): the search's knobs and
    space, the run's entry, ``train.defaults/models/scale`` and the corpus' ``tokenize``
    settings; and ``tracking``, which only says where trials are recorded
    (``stages.RECORDING_PARAMS``: not a dvc.yaml dependency)."""
    return run_slice(params, key, search=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("corpus")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (terminal) or lines (log)"
    )
    args = parser.parse_args(argv)
    try:
        best = tune_run(
            select_params(load_params(args.params), run_key(args.model, args.corpus)),
            args.model,
            args.corpus,
            show_progress=not args.no_progress,
        )
    except HiertxError as err:
        print(f"tune {args.model} {args.corpus}: {err}", file=sys.stderr)
        return 1
    print(
        f"{args.model} on {args.corpus}: best valid loss {best.valid_loss:.4f} of "
        f"{best.trials} trials with {best.config} {best.optimizer}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
