"""The rarer parts of a rerun recompute's state: autocast, the user's recompute context, the policy, debug traces.

Split from rerun.py, which enters them only when a site has any of them (NOTE [ Recompute state ] there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Protocol

import torch

from .._core.policies import Policy, tags
from .autocast import AutocastState
from .debug import OpTrace
from .offload import Offload
from .selective import ReuseOps, SaveOps

__all__ = ["RecomputeState", "recompute_contexts", "tag_sink"]


class RecomputeState(Protocol):
    """What `recompute_contexts` reads of a rerun frame (`rerun.RerunFrame`)."""

    autocast: AutocastState | None
    devices: tuple[torch.device, ...]
    saver: SaveOps | None
    contexts: Callable[[], AbstractContextManager[Any]] | None
    policy: Policy | None
    offload: Offload | None
    kept: list[Any]
    claimed: set[int]
    inner: bool
    kept_tags: list[Any]
    trace: list[str] | None
    retrace: list[str] | None


def recompute_contexts(self: RecomputeState) -> ExitStack:
    """The rarer recompute state: autocast, the user's recompute context, the policy, debug traces."""
    stack = ExitStack()
    stack.enter_context(AutocastState.enter(self.autocast, self.devices))
    if self.saver is not None:  # forward still runs (NOTE [ Backward inside a site ]): not its policy ops
        stack.enter_context(_unnoted(self.saver))
    if self.contexts is not None:
        stack.enter_context(self.contexts())
    if self.policy is not None:
        unpack = None if self.offload is None else self.offload.unpack_one
        if self.kept:
            stack.enter_context(ReuseOps(self.policy, self.kept, self.claimed, unpack))
        if self.inner and self.policy.names:
            # The function runs backward through what it tagged: a kept tensor put in its place would cut
            # that graph, so recompute rebuilds it (and forward's sink, if forward still runs, is not fed).
            stack.enter_context(tag_sink(_as_is))
        elif self.kept_tags:
            kept_tags = iter(self.kept_tags if unpack is None else map(unpack, self.kept_tags))
            policy = self.policy

            def hand_back(tensor: torch.Tensor, name: str) -> torch.Tensor:
                if not policy.saves_name(name):
                    return tensor
                kept: torch.Tensor = next(kept_tags)
                return kept.detach().requires_grad_(tensor.requires_grad)

            stack.enter_context(tag_sink(hand_back))
    if self.trace is not None:
        self.retrace = []
        stack.enter_context(OpTrace(self.retrace))
    return stack


def _never(func: Any) -> bool:
    return False


def _as_is(tensor: torch.Tensor, name: str) -> torch.Tensor:
    return tensor


@contextmanager
def _unnoted(saver: SaveOps) -> Iterator[None]:
    """Keep forward's `saver` from noting the ops of a recompute run while forward is still running."""
    saves_op, saver.saves_op = saver.saves_op, _never
    try:
        yield
    finally:
        saver.saves_op = saves_op


@contextmanager
def tag_sink(sink: Callable[[torch.Tensor, str], torch.Tensor]) -> Iterator[None]:
    """Route `remat.tag` calls to `sink` while the block runs (see NOTE [ Policies ])."""
    tags.sinks.append(sink)
    try:
        yield
    finally:
        tags.sinks.pop()
