"""The built-in models of ``python -m remat`` and ``python -m remat estimate``: a GPT-like stack and a ResNet-style
convnet (the only model code in the package; the benchmark in ``benchmarks/`` and the tests build on them).

Each model is a `BenchModel`: its repeated blocks live in ``blocks`` and are called through
``model.call(block, x)``, so that a benchmark configuration can rematerialize every block (by
replacing ``call``, or by changing the blocks of its own copy of the model) without touching the
model's code. ``sample`` makes a batch and ``loss`` runs a training step's forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ._sites.cross_entropy import linear_cross_entropy

__all__ = [
    "CONVNET_SIZES",
    "GPT",
    "GPT_SIZES",
    "BenchModel",
    "BlockCall",
    "Classifier",
    "ConvNet",
    "ConvNetConfig",
    "GPTConfig",
    "ImageConfig",
    "TransformerBlock",
    "call_directly",
    "human_count",
    "parameter_count",
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
    "medium": GPTConfig(),  # the larger size of the benchmark (`python -m benchmarks --size medium`)
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
        >>> from remat._demo import GPT, GPTConfig
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
        self.head_chunks = 0
        """When positive, `loss` computes the head and the loss with `remat.linear_cross_entropy` in this many chunks
        of tokens, never from the full logits."""

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
        if self.head_chunks:
            hidden = self.ln(self.run_blocks(self.embed(idx)))
            return linear_cross_entropy(hidden, self.head.weight, targets, chunks=self.head_chunks)
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def describe(self) -> str:
        c = self.config
        return f"{c.blocks} blocks, d={c.d}, {c.heads} heads, seq {c.seq}, batch {c.batch}"


# -- ResNet-style convnet ------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvNetConfig:
    """Size of the ResNet-style convnet: three stages of basic blocks, width doubling per stage."""

    width: int = 64
    blocks_per_stage: int = 3
    image: int = 64
    batch: int = 32
    classes: int = 10


CONVNET_SIZES = {
    "small": ConvNetConfig(width=16, blocks_per_stage=2, image=32, batch=16),
    "medium": ConvNetConfig(),
}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (a 1x1 projection on downsampling)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ImageConfig(Protocol):
    """What a `Classifier` reads of its size: the batch, the image's side and the number of classes."""

    @property
    def batch(self) -> int: ...

    @property
    def image(self) -> int: ...

    @property
    def classes(self) -> int: ...


class Classifier(BenchModel):
    """An image classifier: a batch is (images, labels), the loss their cross-entropy."""

    config: ImageConfig

    def sample(self, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        c = self.config
        images = torch.randn(c.batch, 3, c.image, c.image, generator=g).to(device)
        labels = torch.randint(0, c.classes, (c.batch,), generator=g).to(device)
        return images, labels

    def loss(self, *batch: torch.Tensor) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)


class ConvNet(Classifier):
    """A ResNet-style image classifier with BatchNorm (torchvision has no CPU build here).

    Example:
        >>> import torch
        >>> from remat._demo import ConvNet, ConvNetConfig
        >>> model = ConvNet(ConvNetConfig(width=4, blocks_per_stage=1, image=8, batch=2))
        >>> model.loss(*model.sample(torch.device("cpu"))).shape
        torch.Size([])
    """

    config: ConvNetConfig

    def __init__(self, config: ConvNetConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = w
        for stage in range(3):
            cout = w * 2**stage
            for i in range(config.blocks_per_stage):
                blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, config.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.run_blocks(self.embed(images))
        out: torch.Tensor = self.head(h.mean(dim=(2, 3)))
        return out

    def embed(self, *batch: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.stem(batch[0])
        return out

    def describe(self) -> str:
        c = self.config
        n = 3 * c.blocks_per_stage
        return f"{n} blocks, width {c.width}-{4 * c.width}, {c.image}x{c.image} images, batch {c.batch}"


# -- counting parameters -------------------------------------------------------------------------


def parameter_count(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def human_count(n: int) -> str:
    """``1234567`` as ``'1.2M'``."""
    if n < 1000:
        return str(n)
    exp = min(int(math.log10(n)) // 3, 3)
    return f"{n / 10 ** (3 * exp):.1f}{' KMG'[exp]}"
