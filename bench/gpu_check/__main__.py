"""``python -m bench.gpu_check`` (the package docstring).

The required packages are checked before the check's own modules are imported: a missing
one stops it with one line on stderr (exit status 2), never a traceback."""

import sys

from bench.gpu_check.requirements import missing_line, missing_packages


def _main() -> int:
    absent = missing_packages()
    if absent:
        print(missing_line(absent), file=sys.stderr)
        return 2
    try:
        from bench.gpu_check.cli import main
    except ModuleNotFoundError as err:  # a package beyond REQUIRED that an import needs
        print(missing_line([err.name or str(err)], _importer(err)), file=sys.stderr)
        return 2
    return main()


def _importer(err: BaseException) -> str:
    """``file:line`` of the innermost import statement that failed (not the import
    machinery's own frames)."""
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename[0] != "<"]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


if __name__ == "__main__":
    sys.exit(_main())
