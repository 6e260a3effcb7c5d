"""What a device's allocator reserves beyond what tensors take: the headroom `memory=` leaves it, and the verification
of a plan's real step against the allocator's own count.

NOTE [ The allocator's reserve ]
A device's size, its cap (``torch.cuda.set_per_process_memory_fraction``) and its out-of-memory error count what the
caching allocator has reserved (segments from ``cudaMalloc``), not what tensors take: each block is rounded up
(`CUDA_BLOCK` in remat/_measure/fake.py) and carved from larger segments, freed blocks stay reserved for reuse, and
fragmentation leaves holes. Real runs reserve a few percent above their allocated peak, and a `memory=` plan that
filled the device with allocated bytes ran out of memory under a cap of that size (docs/benchmarks.md, "Figures
behind the design notes": the allocator's reserve).

Rules:
1. `remat.apply(model, memory=M)` plans the allocated peak (what `remat.estimate` and the tracker count) within M
   less a headroom (``headroom=``: a fraction of M, or bytes). The default is `DEFAULT` of M on a device whose
   allocator caches (CUDA, and any device whose module reports ``max_memory_reserved``): the most seen above the
   allocated peak in those runs, which a real step (rule 2) then corrects; nothing on the CPU, whose allocator
   reserves nothing beyond the tensors (and where ``remat.track(limit=)`` counts tensors). With
   ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` the allocator maps memory into one growing segment and the
   reserve shrinks to little more than the rounding: a smaller ``headroom`` fits more.
2. On such a device the plan is also run for real before `apply` returns, as the training loop will hold it: the
   optimizer's state made (stand-ins shaped like the parameters where the optimizer has not stepped yet), one
   forward and backward from no gradients, then the optimizer step's temporaries (stand-ins of the size the
   estimate counts), all read with the allocator's own ``max_memory_reserved`` (after ``empty_cache``: what
   planning left cached, the allocator gives back before it runs out). A step that reserves more than M, or runs
   out of memory, plans again for an allocated peak below what that step allocated by what it went over, and by a
   step more (`STEP` of M, at least one small segment, doubled at each try) so that the plan changes (at most
   `TRIES` times); where no plan gets under M, that is a `BudgetError`. So an `apply` that returns has seen its
   loop's step fit the device, up to the fragmentation later steps add (which the headroom is for).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from .._core.units import parse_memory
from .._measure.state import step_state

__all__ = ["DEFAULT", "SEGMENT", "STEP", "TRIES", "caches", "headroom_bytes", "least_memory", "reserved_peak"]

DEFAULT = 0.1
"""The headroom of a caching allocator, a fraction of the device's memory (NOTE [ The allocator's reserve ])."""

TRIES = 3
"""How many times a plan whose real step reserved too much is made again."""

STEP = 0.01
"""A share of the device's memory: how much lower than the last, at least, a plan made again aims (doubled at each
try; NOTE [ The allocator's reserve ], rule 2)."""

SEGMENT = 2 << 20
"""The CUDA caching allocator's small segment: the least step by which a plan made again aims lower."""


def caches(device: torch.device) -> bool:
    """Whether ``device``'s allocator reserves beyond its tensors and reports it (CUDA, or a module with
    ``max_memory_reserved``)."""
    if device.type == "cuda":
        return True
    if device.type in ("cpu", "meta"):
        return False
    try:
        module = torch.get_device_module(device.type)
    except (RuntimeError, AttributeError):
        return False
    return callable(getattr(module, "max_memory_reserved", None))


def _resolved(headroom: float | int | str | None, device: torch.device) -> tuple[float, int]:
    """``headroom`` as a fraction of the memory and bytes (one of them zero): `DEFAULT` where None and the
    device's allocator caches."""
    if headroom is None:
        return (DEFAULT if caches(device) else 0.0), 0
    if isinstance(headroom, float):
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"remat: `headroom` as a fraction of `memory` must be in [0, 1), but got {headroom!r}.")
        return headroom, 0
    if isinstance(headroom, int) and not isinstance(headroom, bool) and headroom == 0:
        return 0.0, 0
    return 0.0, parse_memory(headroom, "apply's `headroom`")


