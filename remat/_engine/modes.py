"""The base of remat's dispatch modes."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, ClassVar

from .._core.torch_compat import TorchDispatchMode, dynamo_guarded

__all__ = ["Mode"]

_Handler = Callable[..., Any]


def _switching(raw: _Handler) -> _Handler | None:
    """`raw` behind a switch: called directly while dynamo evaluates no frame on this thread, else guarded.

    See NOTE [ Modes without the dynamo guard ]. None where this torch lacks what the switch needs.
    """
    found = dynamo_guarded(raw)
    if found is None:
        return None
    guarded, get_eval_frame_callback, skip_code = found

    def __torch_dispatch__(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if get_eval_frame_callback() is None:
            return raw(self, func, types, args, kwargs)
        return guarded(self, func, types, args, kwargs)

    skip_code(__torch_dispatch__.__code__)
    return __torch_dispatch__


class Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A `TorchDispatchMode` that pays for torch's dynamo guard only while dynamo runs.

    NOTE [ Modes without the dynamo guard ]
    1. A mode pays for torch's dynamo guard only while dynamo runs: unguarded while torch._dynamo is not imported, and
       after that guarded only while a dynamo callback is set on the thread.
    2. Under compiled code the mode behaves as torch's guarded modes do.

    Implementation notes:
    1. (rule 1) torch wraps every subclass's `__torch_dispatch__` in `torch._disable_dynamo` unless
       `_should_skip_dynamo()` says otherwise; the wrapper imports torch._dynamo on first call and adds a guard to
       every op (docs/benchmarks.md for its cost).
    2. (rule 2) Without the guard dynamo steps into the handler and miscounts (the tracker's test of a compiled
       function shows it). So once torch._dynamo is imported a mode becomes its guarded twin (a subclass made once, on
       demand) whose handler is a switch: a frame dynamo always skips, which asks torch whether a dynamo callback is set
       (one C call) and calls the handler directly when none is, through torch's guard when one is. Where this torch
       lacks the switch's parts, the twin takes torch's guard on every op.
    """

    _guarded: ClassVar[bool] = False
    _torch_guard: ClassVar[bool] = False  # the twin's handler is torch's guard, not the switch
    _twin: ClassVar[type[Mode] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        cls._twin = None
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]

    def __new__(cls, *args: Any, **kwargs: Any) -> Mode:
        if not cls._guarded and "torch._dynamo" in sys.modules:
            twin = cls._twin
            if twin is None:
                switch = _switching(cls.__torch_dispatch__)
                body = {
                    "_guarded": True,
                    "_torch_guard": switch is None,
                    "__torch_dispatch__": cls.__torch_dispatch__ if switch is None else switch,
                    "__module__": cls.__module__,
                }
                twin = cls._twin = type(f"{cls.__name__}Guarded", (cls,), body)
            cls = twin
        return super().__new__(cls)

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return cls._torch_guard
