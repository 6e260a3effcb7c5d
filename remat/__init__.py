"""remat: activation checkpointing for PyTorch as a one-line, correct, fast habit.

`import remat; @remat` and `from remat import remat; @remat` are the same decorator.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from ._api import remat as _decorator
from ._core.public import PUBLIC

if TYPE_CHECKING:  # the names of remat/_core/public.py's table, for the type checker (tests/test_public.py)
    from . import policies as policies
    from ._api import Remat as Remat
    from ._api import remat as remat
    from ._chain.chain import Chain as Chain
    from ._chain.chain import chain as chain
    from ._chain.schedule import Plan as Plan
    from ._chain.simulate import StageCost as StageCost
    from ._chain.solver import solve as solve
    from ._core.errors import BudgetError as BudgetError
    from ._core.errors import RecomputeMismatchError as RecomputeMismatchError
    from ._core.errors import RematError as RematError
    from ._core.policies import tag as tag
    from ._core.switch import enabled as enabled
    from ._core.switch import is_enabled as is_enabled
    from ._core.switch import set_enabled as set_enabled
    from ._engine.offload import Offload as Offload
    from ._engine.offload import offload as offload
    from ._engine.region import Region as Region
    from ._estimate.estimate import estimate as estimate
    from ._estimate.report import ConfigEstimate as ConfigEstimate
    from ._estimate.report import EstimateReport as EstimateReport
    from ._measure.measure import measure as measure
    from ._measure.report import Measurement as Measurement
    from ._measure.report import Report as Report
    from ._measure.track import Tracker as Tracker
    from ._measure.track import track as track
    from ._sites.checkpoint import checkpoint as checkpoint
    from ._sites.checkpoint import checkpoint_sequential as checkpoint_sequential
    from ._sites.cross_entropy import linear_cross_entropy as linear_cross_entropy
    from ._sites.table import ModelPlan as ModelPlan
    from ._sites.tiles import tiled as tiled

    apply = remat.apply
    plan = remat.plan
    region = remat.region
    undo = remat.undo

__version__ = "0.1.0"
__all__ = sorted(PUBLIC)

# The decorator carries every public name (it reads the table); the package takes the eager ones from it now and
# the measuring and planning wings on first use.
for _name, _entry in PUBLIC.items():
    if not _entry.lazy:
        globals()[_name] = getattr(_decorator, _name)
del _name, _entry


if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        """The lazy names of the table (the measuring and planning wings), imported on first use."""
        if name not in PUBLIC:
            raise AttributeError(f"module 'remat' has no attribute {name!r}")
        value = getattr(_decorator, name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


class _CallableModule(types.ModuleType):
    """Lets `import remat; @remat` work: calling the package calls the decorator."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return remat(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
