"""`remat.plan(model)`: what is rematerialized in a model, one row per site, as a readable table.

A site is a module whose `forward` is rematerialized (`remat(module)`, `remat.apply`, `@remat` on its class or its
`forward`) or a method of its class decorated with `@remat`; a site made with `name=` shows that name. A model under
a budget (`remat.apply(model, budget=...)`) shows every block instead: its choice, the bytes it holds for backward
and the time it adds over keeping everything, then the predicted step peak and step time and those of no remat and
of full remat.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._core.public import claim
from .._core.units import aligned, format_bytes

if TYPE_CHECKING:  # the budget planner loads with `remat.apply(budget=...)`, not with `import remat`
    from .._budget.solve import Assignment

__all__ = ["OFFLOADED", "ModelPlan", "Site", "TiledModule"]

OFFLOADED = " + offload"
"""What a site's choice says where what it keeps goes to host memory."""


@dataclass(frozen=True)
class Site:
    """One rematerialized site of a model.

    Attributes:
        name: the qualified name of its module in the model (``""`` for the model itself).
        kind: the module's class.
        choice: how it is rematerialized (``"full"``, a policy, ``"(replay)"``, ``"+ offload"``).
        method: the rematerialized method: ``"forward"``, or another method of the class decorated with `@remat`.
        label: the site's ``name=`` option (what errors and reports call it), or None where none was given.
    """

    name: str
    kind: str
    choice: str
    method: str = "forward"
    label: str | None = None


@dataclass(frozen=True)
class TiledModule:
    """A module of a model that runs in tiles (NOTE [ What is tiled ] in remat/_sites/tiles.py).

    Attributes:
        name: its qualified name in the model.
        tiles: how many tiles.
        chosen_by: who chose the tiles where the user did not ("the budget"), else None.
    """

    name: str
    tiles: int
    chosen_by: str | None = None


@dataclass(frozen=True)
class ModelPlan:
    """The sites of a model, in `named_modules()` order; `str()` renders an aligned table.

    >>> import torch, remat
    >>> model = remat.apply(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    >>> [site.name for site in remat.plan(model)]
    ['0', '1']
    """

    model: str
    sites: tuple[Site, ...]
    budget: Assignment | None = None
    classes: tuple[str, ...] = ()
    switched_off: bool = False
    """The `REMAT` switch was off (`REMAT=0`, `remat.set_enabled(False)`) when the plan was made."""
    head: str | None = None
    """What `remat.apply(model, head=True)` did to the model's head and loss, in a line; None where nothing."""
    tiles: tuple[TiledModule, ...] = ()
    """The model's modules that run in tiles (`remat.tiled`, `remat.apply(model, tiles=...)`), in `named_modules()`
    order."""

    def __iter__(self) -> Iterator[Site]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def __str__(self) -> str:
        table = self._table()
        if self.head is not None:
            table += f"\nhead: {self.head}"
        groups: dict[tuple[int, str | None], list[str]] = {}
        for tiled in self.tiles:
            groups.setdefault((tiled.tiles, tiled.chosen_by), []).append(tiled.name or "(model)")
        for (count, chosen_by), names in groups.items():
            by = f", chosen by {chosen_by}" if chosen_by else ""
            table += f"\ntiles: {', '.join(names)} in {count} tiles{by}"
        if self.switched_off and self.sites:
            table += (
                "\nThe REMAT switch is off (REMAT=0 or remat.set_enabled(False)): these sites run as plain code "
                "and nothing is rematerialized, except at sites made with enabled=True."
            )
        return table

    def _table(self) -> str:
        if self.budget is not None:
            return self._budget_table(self.budget)
        if not self.sites:
            return f"remat plan for {self.model}: no rematerialized sites" + (
                " besides its head" if self.head is not None else "")
        methods = any(site.method != "forward" for site in self.sites)
        labels = any(site.label is not None for site in self.sites)
        header = ("block", "class", *(("method",) if methods else ()), *(("name",) if labels else ()), "choice")
        rows = [header]
        for site in self.sites:
            method = (site.method,) if methods else ()
            label = (site.label or "",) if labels else ()
            rows.append((site.name or "(model)", site.kind, *method, *label, site.choice))
        lines = [f"remat plan for {self.model}: {len(self.sites)} rematerialized sites"]
        lines += aligned(rows)
        return "\n".join(lines)

    def _budget_table(self, plan: Assignment) -> str:
        header = ("block", "class", "choice", "held for backward", "extra time")
        rows = [header]
        offloaded = {site.name for site in self.sites if site.choice.endswith(OFFLOADED)}
        for i in range(len(plan.cost)):
            name, choice, cost, extra = plan.block(i)
            kind = self.classes[i] if i < len(self.classes) else ""
            held = format_bytes(cost.held_bytes)
            if name in offloaded:  # on the host: NOTE [ Offload as a choice ] in remat/_budget/offload_choice.py
                choice, held = choice + OFFLOADED, held + " on the host"
            rows.append((name or "(model)", kind, choice, held, plan.time(extra, extra=True)))
        lines = [f"remat plan for {self.model}: {len(plan.cost)} blocks under a budget"]
        lines += aligned(rows)
        carried = [what for what, on in (("the head in chunks", self.head is not None), ("the tiles", bool(self.tiles)))
                   if on]
        lines += plan.summary(" and ".join(carried))
        return "\n".join(lines)

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
