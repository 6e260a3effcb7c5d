"""remat's public names: one table, read by everything that lists them.

`PUBLIC` maps each name of ``remat.__all__`` to where it is defined. The package (`remat/__init__.py`) re-exports
from it, loading the eager names with ``import remat`` and the rest on first use; the decorator object carries the
same names as attributes (``from remat import remat; remat.estimate``); the API reference (docs/api.md) writes
``::: remat.NAME`` and the docs build finds the definition here (docs/_ext/public_names.py). Two lists remain for
the type checker, which reads no table: the ``TYPE_CHECKING`` imports of `remat/__init__.py` and the decorator's
``TYPE_CHECKING`` attributes; tests/test_public.py fails when either differs from the table.

Public classes and functions carry ``__module__ = "remat"``, so that they show as ``remat.Tracker`` in reprs, help
and tracebacks: each module that defines one ends with ``claim(__name__)``, which sets it on the objects the table
lists there when the module is first imported, however it is reached.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["PUBLIC", "Public", "claim", "resolve"]


@dataclass(frozen=True)
class Public:
    """Where a public name is defined: a module of the package and a (dotted) attribute in it."""

    module: str  # relative to the package, as `importlib.import_module(module, "remat")` takes it
    attribute: str  # "" for the module itself
    lazy: bool = False  # loaded on first use: the measuring, planning and estimating wings
    doc: str = ""  # the path the API reference documents, where it is not module.attribute

    @property
    def path(self) -> str:
        """The dotted path the API reference documents."""
        return self.doc or f"remat{self.module}.{self.attribute}".rstrip(".")


PUBLIC: dict[str, Public] = {
    # Sites
    "remat": Public("._api", "remat", doc="remat._api.Remat"),
    "Remat": Public("._api", "Remat"),
    "apply": Public("._api", "remat.apply", doc="remat._api.Remat.apply"),
    "plan": Public("._api", "remat.plan", doc="remat._api.Remat.plan"),
    "undo": Public("._api", "remat.undo", doc="remat._api.Remat.undo"),
    "region": Public("._api", "remat.region", doc="remat._api.Remat.region"),
    "Region": Public("._engine.region", "Region"),
    "ModelPlan": Public("._sites.table", "ModelPlan"),
    "checkpoint": Public("._sites.checkpoint", "checkpoint"),
    "checkpoint_sequential": Public("._sites.checkpoint", "checkpoint_sequential"),
    # The head and the loss
    "linear_cross_entropy": Public("._sites.cross_entropy", "linear_cross_entropy", lazy=True),
    # Token-wise work in tiles
    "tiled": Public("._sites.tiles", "tiled", lazy=True),
    # Policies
    "policies": Public(".policies", ""),
    "tag": Public("._core.policies", "tag"),
    # The switch
    "is_enabled": Public("._core.switch", "is_enabled"),
    "set_enabled": Public("._core.switch", "set_enabled"),
    "enabled": Public("._core.switch", "enabled"),
    # Offload
    "offload": Public("._engine.offload", "offload"),
    "Offload": Public("._engine.offload", "Offload"),
    # Chains
    "chain": Public("._chain.chain", "chain", lazy=True),
    "Chain": Public("._chain.chain", "Chain", lazy=True),
    "solve": Public("._chain.solver", "solve", lazy=True),
    "Plan": Public("._chain.schedule", "Plan", lazy=True),
    "StageCost": Public("._chain.simulate", "StageCost", lazy=True),
    # Estimate
    "estimate": Public("._estimate.estimate", "estimate", lazy=True),
    "EstimateReport": Public("._estimate.report", "EstimateReport", lazy=True),
    "ConfigEstimate": Public("._estimate.report", "ConfigEstimate", lazy=True),
    # Measuring
    "track": Public("._measure.track", "track", lazy=True),
    "Tracker": Public("._measure.track", "Tracker", lazy=True),
    "measure": Public("._measure.measure", "measure", lazy=True),
    "Report": Public("._measure.report", "Report", lazy=True),
    "Measurement": Public("._measure.report", "Measurement", lazy=True),
    # Errors
    "RematError": Public("._core.errors", "RematError"),
    "RecomputeMismatchError": Public("._core.errors", "RecomputeMismatchError"),
    "BudgetError": Public("._core.errors", "BudgetError"),
}


def resolve(name: str) -> Any:
    """The object `PUBLIC[name]` names, importing its module (`AttributeError` for any other name)."""
    try:
        entry = PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'remat' has no attribute {name!r}") from None
    value: Any = importlib.import_module(entry.module, "remat")
    for part in filter(None, entry.attribute.split(".")):
        value = getattr(value, part)
    return value


def claim(module: str) -> None:
    """Give the public classes and functions that `module` defines ``__module__ = "remat"`` (see above)."""
    namespace = vars(sys.modules[module])
    for entry in PUBLIC.values():
        if f"remat{entry.module}" == module and "." not in entry.attribute:
            value = namespace[entry.attribute]
            if inspect.isclass(value) or inspect.isfunction(value):
                value.__module__ = "remat"
