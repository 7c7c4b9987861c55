"""``python -m pipeline``: the ``chat``, ``rank``, ``compare``, ``sync-mlflow``, ``score``
and ``results`` commands (``cli``)."""

from __future__ import annotations

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
