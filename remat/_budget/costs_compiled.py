"""The compiled regime's costs (`CompiledRegime` in regimes.py): a model compiled as one graph, whose backward
returns every parameter gradient at once, and whose compiled code allocates less than eager code.

NOTE [ Compiled as one graph ]
When `torch.compile` turns the whole training step into one forward and one backward graph, the gradients of the
parameters live until that backward graph returns, on top of what an eager profile counts; a budget for such a
model plans with them.

Rules:
1. The budget model (NOTE [ Budget model ] in costs.py) is measured on an eager step, where each parameter's
   gradient is added into its `.grad` as soon as backward makes it and the temporary is freed: at most one such
   temporary is alive. Compiled as one graph, the parameters are inputs of the backward graph and their gradients
   its outputs; each output buffer is allocated when the kernel that makes it runs and stays alive until the whole
   graph returns, and only then does autograd add them into `.grad`. So while block i runs backward, the
   gradients of every parameter of blocks i+1..n-1 (and of the layers outside the blocks) are alive on top of
   what the eager profile counted, and a plan made on eager costs misses (docs/benchmarks.md).
2. With `remat.apply(..., compile=True)` the profile is planned with these gradients added, shifted by what
   compiling saves, priced as compiled code runs, and verified on real compiled steps; where even full remat does
   not fit, `BudgetError` says so.
3. Block by block compilation (`block.compile()`) needs none of this: each block's backward graph returns only
   its own gradients, as in eager code, so it is planned on eager costs either way (with `compile=True` the plan
   is then safe but keeps less than it could).
4. A plan made without `compile=True` that dynamo then traces from the model's root (the budget's forward
   pre-hook runs inside the compiled frame: the model is compiled as one graph) is warned about once, when dynamo
   traces it: such plans go over their budgets, the more the smaller the budget (docs/benchmarks.md).

Implementation notes:
1. (rule 2) `with_graph_gradients`: block i's backward peak gains the gradient bytes of the blocks after it, and
   the bytes outside the blocks at k gain those of blocks k..n-1; the gradients of parameters outside the blocks
   are counted as alive throughout (a head's are made first).
2. (rule 2) The profile itself is an eager one, so it is also shifted by what compiling saves in the bytes of the
   sample block (NOTE [ Compiled bytes ]) and its derived choices are priced as compiled code runs them (NOTE
   [ Compiled costs ] in costs_derived.py). The plan is verified on real compiled steps (NOTE [ Measuring
   a compiled step ] in remat/_measure/step_peak.py), the prediction's miss taken both ways (NOTE [ Planned on
   measured steps ] in verify.py). Where this torch cannot measure a compiled step, it is verified on eager code
   and its tracked peak is lifted by what the gradients add to the plan's prediction (`graph_extra`); that
   overstates compiled code, which fuses what eager code allocates.
3. (rule 4) `warn_one_graph`, through `when_traced`: a warning in traced code would break the graph.

NOTE [ Compiled bytes ]
1. A plan for one compiled graph is solved on an eager profile, but compiled code allocates less: the compiler
   fuses a block's pointwise ops, in forward and in recompute, into the kernels around them, so their temporaries
   never exist, and its backward graph returns the block's parameter gradients together.
2. So with `compile=True` the profile's sample block (one of the most common kind) runs alone under each choice
   twice, in eager code and compiled by `torch.compile` (inductor), on fresh inputs shaped like those of the
   profiled step (`compiled_shifts` in profile_alone.py), and the CPU allocator's records of both (`bytes_alone`)
   give, per choice, what compiling adds to the bytes it holds after forward, to its forward peak and to its
   backward peak (negative where it saves). Every block of that kind has its profiled numbers shifted by them,
   never below zero (`shifted` in costs.py); blocks of other kinds keep theirs.
3. On an accelerator, or where this torch cannot record allocations, nothing is shifted: the verification on
   compiled steps (NOTE [ Planned on measured steps ] in verify.py) still holds the plan to the budget, with less
   room.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .._engine.compiled import warn_once
from .costs import ModelCost, with_gradients
from .profile import GradientSteps
from .solve import evaluate_blocks

__all__ = ["ONE_GRAPH", "gradient_bytes", "graph_extra", "warn_one_graph", "with_graph_gradients"]

ONE_GRAPH = (
    "remat: a model with a budget planned for eager code (`remat.apply(model, budget=...)`) is being compiled as "
    "one graph, whose backward keeps every parameter gradient alive until it returns; the plan does not count "
    "them and can peak well over its budget. Plan it with `compile=True` "
    "(`remat.apply(model, budget=..., sample=..., compile=True)`), or compile its blocks one by one "
    "(`block.compile()`), which needs no flag."
)


def warn_one_graph(ctx: object) -> None:
    """Warn once per process that a budget planned for eager code is compiled as one graph (dynamo's `ctx` unused)."""
    warn_once("budget compiled as one graph", ONE_GRAPH, stacklevel=2)


def gradient_bytes(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[list[int], int]:
    """Bytes of the gradients of each block's parameters, and of the parameters outside every block.

    A parameter shared by several blocks counts once, in the last of them (its gradient is made there first).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> gradient_bytes(model, [model[0]])
    ([80], 40)
    """
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            owner[id(p)] = i
    per_block, outside = [0] * len(blocks), 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if id(p) in owner:
            per_block[owner[id(p)]] += nbytes
        else:
            outside += nbytes
    return per_block, outside


def with_graph_gradients(cost: ModelCost, per_block: Sequence[int], outside: int) -> ModelCost:
    """`cost` with the gradients a one-graph backward keeps alive added (NOTE [ Compiled as one graph ]).

    >>> from remat._budget.costs import BlockCost
    >>> block = BlockCost(held_bytes=8, forward_peak=12, backward_peak=16, forward_time=1.0, backward_time=2.0)
    >>> cost = ModelCost(("0", "1"), ("kept",), ((block,), (block,)), (0, 0, 4))
    >>> new = with_graph_gradients(cost, [100, 100], 1)
    >>> [row[0].backward_peak for row in new.blocks], new.outside_peaks
    ([117, 17], (201, 101, 5))
    """
    n = len(cost.names)
    if len(per_block) != n:
        raise ValueError(f"remat: {n} blocks need {n} gradient sizes, but got {len(per_block)}.")
    after = [sum(per_block[k:]) + outside for k in range(n + 1)]  # alive once blocks k.. have run backward
    return with_gradients(cost, GradientSteps(tuple(after[1:]), tuple(after)))


def graph_extra(eager: ModelCost, compiled: ModelCost, choice: Sequence[int]) -> int:
    """Bytes the one-graph backward adds to `choice`'s predicted peak: compiled minus eager prediction.

    >>> from remat._budget.costs import BlockCost
    >>> block = BlockCost(held_bytes=8, forward_peak=12, backward_peak=16, forward_time=1.0, backward_time=2.0)
    >>> cost = ModelCost(("0", "1"), ("kept",), ((block,), (block,)), (0, 0, 4))
    >>> graph_extra(cost, with_graph_gradients(cost, [100, 100], 1), (0, 0))
    177
    """
    return max(0, evaluate_blocks(compiled, choice)[0] - evaluate_blocks(eager, choice)[0])
