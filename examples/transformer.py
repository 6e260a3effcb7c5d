"""Rematerialize every block of a small transformer three ways, and check the gradients agree.

Run: `python examples/transformer.py`.
"""

from __future__ import annotations

import torch
from torch import nn

import remat


def model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).double()


def step(net: nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(1)
    with remat.track() as tracker:
        loss = net(x).square().mean()
        held = tracker.current_bytes
    loss.backward()
    return held, [p.grad for p in net.parameters()]


def main() -> None:
    x = torch.randn(8, 32, 64, dtype=torch.float64)
    held, reference = step(model(), x)
    print(f"no remat:                 {held / 2**20:6.2f} MiB held for backward")
    variants = {
        "remat.apply (rerun)": lambda m: remat.apply(m, nn.TransformerEncoderLayer),
        "remat.apply (replay)": lambda m: remat.apply(m, nn.TransformerEncoderLayer, strategy="replay"),
        "save_matmuls policy": lambda m: remat.apply(
            m, nn.TransformerEncoderLayer, policy=remat.policies.save_matmuls
        ),
    }
    for name, make in variants.items():
        held, grads = step(make(model()), x)
        for got, expected in zip(grads, reference, strict=True):
            torch.testing.assert_close(got, expected)
        print(f"{name:25s} {held / 2**20:6.2f} MiB held for backward, gradients equal")


if __name__ == "__main__":
    main()
