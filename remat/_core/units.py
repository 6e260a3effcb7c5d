"""Budgets and byte counts as people write them ("1.5GiB", 800_000_000, 0.4: a fraction), the names of the
quantities remat prints, and the text helpers of its tables.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "DEVICE_PEAK", "HELD_FOR_BACKWARD", "STEP_PEAK", "Budget", "aligned", "format_bytes", "parse_budget",
    "parse_memory", "ratio",
]

# The three quantities remat prints, each under one name, in every table, docstring and error (docs/design.md's
# glossary). A table that shows one says which in a line of these words.
STEP_PEAK = ("the most bytes live during forward and backward above what was live when the step began, the "
             "gradients backward allocates included (what `budget=` bounds, what `remat.track()` around a step reads)")
"""What "step peak" means wherever remat prints it."""
HELD_FOR_BACKWARD = "what forward made and left alive for backward when it returned, its output left out"
"""What "held for backward" means wherever remat prints it."""
DEVICE_PEAK = ("the most bytes live during the whole step (forward, backward, optimizer step), the parameters, "
               "buffers, batch, gradients and optimizer state included (what `memory=` bounds)")
"""What "device peak" means wherever remat prints it."""


Budget = int | str | float

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

_BUDGET_HELP = (
    "a budget is bytes as an int (1_500_000_000), a string with a unit ('1.5GiB', '800MB', "
    "'512KiB'), or a float in (0, 1]: that fraction of the peak without remat (`remat.apply`: no remat's step peak, "
    "the most bytes live during a step above its start, gradients included; `remat.chain`: its schedule's peak)"
)

def parse_budget(budget: Budget) -> int | float:
    """Read a budget: bytes (an int or a string with a unit) or a fraction in (0, 1] (a float).

    Args:
        budget: an int of bytes, a string such as "1.5GiB" or "800MB" (KB/MB/GB/TB are powers of
            1000, KiB/MiB/GiB/TiB of 1024), or a float fraction in (0, 1] of the peak without remat (the caller
            says which peak: `remat.apply`'s is no remat's step peak, `remat.chain`'s its schedule's).

    Returns:
        An int of bytes, or the float fraction.

    Raises:
        TypeError: `budget` is of another type.
        ValueError: it cannot be read, or is out of range.

    >>> parse_budget("1.5GiB"), parse_budget("800MB"), parse_budget(0.5)
    (1610612736, 800000000, 0.5)
    """
    if isinstance(budget, bool):
        raise TypeError(f"remat: `budget` must be bytes or a fraction, but got bool: {_BUDGET_HELP}.")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"remat: `budget` must be > 0 bytes, but got {budget}.")
        return budget
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0):
            raise ValueError(f"remat: a float `budget` is a fraction in (0, 1], but got {budget!r}; {_BUDGET_HELP}.")
        return budget
    if isinstance(budget, str):
        match = _BUDGET_RE.match(budget)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"remat: cannot read the budget {budget!r}; {_BUDGET_HELP}.")
        nbytes = int(float(match.group(1)) * _UNITS[unit])
        if nbytes <= 0:
            raise ValueError(f"remat: `budget` must be > 0 bytes, but got {budget!r}.")
        return nbytes
    raise TypeError(f"remat: `budget` must be an int, str or float, but got {type(budget).__name__}.")


def parse_memory(memory: object, name: str) -> int:
    """Read a device's memory: bytes, an int or a string with a unit ("80GiB"); never a fraction.

    Args:
        memory: the value given.
        name: what it was given as, for messages (e.g. "apply's `memory`", "track's `limit`").

    Raises:
        TypeError: `memory` is not an int or a string (a float fraction, a bool, None).
        ValueError: it cannot be read, or is not positive.

    >>> parse_memory("1KiB", "track's `limit`")
    1024
    """
    if isinstance(memory, (bool, float)) or not isinstance(memory, (int, str)):
        raise TypeError(f"remat: {name} is a device's memory in bytes: an int or a string such as '80GiB', but got "
                        f"{memory!r}.")
    try:
        nbytes = parse_budget(memory)
    except ValueError as error:
        raise ValueError(f"remat: {name} is a device's memory in bytes (an int or a string such as '80GiB'), but got "
                         f"{memory!r}.") from error
    assert isinstance(nbytes, int)
    return nbytes


# Text helpers every table of remat uses: byte counts, ratios, aligned columns (one definition each).

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
