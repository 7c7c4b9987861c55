"""Stage ``check``: validate the whole ``params.yaml`` before any other stage computes.

    python -m stages.check [--params params.yaml] [--out data/sources]

The first stage of ``dvc repro``: it depends on ``params.yaml`` as a file, so it re-runs on
any change to it (a misspelled top-level key such as ``trainn:`` included, which no other
stage reads). Every check is ``pipeline.plan.load_checked`` (each section's own keys, then
names and cross-references: ``pipeline.plan.check``), which each stage script also runs on
its own; a storage URI (``train.placement.storage_path``, ``$HIERTX_STORAGE_PATH``) is also
opened here, so one pyarrow cannot open fails before any stage computes. Its output is one
:class:`~pipeline.artifacts.SourceDeclaration` per corpus of ``corpora:``
(``data/sources/<corpus>.json``), the one input each download stage takes from params: a
declaration that did not change is written byte for byte as before, so a valid change to
``params.yaml`` re-runs no download, and a changed source re-runs its corpus's.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from stages import ensure_project_interpreter

if __name__ == "__main__":  # first: the imports below need the project's packages
    ensure_project_interpreter("stages.check")

from pipeline.artifacts import Layout, SourceDeclaration
from pipeline.cluster import open_storage, storage_path
from pipeline.config import Params
from pipeline.errors import HiertxError
from pipeline.helpformat import command_parser
from pipeline.plan import load_checked


def select_params(params: Params, key: None = None) -> Params:
    """What this stage reads: all of ``params.yaml`` (a file dep in dvc.yaml, not a
    ``params:`` list)."""
    return params


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("python -m stages.check", __doc__)
    parser.add_argument("--params", default="params.yaml", help="the params file to check")
    parser.add_argument(
        "--out",
        type=Path,
        default=Layout(Path(".")).sources_dir,  # DVC runs a stage in the project's root
        help="folder of the <corpus>.json source declarations",
    )
    args = parser.parse_args(argv)
    try:
        params = select_params(load_checked(args.params))
        storage = storage_path(params.train.placement, ".")
        if "://" in storage:  # opened as the runs will open it, before any of them computes
            open_storage(storage)
    except HiertxError as err:
        print(f"check {args.params}: {err}", file=sys.stderr)
        return 1
    out = args.out
    shutil.rmtree(out, ignore_errors=True)  # a corpus taken out of corpora: leaves nothing
    for corpus in params.corpora:
        source = params.corpus(corpus).source
        SourceDeclaration(corpus=corpus, source=source).write(out / f"{corpus}.json")
    print(f"{args.params}: every key, model and corpus name checked -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
