"""Stage ``check``: validate the whole ``params.yaml`` before any other stage computes.

    python -m stages.check [--params params.yaml] [--out data/params.checked]

The first stage of ``dvc repro``: it depends on ``params.yaml`` as a file, so it re-runs on
any change to it (a misspelled top-level key such as ``trainn:`` included, which no other
stage reads), and every ``download@`` stage depends on its output. That output is a
constant text: a valid change leaves it as it was, so it invalidates nothing downstream.
Every check is ``pipeline.config.load_params`` (names and cross-references:
``pipeline.params_check``), which each stage script also runs on its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.config import Params, load_params
from pipeline.errors import HiertxError

# The output's content must not depend on the params (module docstring).
CHECKED = "params.yaml passed pipeline.config.load_params\n"


def select_params(params: Params, key: None = None) -> Params:
    """What this stage reads: all of ``params.yaml`` (a file dep in dvc.yaml, not a
    ``params:`` list)."""
    return params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="data/params.checked")
    args = parser.parse_args(argv)
    try:
        select_params(load_params(args.params))
    except HiertxError as err:
        print(f"check {args.params}: {err}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(CHECKED)
    tmp.replace(out)  # a new file, never a write into a (possibly cache-linked) output
    print(f"{args.params}: every key, model and corpus name checked -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
