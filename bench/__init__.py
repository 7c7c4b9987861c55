"""The benchmarks: each script is a module of this package, run as ``python -m bench.<name>``
from the repository root (results, and the machine they ran on, in ``bench/RESULTS.md``)."""
