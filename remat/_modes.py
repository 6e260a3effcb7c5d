"""The base of remat's dispatch modes."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Mode"]


class Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A `TorchDispatchMode` whose `__torch_dispatch__` torch does not wrap in `torch._disable_dynamo`.

    NOTE [ Modes without the dynamo guard ]
    torch wraps every subclass's `__torch_dispatch__` in `_disable_dynamo` unless `_should_skip_dynamo()` says
    otherwise. The wrapper imports torch._dynamo on its first call (about two seconds: the one-off set-up that
    torch.utils.checkpoint's users pay) and adds about 1.7 µs to every op after that, a third of the replay
    recording budget. It is not needed: while a non-infra mode is on the stack, dynamo runs every frame eagerly
    (TorchDispatchMode sets `_is_in_any_mode_without_ignore_compile_internals`), these handlers included;
    test_region checks that a compiled function inside a region gives the right gradients.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
