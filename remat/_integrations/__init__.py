"""Rules for models from other libraries, each in its own module, imported only when a model comes from it.

This package itself imports nothing: `comes_from` reads a class's MRO, so `import remat` never imports
transformers or peft.
"""

from __future__ import annotations

from torch import nn

__all__ = ["comes_from"]


def comes_from(module: nn.Module, library: str) -> bool:
    """Whether `module`'s class, or one of its bases, is defined in `library` (a top-level package name).

    >>> import torch
    >>> comes_from(torch.nn.Linear(1, 1), "torch"), comes_from(torch.nn.Linear(1, 1), "transformers")
    (True, False)
    """
    prefix = library + "."
    return any(kind.__module__ == library or kind.__module__.startswith(prefix) for kind in type(module).__mro__)
