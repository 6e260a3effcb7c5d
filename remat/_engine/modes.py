"""The base of remat's dispatch modes."""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Mode"]


class Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A `TorchDispatchMode` that pays for torch's dynamo guard only once dynamo is in use.

    NOTE [ Modes without the dynamo guard ]
    torch wraps every subclass's `__torch_dispatch__` in `torch._disable_dynamo` unless `_should_skip_dynamo()`
    says otherwise. The wrapper imports torch._dynamo on its first call (about two seconds: the one-off set-up
    that torch.utils.checkpoint's users pay) and adds about 1.7 µs to every op after that, a third of the replay
    recording budget. It only matters when compiled code runs under the mode, which needs torch._dynamo
    imported (without the guard, dynamo can step into the handler and miscount, as the tracker's test of a
    compiled function shows). So a mode is made unguarded while torch._dynamo is not imported, and as its
    guarded twin (a subclass made once, on demand) after that.
    """

    _guarded: ClassVar[bool] = False
    _twin: ClassVar[type[Mode] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        cls._twin = None
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]

    def __new__(cls, *args: Any, **kwargs: Any) -> Mode:
        if not cls._guarded and "torch._dynamo" in sys.modules:
            twin = cls._twin
            if twin is None:
                body = {
                    "_guarded": True,
                    "__torch_dispatch__": cls.__torch_dispatch__,
                    "__module__": cls.__module__,
                }
                twin = cls._twin = type(f"{cls.__name__}Guarded", (cls,), body)
            cls = twin
        return super().__new__(cls)

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return cls._guarded
