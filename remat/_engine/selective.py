"""Dispatch modes that carry out a policy in rerun: keep chosen ops' outputs, then reuse them (NOTE [ Policies ])."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._policies import Policy
from .modes import Mode

__all__ = ["ReuseOps", "SaveOps"]


class SaveOps(Mode):
    """Forward: keep the outputs of the ops `policy` chooses, in order."""

    def __init__(self, policy: Policy, kept: list[Any], ids: set[int]) -> None:
        super().__init__()
        self.policy = policy
        self.kept = kept
        self.ids = ids

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.policy.saves_op(func):
            self.kept.append(out)
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.ids.add(id(tensor))
        return out


class ReuseOps(Mode):
    """Recompute: hand back forward's outputs of the chosen ops instead of running them again."""

    def __init__(self, policy: Policy, kept: Iterable[Any]) -> None:
        super().__init__()
        self.policy = policy
        self.kept = iter(kept)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.policy.saves_op(func):
            out = next(self.kept)
            if isinstance(out, torch.Tensor):
                return out.detach()
            return type(out)(t.detach() if isinstance(t, torch.Tensor) else t for t in out)
        return func(*args, **(kwargs or {}))
