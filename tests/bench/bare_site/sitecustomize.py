"""A bare GPU machine's import system, for ``tests/bench/test_gpu_check.py``.

Put on ``PYTHONPATH``, Python imports this file at start-up (as ``sitecustomize``), in the
test's process and in every process it spawns. It wraps the path finder (the one that finds
installed packages), so that, as on a machine with only the bare and the optional packages:

- the top-level packages of ``$HIERTX_BARE_DENIED`` (comma-separated: everything installed
  that neither the bare nor the optional packages need) are not found: ``import`` raises
  ``ModuleNotFoundError`` and ``importlib.util.find_spec`` answers None, as without them;
- the packages of ``$HIERTX_BARE_BROUGHT`` (what only the optional packages, such as
  transformers, need) are found for the optional packages' own code alone, not for the
  project's, a bare package's or ``__main__``: an optional package brings what it needs;
- a refused package is still found in the folders of ``$HIERTX_BARE_VENDORED`` (``os.pathsep``
  between them: the copies an allowed package carries, such as setuptools' ``_vendor``,
  which it puts on ``sys.path`` itself, and which Inductor's C++ builder imports), as it
  would be there.

Each refusal is appended to ``$HIERTX_BARE_LOG`` as ``refused <module> <- <importer>``; at
exit each process appends ``loaded <pid> <name> ...``, the top-level packages it loaded
that are not the standard library's (nor code generated at run time).
"""

import atexit
import importlib.abc
import importlib.machinery
import os
import sys
import tempfile


def _names(variable: str) -> frozenset:
    return frozenset(filter(None, os.environ.get(variable, "").split(",")))


_OPTIONAL, _BROUGHT, _DENIED = (
    _names(f"HIERTX_BARE_{v}") for v in ("OPTIONAL", "BROUGHT", "DENIED")
)
_LOG = os.environ.get("HIERTX_BARE_LOG")
_VENDORED = tuple(filter(None, os.environ.get("HIERTX_BARE_VENDORED", "").split(os.pathsep)))


def _importer() -> str:
    """The module whose code asked for the import (the import machinery's frames skipped)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        machinery = frame.f_code.co_filename.startswith("<frozen importlib") or name in (
            "importlib",
            "importlib.util",
            __name__,
        )
        if not machinery:
            return name
        frame = frame.f_back
    return "__main__"


def _log(line: str) -> None:
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(line + "\n")


class BareMachine(importlib.abc.MetaPathFinder):
    """The path finder, blind to what a bare GPU machine lacks (module docstring)."""

    def __init__(self, inner: type) -> None:
        self.inner = inner

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        top = name.partition(".")[0]
        refused = top in _DENIED
        if top in _BROUGHT:
            importer = _importer().partition(".")[0]
            refused = importer not in _OPTIONAL and importer not in _BROUGHT
        if refused:
            if path is None and _VENDORED:  # a top-level name: the vendored copies only
                vendored = self.inner.find_spec(name, list(_VENDORED), target)
                if vendored is not None:
                    return vendored
            elif path is not None and all(str(p).startswith(_VENDORED) for p in path):
                return self.inner.find_spec(name, path, target)  # inside a vendored copy
            _log(f"refused {name} <- {_importer()}")
            return None
        return self.inner.find_spec(name, path, target)

    def invalidate_caches(self) -> None:
        self.inner.invalidate_caches()

    def find_distributions(self, *args: object, **kwargs: object) -> object:
        """Installed packages' metadata (``importlib.metadata``), all of it: what a bare
        machine lacks is not importable, which is what the project's code meets first."""
        return self.inner.find_distributions(*args, **kwargs)


def _generated(module: object) -> bool:
    """A module of code generated at run time (Inductor's kernels: a file in its cache
    under the temporary folder), not a package."""
    return str(getattr(module, "__file__", None) or "").startswith(tempfile.gettempdir())


def _log_loaded() -> None:
    modules = list(sys.modules.items())
    tops = {m.partition(".")[0] for m, module in modules if module and not _generated(module)}
    loaded = sorted(t for t in tops if t not in sys.stdlib_module_names and t[0] != "_")
    _log(f"loaded {os.getpid()} {' '.join(loaded)}")


_exit = os._exit


def _logged_exit(code: int) -> None:
    """``os._exit``, which processes forked by multiprocessing end with (no atexit)."""
    _log_loaded()
    _exit(code)


if _DENIED:
    sys.meta_path[:] = [
        BareMachine(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path
    ]
    atexit.register(_log_loaded)
    os._exit = _logged_exit
