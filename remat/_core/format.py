"""Text helpers every table of remat uses: byte counts, ratios, aligned columns (one definition each)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["aligned", "format_bytes", "ratio"]


def format_bytes(n: float) -> str:
    """Format a byte count with a binary unit.

    >>> format_bytes(512), format_bytes(1536)
    ('512 B', '1.50 KiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def ratio(a: float | None, b: float | None, suffix: str = "") -> str:
    """`a / b` to two decimals (with `suffix`), or a dash when either is missing or `b` is zero.

    >>> ratio(3, 2, "x"), ratio(None, 2), ratio(1, 0)
    ('1.50x', '-', '-')
    """
    return "-" if a is None or not b else f"{a / b:.2f}{suffix}"


def aligned(rows: Sequence[tuple[str, ...]], *, right: bool = False) -> list[str]:
    """The rows as lines of columns two spaces apart, each column as wide as its widest cell.

    Left-aligned by default; with `right`, every column but the last is right-aligned and each line is indented
    by two spaces (numeric tables whose last column is free text).

    >>> aligned([("a", "bb"), ("ccc", "d")])
    ['a    bb', 'ccc  d']
    >>> aligned([("1", "x"), ("22", "y")], right=True)
    ['   1  x', '  22  y']
    """
    if right:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        return ["  " + "  ".join(c.rjust(w) for c, w in zip(row[:-1], widths, strict=False)) + "  " + row[-1]
                for row in rows]  # fmt: skip
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
