"""One plan for every rank: a budget plan made on several ranks is rank 0's, broadcast.

NOTE [ The same plan on every rank ]
Under data parallelism (DDP, FSDP2) every rank runs the budget planner's profile step (the collectives inside it
need every rank), and the profile's timings differ a little from rank to rank, so the solver could choose
differently on different ranks: ranks whose blocks rematerialize differently still compute the same gradients,
but their memory and speed differ, and the budget was given once for all of them. So the plan is rank 0's:
after solving, every rank takes it from rank 0 with ``broadcast_object_list`` over the default process group.
Nothing happens without an initialised default group of more than one rank, or on torch's fake process group
(an estimate's: one process plays one rank).
"""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

__all__ = ["from_rank_zero"]

T = TypeVar("T")


def from_rank_zero(value: T) -> T:
    """``value`` as rank 0 has it, on every rank of the default process group (``value`` itself without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return value
    if dist.get_backend() == "fake":
        return value
    box: list[object] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]
