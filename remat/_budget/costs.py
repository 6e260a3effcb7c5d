"""What a model's blocks cost under each way of rematerializing them: the data between profiling and planning.

`remat.apply(model, budget=...)` works in two steps joined by these plain records, so that either side can be
swapped: `remat._budget.profile.profile_blocks` runs one real training step and fills a `ModelCost`; a
profile on fake tensors (`remat.estimate`) may fill one the same way; `remat._budget.solve.solve_budget` reads a
`ModelCost` and chooses one option per block under a budget, never touching a tensor.

NOTE [ Budget model ]
A training step runs blocks 0..n-1 in order in forward and in reverse in backward; a plan's peak and time follow
from numbers measured per block, and the order of the blocks is the whole coupling between them.

Rules:
1. Block i under choice c leaves `held_bytes` h alive at the end of its forward (what it keeps for backward, its
   output included) until its backward.
2. While block i runs (forward or backward, recompute included), the blocks before it still hold what they kept,
   S_i = sum of h_j for j < i, and the blocks after it hold nothing more in backward: so every number below is
   counted *above* S_i:
     peak while block i runs forward   = S_i + forward_peak(i, c)
     peak while block i runs backward  = S_i + backward_peak(i, c)
     peak outside every block when blocks 0..k-1 hold their bytes (before block 0, between blocks, after the last
     forward and through the loss, after block 0's backward) = S_k + outside_peaks[k], for k = 0..n
3. The step's peak is the largest of these; its time is `outside_time` plus every block's forward and backward
   time.
4. The model is additive: what a block costs does not depend on the choices of the others.

Implementation notes:
1. (rule 2) Bytes are live tensor storage bytes beyond those live before the step (parameters and their gradients
   are outside them).
2. (rule 4) A block's output is kept alive by the next block whatever that block's choice, so it counts in h.
   Where the blocks' forwards leave less alive than this assumes, the profile runs the choices instead of
   deriving them (NOTE [ Deriving choices ] in derive.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["BlockCost", "GradientSteps", "ModelCost", "with_gradients"]


@dataclass(frozen=True)
class BlockCost:
    """What one block costs under one choice (see NOTE [ Budget model ]).

    Args:
        held_bytes: bytes its forward leaves alive for its backward, its output included.
        forward_peak: the peak while its forward runs, in bytes above what the blocks before it hold.
        backward_peak: the peak while its backward runs, recompute included, above the same.
        forward_time: seconds of its forward.
        backward_time: seconds of its backward, recompute included.

    >>> BlockCost(held_bytes=4096, forward_peak=8192, backward_peak=12288, forward_time=0.01, backward_time=0.02)
    BlockCost(held_bytes=4096, forward_peak=8192, backward_peak=12288, forward_time=0.01, backward_time=0.02)
    """

    held_bytes: int
    forward_peak: int
    backward_peak: int
    forward_time: float
    backward_time: float

    def __post_init__(self) -> None:
        for name in ("held_bytes", "forward_peak", "backward_peak"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"remat: BlockCost.{name} must be an int >= 0 (bytes), but got {value!r}.")
        for name in ("forward_time", "backward_time"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"remat: BlockCost.{name} must be a finite number >= 0, but got {value!r}.")

    @property
    def need(self) -> int:
        """The larger of the two peaks: the room this block needs above what the blocks before it hold."""
        return max(self.forward_peak, self.backward_peak)

    @property
    def time(self) -> float:
        """Forward and backward time together."""
        return self.forward_time + self.backward_time


@dataclass(frozen=True)
class ModelCost:
    """The costs of every block of a model under every choice, and of what runs outside the blocks.

    Args:
        names: the blocks' qualified names, in forward order.
        choices: the choices' labels, e.g. ("kept", "save_matmuls", "full").
        blocks: `blocks[i][c]` is block i's cost under choice c, or None where that choice is not open to it.
        outside_peaks: n + 1 numbers; see NOTE [ Budget model ].
        outside_time: seconds of the step spent outside the blocks.
        calls: `calls[i][c]`, for a choice that keeps some of block i's matmul-class calls (NOTE [ Some matmuls ]
            in derive.py), which of them; None for every other; empty: none such anywhere.
        priced: the times are ops priced on a nominal device (a profile on fake tensors: NOTE [ Priced time ] in
            remat/_measure/clock.py), good for comparing plans with each other, not as seconds of this device.

    >>> kept, full = BlockCost(8, 12, 16, 1.0, 2.0), BlockCost(1, 12, 20, 1.0, 3.0)
    >>> cost = ModelCost(("0", "1"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 4), 0.5)
    >>> len(cost), cost.choices
    (2, ('kept', 'full'))
    """

    names: tuple[str, ...]
    choices: tuple[str, ...]
    blocks: tuple[tuple[BlockCost | None, ...], ...]
    outside_peaks: tuple[int, ...]
    outside_time: float = 0.0
    calls: tuple[tuple[frozenset[int] | None, ...], ...] = ()
    priced: bool = False

    def __post_init__(self) -> None:
        n = len(self.names)
        if self.calls and len(self.calls) != n:
            raise ValueError(f"remat: a ModelCost of {n} blocks needs {n} rows of calls, but got {len(self.calls)}.")
        if len(self.blocks) != n or len(self.outside_peaks) != n + 1:
            raise ValueError(
                f"remat: a ModelCost of {n} blocks needs {n} rows of costs and {n + 1} outside peaks, but got "
                f"{len(self.blocks)} and {len(self.outside_peaks)}."
            )
        for i, row in enumerate(self.blocks):
            if len(row) != len(self.choices):
                raise ValueError(
                    f"remat: block {self.names[i]!r} has {len(row)} costs for {len(self.choices)} choices."
                )
            if all(c is None for c in row):
                raise ValueError(f"remat: block {self.names[i]!r} has no choice open to it.")

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class GradientSteps:
    """Gradient bytes alive while each block runs backward (`blocks`, n numbers) and in each window outside the
    blocks (`outside`, n + 1 numbers, as `ModelCost.outside_peaks`): NOTE [ Gradients in the budget ] in
    remat/_budget/gradients.py, and NOTE [ Compiled as one graph ] in whole_graph.py."""

    blocks: tuple[int, ...]
    outside: tuple[int, ...]


def with_gradients(cost: ModelCost, steps: GradientSteps) -> ModelCost:
    """`cost` with the gradients alive at each point of the step added to its peaks.

    >>> block = BlockCost(held_bytes=8, forward_peak=12, backward_peak=16, forward_time=1.0, backward_time=2.0)
    >>> cost = ModelCost(("0", "1"), ("kept",), ((block,), (block,)), (0, 0, 4))
    >>> new = with_gradients(cost, GradientSteps((64, 40), (64, 40, 16)))
    >>> [row[0].backward_peak for row in new.blocks], new.outside_peaks
    ([80, 56], (64, 40, 20))
    """
    n = len(cost.names)
    if len(steps.blocks) != n or len(steps.outside) != n + 1:
        raise ValueError(f"remat: {n} blocks need {n} and {n + 1} gradient sizes, but got "
                         f"{len(steps.blocks)} and {len(steps.outside)}.")
    blocks = tuple(
        tuple(None if c is None else dataclasses.replace(c, backward_peak=c.backward_peak + steps.blocks[i])
              for c in row)
        for i, row in enumerate(cost.blocks)
    )
    peaks = tuple(peak + steps.outside[k] for k, peak in enumerate(cost.outside_peaks))
    return dataclasses.replace(cost, blocks=blocks, outside_peaks=peaks)
