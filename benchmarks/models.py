"""Models for the benchmark (`python -m benchmarks`): the `BenchModel` base, a GPT-like stack, a tiny function; the
convnets are in `convnets.py`.

Each model is a `BenchModel`: its repeated blocks live in ``blocks`` and are called through
``model.call(block, x)``, so that a benchmark configuration can rematerialize every block (by
replacing ``call``, or by changing the blocks of its own copy of the model) without touching the
model's code. ``sample`` makes a batch and ``loss`` runs a training step's forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT_SIZES",
    "BenchModel",
    "BlockCall",
    "call_directly",
    "GPT",
    "GPTConfig",
    "tiny",
    "tiny_input",
]

BlockCall = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def call_directly(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Call a block as the model would without any rematerialization."""
    out: torch.Tensor = block(x)
    return out


class BenchModel(nn.Module):
    """A model whose repeated blocks a benchmark configuration can rematerialize.

    Attributes:
        blocks: The repeated blocks, run in order through ``call``.
        call: How a block is called; `call_directly` unless a configuration replaced it.
        stack: When set, a module that runs all the blocks at once instead (``remat.chain``).
    """

    blocks: nn.ModuleList

    def __init__(self) -> None:
        super().__init__()
        self.call: BlockCall = call_directly
        self.stack: nn.Module | None = None

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Run every block on ``x``: through ``stack`` if set, else one by one through ``call``."""
        if self.stack is not None:
            out: torch.Tensor = self.stack(x)
            return out
        for block in self.blocks:
            x = self.call(block, x)
        return x

    def sample(self, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Return one batch of inputs for `loss`, made from ``seed``."""
        raise NotImplementedError

    def embed(self, *batch: torch.Tensor) -> torch.Tensor:
        """Return what the first block receives for a batch from `sample`."""
        raise NotImplementedError

    def loss(self, *batch: torch.Tensor) -> torch.Tensor:
        """Return the scalar training loss of one batch."""
        raise NotImplementedError

    def describe(self) -> str:
        """Return a one-line description of the size."""
        raise NotImplementedError


# -- GPT-like stack ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    """Size of the GPT-like stack."""

    blocks: int = 12
    d: int = 512
    heads: int = 8
    seq: int = 256
    batch: int = 8
    vocab: int = 1024
    dropout: float = 0.1


GPT_SIZES = {
    "small": GPTConfig(blocks=12, d=128, heads=4, seq=128, batch=4),
    "medium": GPTConfig(),  # the larger size of the benchmark (--size medium)
}


class SelfAttention(nn.Module):
    """Causal multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, s, d))
        return out


class TransformerBlock(nn.Module):
    """A pre-LayerNorm transformer block: attention and a GELU MLP, each with residual dropout."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        out: torch.Tensor = x + self.drop(self.mlp(self.ln2(x)))
        return out


class GPT(BenchModel):
    """A GPT-like language model: embeddings, a stack of `TransformerBlock`, a linear head.

    Example:
        >>> import torch
        >>> from benchmarks.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(blocks=2, d=32, heads=2, seq=8, batch=2, vocab=50))
        >>> model.loss(*model.sample(torch.device("cpu"))).shape
        torch.Size([])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.d)
        self.positions = nn.Embedding(config.seq, config.d)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(config.d, config.heads, config.dropout) for _ in range(config.blocks)
        )
        self.ln = nn.LayerNorm(config.d)
        self.head = nn.Linear(config.d, config.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.ln(self.run_blocks(self.embed(idx))))
        return out

    def embed(self, *batch: torch.Tensor) -> torch.Tensor:
        idx = batch[0]
        pos = torch.arange(idx.shape[1], device=idx.device)
        out: torch.Tensor = self.drop(self.tokens(idx) + self.positions(pos))
        return out

    def sample(self, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        c = self.config
        idx = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g).to(device)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def loss(self, *batch: torch.Tensor) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def describe(self) -> str:
        c = self.config
        return f"{c.blocks} blocks, d={c.d}, {c.heads} heads, seq {c.seq}, batch {c.batch}"


def tiny(x: torch.Tensor) -> torch.Tensor:
    """Two cheap elementwise ops: what per-call overhead is measured on.

    Example:
        >>> import torch
        >>> from benchmarks.models import tiny
        >>> tiny(torch.zeros(2))
        tensor([0., 0.])
    """
    return (x * 2).sin()


def tiny_input(device: torch.device) -> torch.Tensor:
    """A small input for `tiny` that requires grad."""
    return torch.randn(16, device=device).requires_grad_()


def parameter_count(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def human_count(n: int) -> str:
    """``1234567`` as ``'1.2M'``."""
    if n < 1000:
        return str(n)
    exp = min(int(math.log10(n)) // 3, 3)
    return f"{n / 10 ** (3 * exp):.1f}{' KMG'[exp]}"
