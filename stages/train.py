"""Stage ``train``: train one model on one corpus (resuming an interrupted run).

    python -m stages.train <run> [--params params.yaml] [--no-progress]

``<run>`` is a key of ``train.runs`` or ``tune.runs``: ``<model>-<corpus>[-<variant>]``.
Writes ``data/train/<run>/model.pt`` (the best weights; ``seed-<i>/model.pt`` with
``seeds > 1``) and ``manifest.json`` (per seed: MLflow run id, registered model version,
checkpoint paths, metrics). A run listed under ``tune.runs`` starts from
``data/tune/<run>/best.json``.
"""

from __future__ import annotations

import signal
import sys

from stages import ensure_project_interpreter

if __name__ == "__main__":  # first: the imports below need the project's packages
    ensure_project_interpreter("stages.train")

from pipeline.config import Params
from pipeline.errors import HiertxError
from pipeline.helpformat import command_parser
from pipeline.plan import RunRequest, load_checked
from pipeline.signals import signal_number
from pipeline.train.training import train_seeds


def select_params(params: Params, key: str) -> RunRequest:
    """What this stage reads (``params:`` of ``train`` in dvc.yaml): the run's entry,
    ``train.defaults/models/scale``, the corpus' ``tokenize`` settings and, for a tuned run,
    its search space; and ``tracking`` and ``train.placement``, which say where the run is
    recorded and placed, not what it computes (``stages.UNDECLARED_PARAMS``)."""
    return RunRequest.of(params, key)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("python -m stages.train", __doc__)
    parser.add_argument(
        "run", help="a key of train.runs or tune.runs: <model>-<corpus>[-<variant>]"
    )
    parser.add_argument("--params", default="params.yaml", help="the params file")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (terminal) or lines (log)"
    )
    args = parser.parse_args(argv)
    try:
        request = select_params(load_checked(args.params), args.run)
        record = train_seeds(request, show_progress=not args.no_progress)
    except HiertxError as err:
        print(f"train {args.run}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP: the loop checkpointed
        signum = signal_number(stop)
        print(
            f"train {args.run}: stopped ({signal.Signals(signum).name}); run the stage "
            "again to resume from its last checkpoint",
            file=sys.stderr,
        )
        return 128 + signum
    for seed in record.seeds:
        print(
            f"{args.run} (seed {seed.seed}): best valid loss "
            f"{seed.metric('best_valid_loss'):.4f} at step {seed.metric('best_step'):.0f} of "
            f"{seed.metric('steps'):.0f} -> {seed.checkpoint}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
