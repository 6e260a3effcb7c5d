"""Fit a training step into a memory budget: estimate it first, then let remat choose per block.

Run: `python examples/fit_budget.py`.
"""

from __future__ import annotations

import torch
from torch import nn

import remat


def encoder() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True) for _ in range(6)))


def peak_of_a_step(model: nn.Module, x: torch.Tensor) -> int:
    with remat.track() as tracker:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def main() -> None:
    x = torch.randn(8, 32, 64)
    model = encoder()

    # Before allocating anything at this size: the peak per configuration, on fake tensors.
    print(remat.estimate(model, x, configs=("none", "full", 0.5)))

    # Half of no remat's activation peak: one profiled step, then each block gets its choice.
    none = peak_of_a_step(model, x)
    remat.apply(model, budget=0.5, sample=x)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):  # the first step checks the plan, corrected before the next one if it went over
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")

    print(remat.plan(model))  # the predicted peak, and the first step's measured one
    fitted = peak_of_a_step(model, x)
    print(f"tracked peak of a step: {fitted / 2**20:.2f} MiB with the budget, {none / 2**20:.2f} MiB without")


if __name__ == "__main__":
    main()
