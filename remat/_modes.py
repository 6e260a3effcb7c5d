"""The base of remat's dispatch modes."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Mode"]


class Mode(TorchDispatchMode):  # type: ignore[misc]
    """A `TorchDispatchMode` whose `__torch_dispatch__` torch does not wrap in `torch._disable_dynamo`.

    NOTE [ Modes without the dynamo guard ]
    torch wraps every subclass's `__torch_dispatch__` in `_disable_dynamo` unless `_should_skip_dynamo()` says
    otherwise. The wrapper imports torch._dynamo on its first call (about two seconds: the one-off set-up that
    torch.utils.checkpoint's users pay) and adds some 15 µs to every op after that. remat's modes only record
    or redirect aten ops and never run under compilation, so they opt out.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
