"""``python -m benchmarks`` (from the repository's root): the full tables and the developers' targets; ``--help``
lists the flags."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
