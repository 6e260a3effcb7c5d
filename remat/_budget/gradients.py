"""The gradients a default training loop's backward allocates, added to a profile's costs.

NOTE [ Gradients in the budget ]
Rules:
1. A budget bounds what a step allocates as the device counts it (`remat.track()`, or
   `torch.cuda.max_memory_allocated()` minus what was allocated before the step): gradients that backward makes
   count, gradients that already exist do not (an in-place accumulation allocates nothing that lives on).
2. A plan assumes the loop almost everyone writes: `optimizer.zero_grad()` sets gradients to None, so every
   backward allocates each parameter's gradient when it reaches that parameter, and it lives to the step's end.
   A loop that keeps its gradients (`zero_grad(set_to_none=False)`, accumulation) peaks lower, never higher.
3. The profile itself runs without new gradients (each parameter has a zero `.grad` that backward adds into:
   `step_state`), so what a block costs does not depend on where it sits. Inside each window of the profile, a
   parameter's gradient counts from the moment backward first accumulates it (where a default loop's backward
   would make it) to the window's end; the gradients made before a window are added here, by position, from the
   order in which the profiled backward reached the parameters.

Implementation notes:
1. `accumulation_order` records the parameters in the order their gradients were first accumulated (a
   post-accumulate-grad hook); every round of a profile runs the same backward order, so the first-seen order is
   the first round's.
2. A window's own gradients are in its measured peak (`Windows.made` in marks.py, at the first accumulation of
   each parameter in the step). Added here: while block i runs backward, the gradients of every parameter
   accumulated before block i's first; in the window between block k's backward and block k-1's
   (`outside_peaks[k]`, which also covers the forward between them, where no gradient exists yet), those
   accumulated up to block k's last; in window 0 (after block 0's backward), the same up to block 0's last; in
   window n (the head, the loss and their backward) none. A block without parameters takes the bounds of the
   next block below it that has some.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .costs import GradientSteps

__all__ = ["accumulation_order", "gradient_steps"]


@contextlib.contextmanager
def accumulation_order(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside: the list of `model`'s parameters in the order backward first accumulated their gradients."""
    order: list[torch.Tensor] = []
    seen: set[int] = set()

    def accumulated(param: torch.Tensor) -> None:
        if id(param) not in seen:
            seen.add(id(param))
            order.append(param)

    handles = [p.register_post_accumulate_grad_hook(accumulated)  # type: ignore[no-untyped-call]
               for p in model.parameters() if p.requires_grad]
    try:
        yield order
    finally:
        for handle in handles:
            handle.remove()


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def gradient_steps(blocks: Sequence[nn.Module], order: Sequence[torch.Tensor]) -> GradientSteps:
    """Where backward's new gradients are alive, from the order it made them (NOTE [ Gradients in the budget ]).

    >>> import torch
    >>> blocks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]   # 24 bytes of gradients each
    >>> head = torch.nn.Parameter(torch.ones(4))                  # 16 bytes, reached first
    >>> order = [head, *blocks[1].parameters(), *blocks[0].parameters()]
    >>> steps = gradient_steps(blocks, order)
    >>> steps.blocks, steps.outside
    ((40, 16), (64, 40, 0))
    """
    n, total = len(blocks), len(order)
    position = {id(p): q for q, p in enumerate(order)}
    before = [0]
    for p in order:
        before.append(before[-1] + _nbytes(p))  # before[q]: bytes of the first q gradients made
    first: list[int | None] = []
    last: list[int | None] = []
    for block in blocks:
        found = [position[id(p)] for p in block.parameters() if id(p) in position]
        first.append(min(found) if found else None)
        last.append(max(found) if found else None)
    start = [total] * n  # where block i's backward starts, in gradients made (a block without any: the next below)
    end = [total] * n
    below_first = total
    for i in range(n):  # from block 0 up: a parameterless block takes the bounds of the next one below it
        opened, closed = first[i], last[i]
        if opened is None or closed is None:
            start[i] = end[i] = below_first
        else:
            below_first = start[i] = opened
            end[i] = closed + 1
    outside = [before[end[k]] for k in range(n)] + [0]
    return GradientSteps(tuple(before[s] for s in start), tuple(outside))
