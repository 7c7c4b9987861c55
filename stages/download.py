"""Stage ``download``: fetch one corpus into ``data/raw/<corpus>/``.

    python -m stages.download <corpus> [--params params.yaml] [--out data/raw]

A built-in corpus's files come from the URLs its spec pins (``pipeline.data.corpora``); a
corpus of one's own from the source the check stage recorded
(``data/sources/<corpus>.json``; ``pipeline.data.declared``: local files are linked, URLs
fetched). A mirror folder (``download.mirror`` in params.yaml, or ``$HIERTX_MIRROR``)
stands in for the internet.
"""

from __future__ import annotations

import sys
from pathlib import Path

from stages import ensure_project_interpreter

if __name__ == "__main__":  # first: the imports below need the project's packages
    ensure_project_interpreter("stages.download")

from pipeline.artifacts import SOURCES_FILE, DownloadRecord, Layout, SourceDeclaration
from pipeline.config import DownloadParams, Params
from pipeline.data.download import download_corpus
from pipeline.errors import HiertxError
from pipeline.helpformat import command_parser
from pipeline.plan import load_checked


def select_params(params: Params, corpus: str) -> DownloadParams:
    """The part of params.yaml this stage reads (``params:`` of ``download`` in dvc.yaml);
    the corpus's source comes from the check stage's record, its other dependency."""
    return params.download


def main(argv: list[str] | None = None) -> int:
    layout = Layout(Path("."))  # DVC runs a stage in the project's root
    parser = command_parser("python -m stages.download", __doc__)
    parser.add_argument("corpus", help="a name in corpora: of params.yaml")
    parser.add_argument("--params", default="params.yaml", help="the params file")
    parser.add_argument(
        "--out", type=Path, default=layout.raw_dir, help="folder to write <corpus>/ into"
    )
    args = parser.parse_args(argv)
    try:
        params = select_params(load_checked(args.params), args.corpus)
        declaration = SourceDeclaration.read(layout.declaration(args.corpus))
        folder = download_corpus(args.corpus, args.out, params, source=declaration.source)
    except HiertxError as err:
        print(f"download {args.corpus}: {err}", file=sys.stderr)
        return 1
    files = DownloadRecord.read(folder / SOURCES_FILE).files
    size = sum(f.bytes for f in files.values())
    print(f"{args.corpus}: {len(files)} files, {size / 1e6:.1f} MB verified in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
