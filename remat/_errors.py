"""Errors raised by remat. Every one derives from `RematError`, itself a `RuntimeError`."""

from __future__ import annotations

__all__ = ["BudgetError", "RecomputeMismatchError", "RematError"]


class RematError(RuntimeError):
    """Base class of the errors remat raises while running (argument errors are `TypeError`/`ValueError`)."""


class RecomputeMismatchError(RematError):
    """Recompute in backward produced different saved tensors than forward did."""


class BudgetError(RematError):
    """No schedule fits the memory budget given to `remat.solve` or `remat.chain`.

    Attributes:
        least_bytes: the least budget (or, for `remat.apply(memory=...)`, the least total memory) that fits, in
            bytes, when known; None otherwise. The message names it too.
    """

    def __init__(self, *args: object, least_bytes: int | None = None) -> None:
        super().__init__(*args)
        self.least_bytes = least_bytes


BUG = "this is a bug in remat; please report it"
