"""The public decorator object: `remat`, with `region`, `apply`, `undo` and the switch as attributes.

`import remat; @remat` and `from remat import remat; @remat` are the same object (the package module forwards
calls to it), so every spelling takes the same options, validated when decorating, never first at call time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar, overload

from torch import nn

from . import _checkpoint, _estimate, _switch, _targets
from ._engine.region import Region
from ._options import Options, Strategy
from ._plan.sites import ModelPlan
from ._policies import PolicyLike

__all__ = ["Decorator", "Remat", "remat"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_M = TypeVar("_M", bound=nn.Module)
_Where = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool]


class Decorator(Protocol):
    """What `remat(...)` with options only returns: a decorator for any target."""

    @overload
    def __call__(self, target: type[_M], /) -> type[_M]: ...
    @overload
    def __call__(self, target: _M, /) -> _M: ...
    @overload
    def __call__(self, target: Callable[_P, _R], /) -> Callable[_P, _R]: ...


class Remat:
    """Rematerialize a function, a method, an `nn.Module` class or instance (spec §2.1).

    The activations autograd saves inside are freed after forward and rebuilt in backward by calling the
    function again (`strategy="rerun"`) or by replaying the aten ops recorded in forward (`"replay"`).

    Args:
        target: what to rematerialize; leave it out to get a decorator with the options.
        policy: which activations inside are still saved (`remat.policies`); `None` saves none.
        preserve_rng: recompute sees the RNG state forward saw, on every device.
        strategy: `"rerun"` calls the function again; `"replay"` replays the recorded ops.
        enabled: `True`/`False` force this site on or off; `None` follows the `REMAT` switch.
        check: compare what recompute saves with what forward saved and raise on a mismatch.
        name: label used in errors and reports (default: the qualified name).

    Returns:
        The same kind of thing it was given: a function, the same class, the same module object.

    Raises:
        TypeError, ValueError: for a target or an option of the wrong kind, when decorating.

    >>> import torch, remat
    >>> @remat
    ... def mlp(x, w):
    ...     return (x @ w).relu() @ w
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> mlp(x, torch.randn(8, 8)).sum().backward()
    >>> layer = remat(torch.nn.Linear(8, 8))   # same object, rematerialized in place
    """

    @overload
    def __call__(self, target: type[_M], /) -> type[_M]: ...
    @overload
    def __call__(self, target: _M, /) -> _M: ...
    @overload
    def __call__(self, target: Callable[_P, _R], /) -> Callable[_P, _R]: ...
    @overload
    def __call__(
        self,
        /,
        *,
        policy: PolicyLike = None,
        preserve_rng: bool = True,
        strategy: Strategy = "rerun",
        enabled: bool | None = None,
        check: bool = True,
        name: str | None = None,
    ) -> Decorator: ...

    def __call__(self, target: Any = None, /, **options: Any) -> Any:
        settings = Options(**options)
        if target is None:
            return _Partial(settings)
        return _targets.wrap(target, settings)

    @staticmethod
    def apply(
        model: _M,
        where: _Where | None = None,
        *,
        every: int = 1,
        policy: PolicyLike = None,
        preserve_rng: bool = True,
        strategy: Strategy = "rerun",
        enabled: bool | None = None,
        check: bool = True,
        name: str | None = None,
    ) -> _M:
        """Rematerialize every `every`-th submodule of `model` selected by `where`, in place.

        A submodule inside one already selected is not selected again (no nested regions). Without `where`,
        the model's repeated blocks are chosen: on a Hugging Face model the layers its own gradient
        checkpointing wraps, elsewhere the children of the longest `nn.ModuleList`/`nn.Sequential` whose
        children share one class; `remat.plan(model)` lists them.

        Args:
            model: the model; it is changed in place and returned.
            where: an `nn.Module` type, a tuple of types, a predicate `(name, module) -> bool`, or None.
            every: keep every `every`-th match, counting from the first (`every=2`: 1st, 3rd, ...).
            policy, preserve_rng, strategy, enabled, check, name: as for `remat`.

        Raises:
            ValueError: when `where` matches no submodule (or, without `where`, no repeated blocks are found),
                or `every` is not a positive int.

        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> model = remat.apply(model, torch.nn.Linear)
        """
        settings = Options(
            policy=policy, preserve_rng=preserve_rng, strategy=strategy, enabled=enabled,
            check=check, name=name,
        )
        return _targets.apply(model, where, every, settings)

    @staticmethod
    def plan(model: nn.Module) -> ModelPlan:
        """List the rematerialized sites of `model` (block, class, choice); `str()` is a table.

        >>> import torch, remat
        >>> model = remat.apply(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
        >>> print(remat.plan(model))
        remat plan for Sequential: 2 rematerialized sites
        block  class   choice
        0      Linear  full
        1      Linear  full
        """
        return _targets.plan(model)

    @staticmethod
    def undo(module: _M) -> _M:
        """Remove what `remat(module)` and `remat.apply` added to `module` and its submodules.

        >>> import torch, remat
        >>> layer = remat.undo(remat(torch.nn.Linear(2, 2)))
        """
        return _targets.undo(module)

    @staticmethod
    def region(
        *,
        policy: PolicyLike = None,
        preserve_rng: bool = True,
        enabled: bool | None = None,
        check: bool = True,
        name: str | None = None,
    ) -> Region:
        """Rematerialize a block of code: `with remat.region(): ...` (spec §2.2).

        Every activation made inside the block and saved by autograd is dropped at the end of forward and
        rebuilt in backward by replaying the aten ops recorded while the block ran. Tensors created before
        the block are kept by reference. Also a decorator: `@remat.region()`.

        Args:
            policy, preserve_rng, enabled, check, name: as for `remat`.

        Returns:
            A `Region`; after the block, `r.ops` is the number of ops recorded and `r.freed_bytes` the
            bytes of activations not kept.

        >>> import torch, remat
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> with remat.region() as r:
        ...     y = x.sin().cos()
        >>> y.sum().backward()
        """
        settings = Options(
            policy=policy, preserve_rng=preserve_rng, strategy="replay", enabled=enabled,
            check=check, name=name,
        )
        return Region(settings)

    estimate = staticmethod(_estimate.estimate)
    checkpoint = staticmethod(_checkpoint.checkpoint)
    checkpoint_sequential = staticmethod(_checkpoint.checkpoint_sequential)
    is_enabled = staticmethod(_switch.is_enabled)
    set_enabled = staticmethod(_switch.set_enabled)
    enabled = staticmethod(_switch.enabled)

    def __repr__(self) -> str:
        return "<remat decorator>"


class _Partial:
    """`remat(...)` with options and no target yet."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, target: Any, /) -> Any:
        return _targets.wrap(target, self.options)

    def __repr__(self) -> str:
        return f"remat({self.options})"


remat = Remat()
