"""The option set shared by every remat site, validated once when a site is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from ._policies import PolicyLike, as_policy

__all__ = ["STRATEGIES", "Options"]

Strategy = Literal["rerun", "replay"]
STRATEGIES: tuple[str, ...] = ("rerun", "replay")


@runtime_checkable
class Offloader(Protocol):
    """What `offload=` takes besides a bool: `remat.offload(...)`, which says how to offload."""

    def pack(self, tensor: Any) -> Any: ...
    def unpack(self, packed: Any) -> Any: ...


@dataclass(frozen=True)
class Options:
    """Keyword options of `@remat`, `remat(module)`, `remat.apply` and `remat.region` (spec §2.1)."""

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
