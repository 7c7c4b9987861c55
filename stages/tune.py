"""Stage ``tune``: search one model's hyper-parameters on one corpus (Optuna + ASHA).

    python -m stages.tune <run> [--params params.yaml] [--no-progress]

``<run>`` is a key of ``tune.runs`` (``<model>-<corpus>``). Writes
``data/tune/<run>/best.json``; an interrupted search resumes.
"""

from __future__ import annotations

import sys

from stages import ensure_project_interpreter

if __name__ == "__main__":  # first: the imports below need the project's packages
    ensure_project_interpreter("stages.tune")

from pipeline.config import Params
from pipeline.errors import HiertxError
from pipeline.helpformat import command_parser
from pipeline.plan import RunRequest, load_checked
from pipeline.train.tuning import tune_run


def select_params(params: Params, key: str) -> RunRequest:
    """What this stage reads (``params:`` of ``tune`` in dvc.yaml): the search's knobs and
    space, the run's entry, ``train.defaults/models/scale`` and the corpus' ``tokenize``
    settings; and ``tracking`` and ``train.placement``, which say where trials are recorded
    and placed (``stages.UNDECLARED_PARAMS``: not dvc.yaml dependencies)."""
    return RunRequest.of(params, key, search=True)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("python -m stages.tune", __doc__)
    parser.add_argument("run", help="a key of tune.runs: <model>-<corpus>")
    parser.add_argument("--params", default="params.yaml", help="the params file")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (terminal) or lines (log)"
    )
    args = parser.parse_args(argv)
    try:
        request = select_params(load_checked(args.params), args.run)
        best = tune_run(request, show_progress=not args.no_progress)
    except HiertxError as err:
        print(f"tune {args.run}: {err}", file=sys.stderr)
        return 1
    print(
        f"{args.run}: best valid loss {best.valid_loss:.4f} of "
        f"{best.trials} trials with {best.config} {best.optimizer}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
