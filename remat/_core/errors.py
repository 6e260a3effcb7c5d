"""Errors raised by remat. Every one derives from `RematError`, itself a `RuntimeError`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

from torch.utils.checkpoint import CheckpointError

from .public import claim

__all__ = ["BudgetError", "RecomputeMismatchError", "RematError", "alive", "check_runs_when_called"]

_T = TypeVar("_T")


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
    """No schedule fits the memory given to `remat.solve`, `remat.chain` or `remat.apply(budget=... | memory=...)`.

    Attributes:
        least_bytes: the smallest budget, in bytes, that remat can meet for this model and input (for
            `remat.apply(memory=...)`, the smallest total memory), also named in the message; None where it is
            not known.

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


_DEFERRED = {  # inspect's check -> (what the function is, what calling it returns)
    "isgeneratorfunction": ("a generator function", "a generator"),
    "isasyncgenfunction": ("an async generator function", "an async generator"),
    "iscoroutinefunction": ("a coroutine function", "a coroutine"),
}


def check_runs_when_called(fn: object, site: str) -> None:
    """Raise `TypeError` if calling `fn` returns before its body runs (a generator or a coroutine function).

    Calling such a function only makes a generator or coroutine object; its ops run later, as it is iterated
    or awaited, outside the site, so there would be nothing to rematerialize and no sign of it.
    """
    func = getattr(fn, "__func__", fn)
    kind = next((what for check, what in _DEFERRED.items() if getattr(inspect, check)(func)), None)
    if kind is not None:
        raise TypeError(
            f"remat: `{site}` is {kind[0]}: calling it returns {kind[1]} before its body runs, so its ops would "
            "run outside the site and nothing would be rematerialized. Decorate the plain function it calls for "
            "the computation instead, or put `with remat.region():` around the computation inside its body "
            "(not across a `yield` or an `await`)."
        )

def alive(ref: Callable[[], _T | None], what: str) -> _T:
    """What `ref` points to: a weak reference that a forward or hook remat put on a module holds to the module (a
    strong one would keep the module alive through the module's own dict). A RematError naming `what` where a
    shallow copy outlived the original it still points to."""
    found = ref()
    if found is None:
        raise RematError(
            f"remat: {what} was called on a shallow copy (`copy.copy`, or its `__dict__` copied) whose original no "
            "longer exists; copy it with `copy.deepcopy`, or call `remat.undo` on the original before copying."
        )
    return found


claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
