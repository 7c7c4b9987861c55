"""``python -m bench.gpu_check`` (the package docstring)."""

import sys

from bench.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
