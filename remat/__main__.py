"""``python -m remat``: ``estimate`` prints `remat.estimate`'s table (``python -m remat estimate --help``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    """Run ``python -m remat`` with command-line arguments ``argv``; return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["estimate"]:
        from ._estimate_cli import main as estimate_main

        return estimate_main(argv[1:], stdout)
    from benchmarks.cli import main as bench_main  # until the next commit puts a short demonstration here

    return bench_main(argv, stdout)


if __name__ == "__main__":
    raise SystemExit(main())
