"""What a site is inside a compiled frame: `torch.utils.checkpoint` (see NOTE [ Under torch.compile ])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compiling", "torch_checkpoint"]

# NOTE [ Under torch.compile ]
# Saved-tensor hooks and dispatch modes are graph breaks for dynamo, and a compiled graph saves other tensors
# than the eager function that rerun calls again, so remat's engine cannot run inside a compiled frame. There
# a rematerialized function becomes `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, which dynamo
# turns into its activation-checkpoint operator and the compiler partitions for memory (RNG is functionalised
# by the compiler itself); the `remat.checkpoint` drop-in hands its own keywords on to torch's there. A module
# instance's hooks step aside: its forward is traced as it is, so under compile `remat(module)` keeps
# gradients right but leaves memory to the compiler.
compiling = torch.compiler.is_compiling


def torch_checkpoint(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **keywords: Any) -> Any:
    """`torch.utils.checkpoint.checkpoint`, non-reentrant: what a site is inside a compiled frame."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False, **keywords, **kwargs)
