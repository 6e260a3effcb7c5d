"""A custom op shaped like CUDA's fused attention with dropout, so that CPU tests see what only a GPU showed.

On CUDA, scaled-dot-product attention with dropout is one op (`_scaled_dot_product_flash_attention` and its
siblings, tagged `torch.Tag.nondeterministic_seeded`) that draws its mask inside the kernel from the device
generator; on CPU, SDPA decomposes and its dropout is an op of its own. A policy that keeps the fused op skips it in
recompute, so the generator is not advanced and every later random op of the region would draw another mask
(NOTE [ Random ops ] in remat/_engine/rng.py).

`noisy_scale(x, p)` has that shape: one op, tagged `nondeterministic_seeded`, that draws a Bernoulli mask from the
generator of the device it runs on and returns `x * mask / (1 - p)` and the mask, with its own autograd formula
(the mask is what its backward reads, as SDPA's backward reads its Philox seed and offset). `keeps_noisy` is a
callable policy choosing it. Importing this module registers the op (once per process; `torch.library` keeps it).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["keeps_noisy", "noisy_scale"]


@torch.library.custom_op(
    "remat_tests::noisy_scale", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def _noisy_scale(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.empty_like(x).bernoulli_(1.0 - p)  # from the generator of x's device
    return x * mask / (1.0 - p), mask


@_noisy_scale.register_fake
def _(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    ctx.save_for_backward(output[1])
    ctx.p = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor, grad_mask: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    (mask,) = ctx.saved_tensors
    return grad * mask / (1.0 - ctx.p), None


_noisy_scale.register_autograd(_backward, setup_context=_setup)

OP = torch.ops.remat_tests.noisy_scale.default


def noisy_scale(x: torch.Tensor, p: float = 0.3) -> torch.Tensor:
    """`x` times a fresh Bernoulli mask, scaled: one random op (its mask is not returned)."""
    return OP(x, p)[0]  # type: ignore[no-any-return]


def keeps_noisy(op: Any) -> bool:
    """A callable policy: keep `noisy_scale`'s outputs from forward."""
    return op is OP
