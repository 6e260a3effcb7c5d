"""The object `remat.region()` returns: a block of code, or each call of a decorated function, run as a replay
region through `region.begin` and `region.end`.

A `Region` keeps the recordings it has open in a thread-local stack, so one object may be entered again while it
is open (a recursive decorated function: each level is a nested region) and from several threads at once; `ops`
and `freed_bytes` describe the recording that ended last.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch

from .._core import switch as _switch
from .._core.errors import check_runs_when_called
from .._core.options import Options
from .._core.policies import as_policy
from .compiled import compiled_key, compiling, context_for, in_compiled_call, torch_checkpoint, warn_once
from .offload import resolve
from .region import RegionFrame, begin, end

__all__ = ["Region"]

_F = TypeVar("_F", bound=Callable[..., Any])


class Region:
    """Rematerialize every activation of a block by replaying the aten ops it ran.

    Used as `with remat.region() as r:` or as a decorator, `@remat.region()`. Inside, autograd keeps handles
    instead of the activations made in the block; backward replays the recorded ops to rebuild them. Tensors
    created before the block are kept by reference. The block runs untouched when the site is off
    (`enabled=False`, or `REMAT=0`) or when grad mode is off.

    Attributes:
        ops: number of aten ops recorded by the recording that ended last.
        freed_bytes: bytes of saved activations that it does not keep (rebuilt in backward).

    Args:
        options: the site's options; `strategy` is ignored (a region always replays).

    >>> import torch
    >>> from remat._core.options import Options
    >>> x = torch.randn(4, 4, requires_grad=True)
    >>> with Region(Options()) as r:
    ...     y = x.tanh().exp()
    >>> y.sum().backward()
    >>> r.ops, r.freed_bytes
    (2, 128)
    """

    def __init__(self, options: Options) -> None:
        self.options = options
        self.ops = 0
        self.freed_bytes = 0
        self._local = threading.local()

    def _stack(self) -> list[object]:
        stack: list[object] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _begin(self, site: str | None) -> None:
        options = self.options
        token = None
        if options.active(_switch.is_enabled()):
            if in_compiled_call():
                _warn_compiled_block()
            if site is None:
                caller = sys._getframe(2)
                site = f"region at {caller.f_code.co_filename}:{caller.f_lineno}"
            token = begin(
                site=site, check=options.check, preserve_rng=options.preserve_rng,
                debug=options.debug or _switch.debug(), offload=resolve(options.offload),
                policy=as_policy(options.policy),
            )
        self._stack().append(token)

    def _end(self, ok: bool) -> None:
        token = self._stack().pop()
        end(token, ok=ok)
        if ok and isinstance(token, RegionFrame):
            self.ops, self.freed_bytes = token.ops, token.freed_bytes

    def __enter__(self) -> Region:
        self._begin(self.options.name)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end(exc_type is None)

    def __call__(self, fn: _F) -> _F:
        """Decorate a function or method: each call runs as a fresh region."""
        site = self.options.name or getattr(fn, "__qualname__", None) or repr(fn)
        check_runs_when_called(fn, site)

        options = self.options
        context_fn = context_for(as_policy(options.policy), site, options.offload is not False)
        key = compiled_key(as_policy(options.policy))

        @functools.wraps(fn)
        def region(*args: Any, **kwargs: Any) -> Any:
            if compiling() and options.active(_switch.is_enabled()) and torch.is_grad_enabled():
                # NOTE [ Under torch.compile ]
                return torch_checkpoint(fn, args, kwargs, key=key, context_fn=context_fn)
            self._begin(site)
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                self._end(False)
                raise
            self._end(True)
            return out

        return region  # type: ignore[return-value]


def _warn_compiled_block() -> None:
    """Say once that a region in compiled code is not compiled (dynamo's graph break)."""
    warn_once("region block", (
        "remat: a `with remat.region():` block inside torch.compile'd code breaks the graph: dynamo runs the "
        "function holding it in eager code (rematerialized there, not compiled). To compile the block with its "
        "activations recomputed, move it into a function decorated with `@remat` or `@remat.region()`."
    ), stacklevel=5)
