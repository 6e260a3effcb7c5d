"""What compiling a block changes in the bytes it holds and peaks at, under each choice.

NOTE [ Compiled bytes ]
A plan for one compiled graph (`remat.apply(..., compile=True)`) is solved on an eager profile, but compiled code
allocates less: the compiler fuses a block's pointwise ops, in forward and in recompute, into the kernels around
them, so their temporaries never exist, and its backward graph returns the block's parameter gradients together:
eager costs predict more than compiled code holds (NOTE [ Planned on measured steps ] in check.py; a case in
docs/benchmarks.md). So with `compile=True` the
profile's sample block (one of the most common kind) runs alone under each choice twice, in eager code and
compiled by `torch.compile` (inductor), on fresh inputs shaped like those of the profiled step, and the CPU
allocator's records of both (`bytes_alone`) give, per choice, what compiling adds to the bytes it holds after
forward, to its forward peak and to its backward peak (negative where it saves). Every block of that kind has
its profiled numbers shifted by them, never below zero; blocks of other kinds keep theirs. On an accelerator, or
where this torch cannot record allocations, nothing is shifted: the plan's compiled check (NOTE [ Measuring a
compiled step ]) still holds it to the budget, with less room.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._core.torch_compat import can_record_host, compiling_allowed
from .alone import bytes_alone
from .costs import BlockCost, ModelCost

__all__ = ["Shift", "compiled_shifts", "shifted"]

Shift = tuple[int, int, int]  # bytes compiling adds to a block's held bytes, forward peak and backward peak


def compiled_shifts(
    block: nn.Module, spec: tuple[Any, Any], choices: Sequence[int], assign: Callable[[int], None]
) -> dict[int, Shift]:
    """Per choice, what compiling `block` adds to its bytes (NOTE [ Compiled bytes ]); empty where it cannot tell.

    Args:
        spec: its inputs in the profiled step (`describe`).
        choices: the choices to measure (each is put on `block` with `assign`; kept is put back after).
    """
    if any(p.device.type != "cpu" for p in block.parameters()) or not can_record_host():
        return {}
    compiled = torch.compile(block)
    shifts: dict[int, Shift] = {}
    try:
        for c in choices:
            assign(c)
            eager = bytes_alone(block, spec)
            with compiling_allowed():
                bytes_alone(compiled, spec)  # compiles: what the compiler allocates is not the block's
                fused = bytes_alone(compiled, spec)
            if eager is None or fused is None:
                return {}
            shifts[c] = (fused[0] - eager[0], fused[1] - eager[1], fused[2] - eager[2])
    finally:
        assign(0)
    return shifts


def shifted(cost: ModelCost, kinds: Sequence[Any], kind: Any, shifts: Mapping[int, Shift]) -> ModelCost:
    """`cost` with the blocks of `kind` shifted by `shifts` per choice, never below zero.

    >>> cost = ModelCost(("0",), ("kept",), ((BlockCost(8, 12, 16, 1.0, 2.0),),), (0, 0))
    >>> shifted(cost, ["mlp"], "mlp", {0: (-2, 0, -20)}).blocks[0][0]
    BlockCost(held_bytes=6, forward_peak=12, backward_peak=0, forward_time=1.0, backward_time=2.0)
    """

    def one(c: int, block: BlockCost | None) -> BlockCost | None:
        if block is None or c not in shifts:
            return block
        held, forward, backward = shifts[c]
        return dataclasses.replace(
            block,
            held_bytes=max(0, block.held_bytes + held),
            forward_peak=max(0, block.forward_peak + forward),
            backward_peak=max(0, block.backward_peak + backward),
        )

    rows = tuple(
        tuple(one(c, b) for c, b in enumerate(row)) if kinds[i] == kind else row for i, row in enumerate(cost.blocks)
    )
    return dataclasses.replace(cost, blocks=rows)
