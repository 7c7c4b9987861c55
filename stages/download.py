"""Stage ``download``: fetch one corpus into ``data/raw/<corpus>/``.

    python -m stages.download <corpus> [--params params.yaml] [--out data/raw]

A mirror folder (``download.mirror`` in params.yaml, or ``$HIERTX_MIRROR``) stands in
for the internet.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.artifacts import SOURCES_FILE, DownloadRecord
from pipeline.config import DownloadParams, Params, load_params
from pipeline.data.corpora import CORPORA
from pipeline.data.download import download_corpus
from pipeline.errors import HiertxError


def select_params(params: Params, corpus: str) -> DownloadParams:
    """The part of params.yaml this stage reads (``params:`` of ``download`` in dvc.yaml)."""
    return params.download


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", choices=sorted(CORPORA))
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="data/raw")
    args = parser.parse_args(argv)
    try:
        params = select_params(load_params(args.params), args.corpus)
        folder = download_corpus(args.corpus, args.out, params)
    except HiertxError as err:
        print(f"download {args.corpus}: {err}", file=sys.stderr)
        return 1
    files = DownloadRecord.read(folder / SOURCES_FILE).files
    size = sum(f.bytes for f in files.values())
    print(f"{args.corpus}: {len(files)} files, {size / 1e6:.1f} MB verified in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
