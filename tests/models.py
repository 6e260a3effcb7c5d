"""Tiny float64 models the tests share: MLP, conv + BatchNorm, a transformer block, an LSTM-style cell."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, 2 * width)
        self.fc3 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(F.relu(self.fc1(x)))))


class ConvBN(nn.Module):
    """Conv -> BatchNorm -> ReLU, twice."""

    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class Attention(nn.Module):
    def __init__(self, width: int = 8, heads: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(h.transpose(1, 2).reshape(batch, length, width))


class TransformerBlock(nn.Module):
    """Pre-norm block: attention with dropout, then an MLP with dropout."""

    def __init__(self, width: int = 8, heads: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * width, width)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), mask=mask))
        return x + self.drop(self.mlp(self.norm2(x)))


class Stack(nn.Module):
    """`n` transformer blocks (width 16, two heads) in a ModuleList, run in order."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock(16, 2) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def stack(n: int) -> nn.Module:
    """A `Stack` of `n` blocks in float64, its weights drawn from seed 0."""
    torch.manual_seed(0)
    return Stack(n).double()


class Cell(nn.Module):
    """An LSTM-style cell: `(x, (h, c)) -> (h, (h, c))`, the activation and the tuple state."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.input = nn.Linear(width, 4 * width)
        self.hidden = nn.Linear(width, 4 * width, bias=False)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h, c = state
        i, f, g, o = (self.input(x) + self.hidden(h)).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, (h, c)


class Unrolled(nn.Module):
    """A cell run over a sequence, carrying its tuple state."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.cell = Cell(width)

    def forward(self, xs: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        outs = []
        for x in xs.unbind(0):
            h, state = self.cell(x, state)
            outs.append(h)
        return torch.stack(outs)


class TwoConv(nn.Module):
    """The PyTorch tutorial's model: two convolutions, the second one rematerialized by the tests."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.conv1(x))).relu()


def mlp() -> nn.Module:
    return MLP()


def conv_bn() -> nn.Module:
    return ConvBN()


def transformer() -> nn.Module:
    return TransformerBlock()


def unrolled() -> nn.Module:
    return Unrolled()
