"""Budgets and byte counts as people write them: "1.5GiB", 800_000_000, 0.4 (a fraction)."""

from __future__ import annotations

import re

from .format import format_bytes

__all__ = ["Budget", "format_bytes", "parse_budget", "parse_memory"]

Budget = int | str | float

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

_BUDGET_HELP = (
    "a budget is bytes as an int (1_500_000_000), a string with a unit ('1.5GiB', '800MB', "
    "'512KiB'), or a float in (0, 1]: a fraction of the activation memory without remat"
)

def parse_budget(budget: Budget) -> int | float:
    """Read a budget: bytes (an int or a string with a unit) or a fraction in (0, 1] (a float).

    Args:
        budget: an int of bytes, a string such as "1.5GiB" or "800MB" (KB/MB/GB/TB are powers of
            1000, KiB/MiB/GiB/TiB of 1024), or a float fraction in (0, 1].

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