def headroom_bytes(headroom: float | int | str | None, memory: int, device: torch.device) -> int:
    """The bytes of ``memory`` left to the allocator: ``headroom`` as a fraction of it or bytes, by default `DEFAULT`
    of it where the device's allocator caches, else none (NOTE [ The allocator's reserve ]).

    >>> headroom_bytes(None, 1000, torch.device("cuda")), headroom_bytes(None, 1000, torch.device("cpu"))
    (100, 0)
    >>> headroom_bytes(0.05, 1000, torch.device("cpu")), headroom_bytes("200B", 1000, torch.device("cuda"))
    (50, 200)
    """
    fraction, nbytes = _resolved(headroom, device)
    if nbytes and nbytes >= memory:
        raise ValueError(f"remat: `headroom` ({nbytes} bytes) leaves nothing of `memory` ({memory} bytes).")
    return math.ceil(fraction * memory) + nbytes


def least_memory(allocated: int, headroom: float | int | str | None, device: torch.device) -> int:
    """The least `memory` whose headroom (`headroom_bytes`) leaves `allocated` bytes: what a refusal names, so
    that `memory=` set to it leaves the allocated peak it names.

    >>> least_memory(900, None, torch.device("cuda")), least_memory(900, "200B", torch.device("cuda"))
    (1000, 1100)
    """
    fraction, nbytes = _resolved(headroom, device)
    memory = max(allocated, math.floor(allocated / (1.0 - fraction)) - 1) + nbytes  # then up to the first that does
    while memory - math.ceil(fraction * memory) - nbytes < allocated:
        memory += 1
    return memory


@contextlib.contextmanager
def _stand_ins(like: Sequence[torch.Tensor], nbytes: int) -> Iterator[None]:
    """Tensors shaped like ``like`` (in turn, again from the first) until they take ``nbytes``, alive inside."""
    made: list[torch.Tensor] = []
    left = nbytes
    while left > 0 and like:
        for t in like:
            if left <= 0:
                break
            made.append(torch.empty_like(t, memory_format=torch.contiguous_format))
            left -= t.numel() * t.element_size()
    try:
        yield
    finally:
        made.clear()


def reserved_peak(model: nn.Module, device: torch.device, forward: Callable[[], torch.Tensor], state_bytes: int,
                  step_bytes: int) -> tuple[int, int] | None:
    """The most ``device``'s allocator reserved, and allocated, through one real step of the plan as the loop runs
    it (NOTE [ The allocator's reserve ], rule 2), or None where the step ran out of memory. The model is left as it
    was found (gradients, buffers, RNG streams).

    Args:
        forward: the step's forward and loss, returning the scalar loss.
        state_bytes: bytes of optimizer state not made yet, made as stand-ins through the step.
        step_bytes: bytes the optimizer step adds at its peak, made as stand-ins once backward has made the
            gradients.
    """
    module = torch.get_device_module(device.type)
    params = [p for p in model.parameters() if p.requires_grad and p.device == device]
    synchronize = getattr(module, "synchronize", None)
    empty_cache = getattr(module, "empty_cache", None)
    try:
        with _stand_ins(params, state_bytes), step_state(model, zeros=False, lazy=True):
            if synchronize is not None:
                synchronize(device)
            if empty_cache is not None:  # what planning left cached, which the allocator gives back when it must
                empty_cache()
            module.reset_peak_memory_stats(device)
            loss = forward()
            torch.autograd.backward(loss)
            del loss
            with _stand_ins(params, step_bytes):
                pass  # the optimizer step's peak: the gradients, the state and its temporaries
            if synchronize is not None:
                synchronize(device)
            return int(module.max_memory_reserved(device)), int(module.max_memory_allocated(device))
    except torch.OutOfMemoryError:
        return None
