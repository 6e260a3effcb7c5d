"""`remat.plan(model)`: what is rematerialized in a model, one row per site, as a readable table."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["ModelPlan", "Site"]


@dataclass(frozen=True)
class Site:
    """One rematerialized block: its qualified name, its class and how it is rematerialized."""

    name: str
    kind: str
    choice: str


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

    def __iter__(self) -> Iterator[Site]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def __str__(self) -> str:
        if not self.sites:
            return f"remat plan for {self.model}: no rematerialized sites"
        header = ("block", "class", "choice")
        rows = [header, *((site.name or "(model)", site.kind, site.choice) for site in self.sites)]
        widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
        lines = [f"remat plan for {self.model}: {len(self.sites)} rematerialized sites"]
        for row in rows:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        return "\n".join(lines)
