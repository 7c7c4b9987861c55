"""Stage ``tokenize``: one corpus's raw files -> vocabulary + Arrow example shards.

    python -m stages.tokenize <corpus> [--params params.yaml] [--raw data/raw] [--out data/shards]
        [--no-progress]

Reads ``<raw>/<corpus>/`` and writes ``<out>/<corpus>/`` (``manifest.json``, ``vocab.json``,
``<task>/<split>-NNNNN.arrow``); ``pipeline.data.tokenize`` does the work.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from stages import ensure_project_interpreter

if __name__ == "__main__":  # first: the imports below need the project's packages
    ensure_project_interpreter("stages.tokenize")

from rich.console import Console
from rich.table import Table

from pipeline.artifacts import Layout
from pipeline.config import Params, TokenizeParams
from pipeline.data.splits import Split
from pipeline.data.tokenize import tokenize_corpus
from pipeline.errors import ConfigError, HiertxError
from pipeline.helpformat import command_parser
from pipeline.plan import load_checked


def select_params(params: Params, corpus: str) -> TokenizeParams:
    """The part of params.yaml this stage reads (``params:`` of ``tokenize`` in dvc.yaml):
    ``on_error``, ``shard_rows``, ``chunk_dialogues`` and the corpus's own settings."""
    section = params.tokenize
    if corpus not in section.corpora:
        raise ConfigError(f"tokenize.corpora.{corpus}", "no settings for this corpus")
    return TokenizeParams(
        on_error=section.on_error,
        shard_rows=section.shard_rows,
        chunk_dialogues=section.chunk_dialogues,
        corpora={corpus: section.corpora[corpus]},
    )


def main(argv: list[str] | None = None) -> int:
    layout = Layout(Path("."))  # DVC runs a stage in the project's root
    parser = command_parser("python -m stages.tokenize", __doc__)
    parser.add_argument("corpus", help="a name in corpora: of params.yaml")
    parser.add_argument("--params", default="params.yaml", help="the params file")
    parser.add_argument(
        "--raw", type=Path, default=layout.raw_dir, help="folder holding <corpus>/ raw files"
    )
    parser.add_argument(
        "--out", type=Path, default=layout.shards_dir, help="folder to write <corpus>/ into"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (terminal) or lines (log)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        section = select_params(load_checked(args.params), args.corpus)
        raw, out = args.raw / args.corpus, args.out / args.corpus
        manifest = tokenize_corpus(args.corpus, raw, out, section, progress=not args.no_progress)
    except HiertxError as err:
        print(f"tokenize {args.corpus}: {err}", file=sys.stderr)
        return 1
    table = Table(title=f"{args.corpus}: examples in {out}")
    named = {s for by_split in manifest.counts.values() for s in by_split}
    splits = [s.value for s in Split if s.value in named] + sorted(named - set(Split))
    table.add_column("task")
    for split in splits:
        table.add_column(split, justify="right")
    for task, by_split in manifest.counts.items():
        table.add_row(task, *(f"{by_split.get(s, 0):,}" for s in splits))
    Console().print(table)
    skipped = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in manifest.skipped.items())
    print(f"vocabulary {manifest.vocab_size:,} tokens ({manifest.vocab_hash[:12]}); {skipped}")
    if manifest.skipped_by_reason:
        reasons = ", ".join(f"{k} {v:,}" for k, v in manifest.skipped_by_reason.items())
        print(f"skipped records by reason (tokenize.on_error: skip): {reasons}")
    for warning in manifest.warnings:
        print(f"warning: {warning}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
