"""Errors raised by remat. Every one derives from `RematError`, itself a `RuntimeError`."""

from __future__ import annotations

__all__ = ["BudgetError", "RecomputeMismatchError", "RematError"]


class RematError(RuntimeError):
    """Base class of the errors remat raises while running (argument errors are `TypeError`/`ValueError`)."""


class RecomputeMismatchError(RematError):
    """Recompute in backward produced different saved tensors than forward did."""


class BudgetError(RematError):
    """No schedule fits the memory budget given to `remat.solve` or `remat.chain`."""


BUG = "this is a bug in remat; please report it"
