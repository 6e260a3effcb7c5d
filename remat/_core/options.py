"""The option set shared by every remat site, validated once when a site is made."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol, runtime_checkable

from .policies import PolicyLike, as_policy

__all__ = ["STRATEGIES", "Options", "unknown_options"]

Strategy = Literal["rerun", "replay"]
STRATEGIES: tuple[str, ...] = ("rerun", "replay")


@runtime_checkable
class Offloader(Protocol):
    """What `offload=` takes besides a bool: `remat.offload(...)`, which says how to offload."""

    def pack(self, tensor: Any) -> Any: ...
    def unpack(self, packed: Any) -> Any: ...


@dataclass(frozen=True)
class Options:
    """Keyword options of `@remat`, `remat(module)`, `remat.apply` and `remat.region`."""

    policy: PolicyLike = None
    preserve_rng: bool = True
    strategy: Strategy = "rerun"
    enabled: bool | None = None
    check: bool = True
    name: str | None = None
    debug: bool = False
    offload: bool | Offloader = False

    def __post_init__(self) -> None:
        as_policy(self.policy)  # raises TypeError for anything else
        for flag in ("preserve_rng", "check", "debug"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(
                    f"remat: `{flag}` must be a bool, but got `{type(getattr(self, flag)).__name__}`."
                )
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise TypeError(
                f"remat: `enabled` must be True, False or None, but got `{self.enabled!r}`."
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"remat: `strategy` must be one of {STRATEGIES}, but got {self.strategy!r}."
            )
        if not isinstance(self.offload, (bool, Offloader)):
            raise TypeError(
                "remat: `offload` must be True, False or remat.offload(...), but got "
                f"`{type(self.offload).__name__}`."
            )
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"remat: `name` must be a str, but got `{type(self.name).__name__}`.")

    def active(self, switch: bool) -> bool:
        """Whether this site rematerializes, given the global switch."""
        return switch if self.enabled is None else self.enabled


_APPLY_BUDGET = "`remat.apply(model, budget=..., sample=...)`, which fits a whole model into a memory budget"
_ELSEWHERE = {
    "budget": _APPLY_BUDGET,
    "sample": _APPLY_BUDGET,
    "loss": _APPLY_BUDGET,
    "choices": _APPLY_BUDGET,
    "replan": _APPLY_BUDGET,
    "where": "`remat.apply(model, where, every=...)`, which picks the submodules of a model",
    "every": "`remat.apply(model, where, every=...)`, which picks the submodules of a model",
    "segments": "`remat.checkpoint_sequential(functions, segments, input)`",
    "use_reentrant": "`remat.checkpoint(fn, *args, use_reentrant=False)`",
}


def unknown_options(given: Iterable[str], site: str) -> TypeError | None:
    """The error for keywords that `@remat` does not take, or None when there are none.

    It names the site and, for a keyword another remat function takes (`budget=`), that function.
    """
    known = {f.name for f in fields(Options)}
    unknown = [k for k in given if k not in known]
    if not unknown:
        return None
    names = ", ".join(f"`{k}=`" for k in unknown)
    hints = ""
    for where in dict.fromkeys(_ELSEWHERE[k] for k in unknown if k in _ELSEWHERE):
        keys = [f"`{k}=`" for k in unknown if _ELSEWHERE.get(k) == where]
        hints += f" {' and '.join(keys)} {'belong' if len(keys) > 1 else 'belongs'} to {where}."
    takes = ", ".join(f"`{f.name}`" for f in fields(Options) if f.name != "debug")
    return TypeError(f"remat: @remat on `{site}` got {names}, which it does not take.{hints} @remat takes {takes}.")
