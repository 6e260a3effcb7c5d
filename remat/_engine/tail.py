"""Whether any Python code still runs after the op in progress: what lets early stop skip raising.

See NOTE [ Early stop ] in rerun.py.
"""

from __future__ import annotations

import dis
import threading
from types import CodeType, FrameType

__all__ = ["returns_at_once"]

# NOTE [ Stopping without raising ]
# Early stop must keep the function's code after the last needed tensor from running. Raising out of the pack
# hook does that, but the exception unwinds through autograd's C++ (some 15 µs: a third of @remat's whole cost on
# a tiny function). Where the op that saved that tensor is the last thing each Python frame between it and
# recompute does before returning its result (`return (x * 2).sin()`), nothing of the user's runs after it, so no
# raise is needed. A frame qualifies when the instruction after its current call is RETURN_VALUE; anything else
# (a store, another call, a `with` block's exit, a `finally` body, a comprehension's append) raises as before.
# The answer depends on the bytecode only, never on timing; it is cached per (code, instruction).

_RETURNS: dict[tuple[CodeType, int], bool] = {}
_RETURNS_KEPT = 4096
_LOCK = threading.Lock()


def _returns_after(code: CodeType, offset: int) -> bool:
    key = (code, offset)
    found = _RETURNS.get(key)
    if found is None:
        # The frame's offset is its call instruction's, or, while it calls Python code, that of the call's last
        # inline cache entry: the instruction after the call is the first one that starts beyond it.
        following = next((i for i in dis.get_instructions(code) if i.offset > offset), None)
        found = following is not None and following.opname == "RETURN_VALUE"
        with _LOCK:
            if len(_RETURNS) >= _RETURNS_KEPT:
                _RETURNS.clear()
            _RETURNS[key] = found
    return found


def returns_at_once(frame: FrameType | None, top: CodeType) -> bool:
    """Whether every frame from `frame` up to the nearest frame running `top` (not included) returns as soon as
    its current call does. The caller names its own frame by its code: holding a frame object would keep its
    locals alive in a cycle.

    >>> import sys
    >>> def last(): return returns_at_once(sys._getframe(), run.__code__)
    >>> def plain(): return last()
    >>> def busy(): out = last(); return out
    >>> def run(middle): return middle()
    >>> run(plain), run(busy)  # `busy` stores the result before it returns
    (True, False)
    """
    while frame is not None and frame.f_code is not top:
        if not _returns_after(frame.f_code, frame.f_lasti):
            return False
        frame = frame.f_back
    return frame is not None
