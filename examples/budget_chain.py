"""A rotor-style schedule for a chain of stages under a memory budget.

Run: `python examples/budget_chain.py`.
"""

from __future__ import annotations

import torch
from torch import nn

import remat


def stages() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = 8
    for index in range(6):
        wider = 16 if index % 2 else 8
        layers += [nn.Sequential(nn.Conv2d(width, wider, 3, padding=1), nn.ReLU())]
        width = wider
    return nn.Sequential(*layers)


def main() -> None:
    x = torch.randn(4, 8, 32, 32, requires_grad=True)
    chain = remat.chain(stages(), budget=0.6, sample=x)
    chain(x).sum().backward()
    print(chain.schedule)


if __name__ == "__main__":
    main()
