"""``python -m remat``: the built-in benchmark; ``--help`` lists the flags."""

from __future__ import annotations

from benchmarks.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
