"""Errors raised by remat. Every one derives from `RematError`, itself a `RuntimeError`."""

from __future__ import annotations

__all__ = ["BudgetError", "RecomputeMismatchError", "RematError"]


class RematError(RuntimeError):
    """Base class of the errors remat raises while running (argument errors are `TypeError`/`ValueError`)."""


class RecomputeMismatchError(RematError):
    """Recompute in backward produced different saved tensors than forward did."""


class BudgetError(RematError):
    """No schedule fits the memory budget given to `remat.solve`, `remat.chain` or `remat.apply(budget=...)`.

    Attributes:
        least_bytes: the smallest budget, in bytes, that remat can meet for this model and input (also named in
            the message), or None where it is not known.

    >>> BudgetError("remat: too small", least_bytes=1024).least_bytes
    1024
    """

    def __init__(self, message: str, *, least_bytes: int | None = None) -> None:
        super().__init__(message)
        self.least_bytes = least_bytes

    def __reduce__(self) -> tuple[object, ...]:  # pickles with its attribute (keyword-only in __init__)
        return (_budget_error, (str(self), self.least_bytes))


def _budget_error(message: str, least_bytes: int | None) -> BudgetError:
    return BudgetError(message, least_bytes=least_bytes)


BUG = "this is a bug in remat; please report it"
