"""Errors raised by remat. Every one derives from `RematError`, itself a `RuntimeError`."""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointError

__all__ = ["BudgetError", "RecomputeMismatchError", "RematError"]


class RematError(RuntimeError):
    """Base class of the errors remat raises while running (argument errors are `TypeError`/`ValueError`)."""


class RecomputeMismatchError(RematError, CheckpointError):
    """Recompute in backward produced different saved tensors than forward did.

    Also a `torch.utils.checkpoint.CheckpointError`, so code written for torch's checkpoint
    (`except CheckpointError`) catches it; the message opens with torch's words for the same condition.

    >>> import remat, torch.utils.checkpoint
    >>> issubclass(remat.RecomputeMismatchError, torch.utils.checkpoint.CheckpointError)
    True
    """


class BudgetError(RematError):
    """No schedule fits the memory budget given to `remat.solve` or `remat.chain`."""


BUG = "this is a bug in remat; please report it"
