"""The global switch: the `REMAT` environment variable and its run-time forms.

See NOTE [ The switch ]: with the switch off, every site whose `enabled` is `None` is a pass-through that costs
one flag check. `REMAT=0` means off (unlike `bool(os.environ["X"])`, which reads "0" as true).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from .public import claim

__all__ = ["debug", "enabled", "is_enabled", "parse_flag", "set_enabled"]

_TRUE = frozenset({"1", "true", "on", "yes"})
_FALSE = frozenset({"0", "false", "off", "no"})


def parse_flag(variable: str, value: str | None, default: bool) -> bool:
    """Read an on/off environment value; anything else is a `ValueError` that names it."""
    if value is None or value.strip() == "":
        return default
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(
        f"remat: the environment variable {variable}={value!r} is not an on/off value; "
        f"use one of 1/true/on/yes or 0/false/off/no (any case)."
    )


# NOTE [ The switch ]
# 1. `REMAT=0/1` and `set_enabled` set one process-wide flag (like `torch.backends.*` flags), not a thread-local one:
#    they are meant for a whole program.
#
# Implementation notes:
# 1. (rule 1) `_state[0]` is the flag, read once per call on the hot path and replaced whole.
_state = [parse_flag("REMAT", os.environ.get("REMAT"), True)]
_debug = parse_flag("REMAT_DEBUG", os.environ.get("REMAT_DEBUG"), False)


def is_enabled() -> bool:
    """Return whether remat sites with `enabled=None` rematerialize.

    >>> import remat
    >>> remat.is_enabled() in (True, False)
    True
    """
    return _state[0]


def set_enabled(flag: bool) -> None:
    """Turn every site whose `enabled` is `None` on or off.

    Args:
        flag: `True` to rematerialize, `False` to make every such site a pass-through.

    >>> import remat
    >>> remat.set_enabled(False); remat.is_enabled()
    False
    >>> remat.set_enabled(True)
    """
    if not isinstance(flag, bool):
        raise TypeError(f"remat: set_enabled expects a bool, but got `{type(flag).__name__}`.")
    _state[0] = flag


@contextmanager
def enabled(flag: bool) -> Iterator[None]:
    """Turn remat on or off inside a `with` block and restore the previous setting on exit.

    >>> import remat
    >>> with remat.enabled(False):
    ...     remat.is_enabled()
    False
    """
    previous = _state[0]
    set_enabled(flag)
    try:
        yield
    finally:
        _state[0] = previous


def debug() -> bool:
    """Return whether `REMAT_DEBUG=1` asked for op traces on recompute mismatches."""
    return _debug

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
