"""Stage ``report``: tables, figures and ``reports/report.md`` from every trained run.

    python -m stages.report [--params params.yaml]

Reads ``data/eval/<run>/`` and ``data/train/<run>/`` of every run in ``train.runs`` and
``tune.runs``, the MLflow validation history of each, and test histories of each generate
corpus (``data/shards``: the attention-mask figure and the Samples section); writes
``reports/`` (tables, diagnostics of degenerate results, samples, figures) and
``plots/valid_loss.csv`` (``dvc plots show``) and logs the report to MLflow (experiment
``<prefix>/report``).
"""

from __future__ import annotations

import sys

from stages import ensure_project_interpreter

if __name__ == "__main__":  # first: the imports below need the project's packages
    ensure_project_interpreter("stages.report")

from pipeline.config import (
    Params,
    TokenizeParams,
    TrainParams,
    TuneParams,
)
from pipeline.errors import HiertxError
from pipeline.helpformat import command_parser
from pipeline.plan import load_checked
from pipeline.report.build import build_report


def select_params(params: Params, key: None = None) -> Params:
    """What this stage reads (``params:`` of ``report`` in dvc.yaml): the runs and the
    training knobs they merge (the results document states each run's batch), the corpora
    and their tokenize settings, the evaluate section (the decodings of each generate run,
    per corpus and model, which the conventions state, and the bootstrap size); and
    ``tracking``, which only says
    where the report is also logged (``stages.UNDECLARED_PARAMS``); and ``report``, where
    it also writes the committed results document."""
    return Params.model_construct(
        corpora=params.corpora,
        tokenize=TokenizeParams.model_construct(corpora=params.tokenize.corpora),
        train=TrainParams.model_construct(
            defaults=params.train.defaults, models=params.train.models, runs=params.train.runs
        ),
        tune=TuneParams.model_construct(runs=params.tune.runs),
        evaluate=params.evaluate,
        tracking=params.tracking,
        report=params.report,
    )


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("python -m stages.report", __doc__)
    parser.add_argument("--params", default="params.yaml", help="the params file")
    args = parser.parse_args(argv)
    try:
        report = build_report(select_params(load_checked(args.params)), ".")
    except HiertxError as err:
        print(f"report: {err}", file=sys.stderr)
        return 1
    print(f"report: {len(report.tables)} tables -> {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
