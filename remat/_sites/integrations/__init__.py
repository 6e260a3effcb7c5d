"""Rules for models from other libraries, each in its own module, imported only when a model comes from it.

This package itself imports nothing: `comes_from` reads a class's MRO, so `import remat` never imports
transformers or peft; `engine_of` imports the DeepSpeed integration only where the user's process imported deepspeed
(a model can carry its marks only there), and the integration itself never imports deepspeed.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from .deepspeed import DeepSpeed

__all__ = ["comes_from", "engine_of"]


def comes_from(kind: type, library: str) -> bool:
    """Whether the class `kind`, or one of its bases, is defined in `library` (a top-level package name).

    >>> import torch
    >>> comes_from(torch.nn.Linear, "torch"), comes_from(torch.nn.Linear, "transformers")
    (True, False)
    """
    prefix = library + "."
    return any(base.__module__ == library or base.__module__.startswith(prefix) for base in kind.__mro__)


def engine_of(model: nn.Module) -> DeepSpeed | None:
    """The engine that owns `model`'s parameters and gradients, or will (DeepSpeed ZeRO, NOTE [ Budgets under
    DeepSpeed ZeRO ] in deepspeed.py), else None. A model can carry DeepSpeed's marks only where deepspeed was
    imported, so for everyone else this is one dictionary lookup; where it was, the integration reads the marks
    by name (`carries_marks`).

    >>> import torch
    >>> engine_of(torch.nn.Linear(2, 2)) is None
    True
    """
    if "deepspeed" not in sys.modules:
        return None
    from . import deepspeed

    return deepspeed.owner(model) if deepspeed.carries_marks(model) else None
