"""`with remat.region():` around an arbitrary block, with dropout, a BatchNorm and a Python loop.

Run: `python examples/region_block.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import remat


def main() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 3, padding=1)
    norm = nn.BatchNorm2d(16)
    x = torch.randn(4, 3, 32, 32, requires_grad=True)

    with remat.region(name="stem") as region:
        h = F.relu(norm(conv(x)))
        for _ in range(3):
            h = h + F.dropout(h.tanh(), 0.1)
    h.mean().backward()

    print(f"recorded {region.ops} ops; {region.freed_bytes / 2**20:.2f} MiB of activations rebuilt in backward")
    print(f"BatchNorm updated once: num_batches_tracked = {int(norm.num_batches_tracked)}")


if __name__ == "__main__":
    main()
