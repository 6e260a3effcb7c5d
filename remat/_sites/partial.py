"""What calling `remat` returns: the target wrapped, or a decorator that waits for its target.

Options are validated when `remat` is called, never first when the wrapped code runs; a keyword `remat` does not
take is an error naming the site, which `remat(**options)` knows only once it gets its target.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .._core.options import Options, unknown_options
from . import targets as _targets

__all__ = ["decorate"]


def decorate(target: Any, options: dict[str, Any]) -> Any:
    """What `remat(target, **options)` returns, or `remat(**options)` with `target` None: the wrapped target, or a
    decorator waiting for it (options validated now, an unknown keyword raised when the site is known)."""
    if target is None:
        if unknown_options(options, "") is not None:
            return _Unknown(options)  # raises when it gets its target, naming it
    elif (error := unknown_options(options, _site_name(target, options))) is not None:
        raise error
    made = Options(**options)
    if target is None:
        return _Partial(made)
    return _targets.wrap(target, made)


def _site_name(target: Any, options: dict[str, Any]) -> str:
    """The site's name for an error: `name=`, else the class's or the function's qualified name."""
    if isinstance(options.get("name"), str):
        return str(options["name"])
    if isinstance(target, nn.Module):
        return type(target).__qualname__
    return str(getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target))


class _Unknown:
    """`remat(...)` with a keyword it does not take: raises, naming the site, once it gets its target."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def __call__(self, target: Any, /) -> Any:
        error = unknown_options(self.options, _site_name(target, self.options))
        assert error is not None
        raise error


class _Partial:
    """`remat(...)` with options and no target yet."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, target: Any, /) -> Any:
        return _targets.wrap(target, self.options)

    def __repr__(self) -> str:
        return f"remat({self.options})"
