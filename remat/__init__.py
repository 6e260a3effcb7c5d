"""remat: activation checkpointing for PyTorch as a one-line, correct, fast habit.

`import remat; @remat` and `from remat import remat; @remat` are the same decorator.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from . import policies as policies
from ._api import Remat as Remat
from ._api import remat as remat
from ._checkpoint import checkpoint as checkpoint
from ._checkpoint import checkpoint_sequential as checkpoint_sequential
from ._errors import BudgetError as BudgetError
from ._errors import RecomputeMismatchError as RecomputeMismatchError
from ._errors import RematError as RematError
from ._policies import tag as tag
from ._switch import enabled as enabled
from ._switch import is_enabled as is_enabled
from ._switch import set_enabled as set_enabled

__version__ = "0.1.0"

apply = remat.apply
region = remat.region
undo = remat.undo

__all__ = [
    "BudgetError",
    "RecomputeMismatchError",
    "Remat",
    "RematError",
    "apply",
    "checkpoint",
    "checkpoint_sequential",
    "policies",
    "enabled",
    "is_enabled",
    "region",
    "remat",
    "set_enabled",
    "tag",
    "undo",
]


class _CallableModule(types.ModuleType):
    """Lets `import remat; @remat` work: calling the package calls the decorator."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return remat(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
