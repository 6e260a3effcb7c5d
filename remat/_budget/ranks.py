"""One plan for every rank: a budget plan made on several ranks is rank 0's, broadcast.

NOTE [ The same plan on every rank ]
Under data parallelism (DDP, FSDP2) every rank runs the budget planner's profile step (the collectives inside it
need every rank), and the profile's timings differ a little from rank to rank, so the solver could choose
differently on different ranks: ranks whose blocks rematerialize differently still compute the same gradients,
but their memory and speed differ, and the budget was given once for all of them. So the plan is rank 0's:
after solving, every rank takes it from rank 0 with ``broadcast_object_list`` over the default process group,
and the real step that checks the plan (NOTE [ Checking the plan ]) counts the highest peak of any rank, so every
rank corrects it alike.
Nothing happens without an initialised default group of more than one rank, or on torch's fake process group
(an estimate's: one process plays one rank).
"""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

__all__ = ["from_rank_zero", "max_over_ranks"]

T = TypeVar("T")


def _spread() -> bool:
    """Whether a default process group of more than one real rank is initialised."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return False
    return dist.get_backend() != "fake"


def from_rank_zero(value: T) -> T:
    """``value`` as rank 0 has it, on every rank of the default process group (``value`` itself without one)."""
    if not _spread():
        return value
    box: list[object] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def max_over_ranks(value: int) -> int:
    """The largest of ``value`` over the ranks of the default process group (``value`` itself without one)."""
    if not _spread():
        return value
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return max(v for v in values if isinstance(v, int))
