"""The PyTorch tutorial's example: a function of 100 cheap ops, called 1000 times.

Without remat autograd keeps every intermediate of every call; with `@remat` each call keeps only its input,
so the memory held for backward drops by about 100x. Run: `python examples/tutorial_loop.py`.
"""

from __future__ import annotations

import torch

import remat


def hundred_ops(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    for _ in range(100):
        x = x * a
    return x


def held_for_backward(fn, calls: int = 1000, size: int = 256) -> int:  # type: ignore[no-untyped-def]
    a = torch.full((size,), 1.0001, requires_grad=True)
    x = torch.ones(size, requires_grad=True)
    with remat.track() as tracker:
        for _ in range(calls):
            x = fn(x, a)
        held = tracker.current_bytes
    x.sum().backward()
    return held


def main() -> None:
    plain = held_for_backward(hundred_ops)
    ours = held_for_backward(remat.remat(hundred_ops))
    print(f"held for backward: {plain / 2**20:.1f} MiB without remat, {ours / 2**20:.2f} MiB with @remat "
          f"({plain / ours:.0f}x less)")


if __name__ == "__main__":
    main()
