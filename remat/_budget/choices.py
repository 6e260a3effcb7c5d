"""The choices a budget's blocks may take, and how one is put on a block: kept, `save_matmuls` (rerun), full remat,
the policies of the request's `choices`, and the parts (NOTE [ Some matmuls ] in costs_derived.py). The driver
(driver.py) places an assignment through them, and the profile (profile.py) each choice it runs.
"""

from __future__ import annotations

from torch import nn

from .._core.policies import Policy, PolicyLike, as_policy, matmuls, save_matmuls
from .._engine.offload import Offload
from .._sites.targets import remove_hooks, wrap_module
from .costs import KEPT
from .profile import DERIVABLE, PARTS
from .regimes import BudgetRegime
from .solve import Assignment

__all__ = ["KEPT", "Choices"]

class Choices:
    """The choices open to the blocks `names` of a model under `regime`, numbered as the profile and the costs number
    them (choice 0 keeps a block).

    Attributes:
        names: the blocks' qualified names, in forward order.
        policies, labels: per choice, its policy (`KEPT` for kept) and its label.
        calls: per block and choice, the matmul-class calls a part keeps, from the costs (rank 0's: NOTE [ The same
            plan on every rank ] in verify.py); empty until costs were made.
        offload: what puts what a rematerialized choice keeps on the host (NOTE [ Offload as a choice ] in
            offload_choice.py); None: nothing does.
    """

    def __init__(self, names: tuple[str, ...], regime: BudgetRegime) -> None:
        self.names = names
        self.request = regime.request
        policies: list[PolicyLike | str] = [KEPT]
        labels = [KEPT]
        if self.request.strategy == "rerun":
            policies.append(save_matmuls)
            labels.append("save_matmuls")
        policies.append(None)
        labels.append("full")
        for extra in self.request.choices or ():
            labels.append(_label(extra, set(labels) | set(PARTS)))
            policies.append(extra)
        if self.request.strategy == "rerun" and regime.offers_parts:
            policies.extend(PARTS)
            labels.extend(PARTS)
        self.policies, self.labels = tuple(policies), tuple(labels)
        self.calls: tuple[tuple[frozenset[int] | None, ...], ...] = ()
        self.offload: Offload | None = None

    def derived(self) -> list[int]:
        """The choices a profile derives from each block's run kept rather than runs (NOTE [ Deriving choices ] in
        costs_derived.py): under rerun, full remat, `save_matmuls` and the parts."""
        rerun = self.request.strategy == "rerun"  # rerun's recompute is what the derivations model
        return [c for c, label in enumerate(self.labels) if rerun and label in DERIVABLE]

    def assign(self, model: nn.Module, i: int, c: int) -> None:
        """Put block i of `model` under choice c."""
        block = model.get_submodule(self.names[i])
        remove_hooks(block)
        policy = self.policies[c]
        if self.labels[c] in PARTS:  # derived, never run while profiling: NOTE [ Some matmuls ]
            calls = self.calls[i][c] if self.calls else None
            if calls is None:
                raise ValueError(f"remat: choice {self.labels[c]!r} is not open to block {self.names[i]!r}.")
            policy = Policy(ops=(matmuls,), calls=calls)
        if policy != KEPT:
            wrap_module(block, self.request.options(policy, self.offload or False), model)  # type: ignore[arg-type]

    def place(self, model: nn.Module, assignment: Assignment) -> None:
        """Put `assignment`'s choices on the blocks of `model`."""
        for i, c in enumerate(assignment.choice):
            self.assign(model, i, c)


def _label(policy: PolicyLike, taken: set[str]) -> str:
    label = repr(as_policy(policy))
    while label in taken:
        label += "'"
    return label
