"""remat: activation checkpointing for PyTorch as a one-line, correct, fast habit.

`import remat; @remat` and `from remat import remat; @remat` are the same decorator. Every public name is one import
below: the sites, the switch and the errors load with `import remat`; the measuring, planning and estimating wings,
imported under `TYPE_CHECKING`, load on first use, so that `import remat` stays cheap (remat/_core/public.py reads
this file for them).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from . import policies as policies
from ._api import Remat as Remat
from ._api import apply as apply
from ._api import plan as plan
from ._api import region as region
from ._api import remat as remat
from ._api import undo as undo
from ._core import public as _public
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
from ._sites.checkpoint import checkpoint as checkpoint
from ._sites.checkpoint import checkpoint_sequential as checkpoint_sequential
from ._sites.table import ModelPlan as ModelPlan

if TYPE_CHECKING:  # loaded on first use
    from ._chain.chain import Chain as Chain
    from ._chain.chain import chain as chain
    from ._chain.schedule import Schedule as Schedule
    from ._chain.simulate import StageCost as StageCost
    from ._chain.solver import solve as solve
    from ._estimate.estimate import estimate as estimate
    from ._estimate.report import ConfigEstimate as ConfigEstimate
    from ._estimate.report import EstimateReport as EstimateReport
    from ._measure.measure import measure as measure
    from ._measure.measurement import Measurement as Measurement
    from ._measure.measurement import Report as Report
    from ._measure.track import Tracker as Tracker
    from ._measure.track import track as track
    from ._sites.cross_entropy import linear_cross_entropy as linear_cross_entropy
    from ._sites.tiles import tiled as tiled

    Plan = Schedule  # renamed: `remat.Plan` warns at run time (NOTE [ The public surface ], rule 5)

__version__ = "0.1.0"
__all__ = sorted(_public.names())

_public.serve(sys.modules[__name__])  # callable as the decorator; the wings above load on first use
