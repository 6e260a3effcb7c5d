"""One transformer block at a larger size (d=512, 8 heads, seq 256, batch 8) on CPU: no remat, `@remat`
(rerun) and `remat.region` (replay), interleaved, median of 5 steps; memory from `remat.track`.

Run: `python examples/block_region_vs_rerun.py` (about a minute on 2 cores).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch

import remat
from remat._demo import TransformerBlock


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = TransformerBlock(512, 8, 0.1)
    x = torch.randn(8, 256, 512, requires_grad=True)
    rerun = remat.remat(copy.deepcopy(block))
    replayed = copy.deepcopy(block)

    def region(x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            out: torch.Tensor = replayed(x)
        return out

    steps: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"no remat": block, "@remat": rerun, "region": region}
    for name, step in steps.items():
        with remat.track() as tracker:
            out = step(x)
            held = tracker.current_bytes
        out.sum().backward()
        print(f"{name:9s} held for backward {held / 2**20:6.1f} MiB, peak {tracker.peak_bytes / 2**20:6.1f} MiB")
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(5):
        for name, step in steps.items():
            start = time.perf_counter()
            step(x).sum().backward()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, seconds in median.items():
        print(f"{name:9s} step {seconds * 1e3:7.1f} ms")
    print(f"region / @remat step time: {median['region'] / median['@remat']:.3f} (target ≤ 1.05)")


if __name__ == "__main__":
    main()
