"""remat with FSDP2 (`fully_shard`): estimate one rank's peak before launching, then train and compare.

Run on CPU: `torchrun --nproc-per-node 2 examples/fsdp2.py` (add `--config full` or `--config 0.7`,
`--meta` to build the model on the meta device). Every rank estimates its own peak first, on fake tensors and
torch's fake process group, before `init_process_group`; then each block and the root are `fully_shard`-ed,
remat is applied (a budget is then one rank's: the plan is made on the sharded model, the same on every rank),
and AdamW trains a few steps while `remat.track()` counts the rank's live bytes.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import remat

D, HEADS, BLOCKS, SEQ, BATCH, VOCAB = 128, 4, 4, 64, 4, 512
MiB = 2**20


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(h.transpose(1, 2).reshape(b, s, D))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class LM(nn.Module):
    """Embedding, `BLOCKS` blocks, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def build(meta: bool) -> LM:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return LM()


def config_of(text: str) -> str | float:
    return text if text in ("none", "full") else float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="0.7", help="none, full, or a budget (a fraction or bytes)")
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    config = config_of(args.config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))

    # One rank's peak, before any process group exists: fake tensors, torch's fake process group.
    estimated = remat.estimate(build(meta=True), idx, optimizer="adamw", configs=(config,), world_size=world,
                               shard="fsdp2")[config].peak_bytes

    dist.init_process_group("gloo")
    model = build(args.meta)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if args.meta:
        model.to_empty(device="cpu")
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    # After fully_shard, a budget is per rank: the planner profiles this rank's sharded step. Every rank
    # profiles (the step's collectives need them all) and takes rank 0's plan.
    if isinstance(config, float):
        remat.apply(model, budget=config, sample=idx)
    elif config == "full":
        remat.apply(model)
    plan = " ".join(f"{site.name}={site.choice}" for site in remat.plan(model)) or "no sites"
    fitted = remat.plan(model).budget
    fit = ""  # this rank's own numbers: the choices are rank 0's, the bytes each rank's
    if fitted is not None:
        fit = f"budget {fitted.budget / MiB:.2f} MiB, planned {fitted.peak_bytes / MiB:.2f} MiB"
    optimizer = torch.optim.AdamW(model.parameters())
    # What lives before tracking starts: this rank's parameter shards and its batch.
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    before = sum(t.untyped_storage().nbytes() for t in shards) + idx.untyped_storage().nbytes()
    with remat.track() as tracker:
        for step in range(args.steps):
            with remat.track() as forward_backward:  # what the step itself adds, as the budget counts it
                loss = model(idx).sum()
                loss.backward()
                del loss
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0:
                print(f"step {step} done", flush=True)
    measured = before + tracker.peak_bytes
    if fitted is not None:
        fit = f" ({fit}, forward+backward took {forward_backward.peak_bytes / MiB:.2f} MiB)"
    for r in range(world):
        if r == rank:
            print(f"rank {rank}/{world} config {args.config}: estimated peak {estimated / MiB:.2f} MiB, "
                  f"measured {measured / MiB:.2f} MiB ({measured / estimated - 1:+.1%}); plan: {plan}{fit}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
