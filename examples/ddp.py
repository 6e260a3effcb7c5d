"""remat with DistributedDataParallel: estimate one rank's peak, then train and compare.

Run on CPU: `torchrun --nproc-per-node 2 examples/ddp.py` (`--configs none,full`, `--views` for
`gradient_as_bucket_view=True` too). Before `init_process_group`, each rank estimates its peak with
`shard="ddp"` (parameters, gradients and optimizer state whole, plus DDP's gradient buckets); a model already
wrapped in `DistributedDataParallel` is estimated as it is, with its own `gradient_as_bucket_view`. Then each
configuration trains a few AdamW steps while `remat.track()` counts the rank's live bytes, from before DDP
allocates its buckets.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import remat
from remat._demo import GPT, GPTConfig

CFG = GPTConfig(blocks=4, d=128, heads=4, seq=64, batch=4, vocab=512, dropout=0.0)
MiB = 2**20


def build(config: str, meta: bool = False) -> GPT:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = GPT(CFG)
    if config == "full":
        remat.apply(model)
    return model


def run(config: str, views: bool, idx: torch.Tensor, steps: int) -> tuple[int, int]:
    """(estimated, measured) peak of this rank for one configuration; the estimate is made on the wrapped model."""
    model = build(config)
    before = sum(p.untyped_storage().nbytes() for p in model.parameters()) + idx.untyped_storage().nbytes()
    with remat.track() as tracker:  # from before DDP allocates its buckets
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=views)
        optimizer = torch.optim.AdamW(ddp.parameters())
        with remat.enabled(config != "none"):
            for _ in range(steps):
                loss = ddp(idx).sum()
                loss.backward()
                del loss
                optimizer.step()
                optimizer.zero_grad()
    # A wrapped model is estimated with its own settings (on a copy of its state: nothing of it changes).
    estimated = remat.estimate(ddp, idx, optimizer="adamw", configs=(config,))[config].peak_bytes
    return estimated, before + tracker.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default="none,full", help="comma-separated: none, full")
    parser.add_argument("--views", action="store_true", help="also run with gradient_as_bucket_view=True")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    idx = torch.randint(0, CFG.vocab, (CFG.batch, CFG.seq), generator=torch.Generator().manual_seed(rank))
    configs = args.configs.split(",")

    # Before launching: one rank's peak with DDP's default buckets, on fake tensors, no process group needed.
    before_launch = {c: remat.estimate(build(c, meta=True), idx, optimizer="adamw", configs=(c,), world_size=world,
                                       shard="ddp")[c].peak_bytes for c in configs}

    dist.init_process_group("gloo")
    lines = []
    for views in (False, True) if args.views else (False,):
        for config in configs:
            estimated, measured = run(config, views, idx, args.steps)
            if not views:
                assert estimated == before_launch[config], "the wrapped model is estimated as the plain one"
            lines.append(f"rank {rank}/{world} config {config} gradient_as_bucket_view={views}: estimated peak "
                         f"{estimated / MiB:.2f} MiB, measured {measured / MiB:.2f} MiB "
                         f"({measured / estimated - 1:+.1%})")
    for r in range(world):
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
