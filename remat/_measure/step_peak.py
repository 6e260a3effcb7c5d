"""The peak of one training step: tracked in eager code, or read from the allocator where the model is compiled.

NOTE [ Measuring a compiled step ]
1. A budget planned for one compiled graph (`remat.apply(..., compile=True)`: NOTE [ Compiled as one graph ] in
   remat/_budget/costs_compiled.py) is verified on a real compiled step: `torch.compile(model)` (inductor, default
   options), one step to compile it, and the next measured.
2. It is measured by the allocator's own statistics on an accelerator (`max_memory_allocated`) and, on the CPU, by
   the autograd profiler's records of the CPU allocator (`host_bytes`); the step runs as fast as one not measured.
3. The step starts with zero gradients and leaves the model as it found it (gradients, buffers, RNG streams), as an
   eager verification does; the compiled code stays in dynamo's cache for a later `torch.compile(model)`.

Implementation notes:
1. (rules 1, 2) remat's tracker counts through a dispatch mode; inductor's kernels allocate where no mode sees them,
   and dynamo runs a frame it meets under a mode in eager code. The CPU records agree with the resident memory's rise
   in a fresh process (the benchmark's measure; docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._core.torch_compat import can_record_host, compiling_allowed, host_bytes
from .fake import FakeTracker
from .state import step_state
from .track import placed

__all__ = ["compiled_peak", "measure_step"]


def _no_grads(model: nn.Module) -> None:
    """Start a step as a default loop's `zero_grad()` leaves it: no gradients, so backward's new ones count
    (NOTE [ Gradients in the budget ] in remat/_budget/costs.py)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = None


def measure_step(model: nn.Module, step: Callable[[], torch.Tensor], *, grads: bool = True) -> int:
    """The tracked peak of one training step (forward and backward) above what was live before it, starting
    without gradients as after ``zero_grad()`` (so backward's new gradients count), or from zero gradients without
    ``grads`` (an eager step lifted to one compiled graph adds them itself); the model left as it was found."""
    with step_state(model, zeros=not grads, lazy=True):  # NOTE [ Buffers a measured step writes ]
        with FakeTracker() as tracker:  # a twin's fake tensors count where they claim to be
            loss = step()
            torch.autograd.backward(loss)
            del loss
    return tracker.peak_bytes


def compiled_peak(model: nn.Module, step: Callable[[nn.Module], torch.Tensor]) -> int | None:
    """The peak of one training step of `torch.compile(model)` above what was live before it (NOTE [ Measuring a
    compiled step ]), or None where this torch cannot measure it.

    Args:
        step: runs the forward of the module it is given (the compiled model) and returns the scalar loss.
    """
    accelerators = placed(model)
    compiled: Any = torch.compile(model)  # an nn.Module (dynamo's OptimizedModule)

    def run() -> None:
        loss = step(compiled)
        torch.autograd.backward(loss)

    if not accelerators and not can_record_host():
        return None  # nothing to read it with: compile nothing
    with step_state(model, zeros=False), compiling_allowed():
        run()  # compiles: what the compiler allocates is not the step's
        _no_grads(model)  # the measured run makes its gradients again, as after `zero_grad()`
        if not accelerators:
            found = host_bytes(run)
            return None if found is None else found[0]
        device = accelerators[0]
        module = torch.get_device_module(device)
        if not hasattr(module, "max_memory_allocated"):
            return None
        module.synchronize(device)
        module.reset_peak_memory_stats(device)
        before = module.memory_allocated(device)
        run()
        module.synchronize(device)
        return int(module.max_memory_allocated(device)) - int(before)
