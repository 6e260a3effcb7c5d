"""Rules for models from other libraries, each in its own module, imported only when a model comes from it.

This package itself imports nothing: `comes_from` reads a class's MRO, so `import remat` never imports
transformers or peft.
"""

from __future__ import annotations

__all__ = ["comes_from"]


def comes_from(kind: type, library: str) -> bool:
    """Whether the class `kind`, or one of its bases, is defined in `library` (a top-level package name).

    >>> import torch
    >>> comes_from(torch.nn.Linear, "torch"), comes_from(torch.nn.Linear, "transformers")
    (True, False)
    """
    prefix = library + "."
    return any(base.__module__ == library or base.__module__.startswith(prefix) for base in kind.__mro__)
