"""Convnets for the benchmark (`python -m benchmarks`): a ResNet-style convnet, and a plain convnet chain for
`remat.chain`. Both are `BenchModel`s (see `models.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .models import BenchModel

__all__ = ["CHAIN_SIZES", "CONVNET_SIZES", "ChainNet", "ChainNetConfig", "ConvNet", "ConvNetConfig"]


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


class _Classifier(BenchModel):
    """An image classifier: a batch is (images, labels), the loss their cross-entropy."""

    config: ConvNetConfig | ChainNetConfig

    def sample(self, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        c = self.config
        images = torch.randn(c.batch, 3, c.image, c.image, generator=g).to(device)
        labels = torch.randint(0, c.classes, (c.batch,), generator=g).to(device)
        return images, labels

    def loss(self, *batch: torch.Tensor) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)


class ConvNet(_Classifier):
    """A ResNet-style image classifier with BatchNorm (torchvision has no CPU build here).

    Example:
        >>> import torch
        >>> from benchmarks.convnets import ConvNet, ConvNetConfig
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


# -- a heterogeneous convnet chain (remat.chain) ------------------------------------------


@dataclass(frozen=True)
class ChainNetConfig:
    """Size of the plain convnet chain: a stem, then levels of conv/BN/ReLU stages, then a pooled head.

    ``levels[j]`` stages run at resolution ``image / 2**j`` with ``width * 2**j`` channels (the
    first of each level after the first downsamples), so stages differ in time and in memory:
    each level's activations are half the size of the previous level's.
    """

    width: int = 16
    levels: tuple[int, ...] = (4, 3, 3, 2)
    image: int = 64
    batch: int = 16
    classes: int = 10


CHAIN_SIZES = {
    "small": ChainNetConfig(),
    "medium": ChainNetConfig(width=32, levels=(5, 4, 3, 3), image=128, batch=32),
}


def conv_stage(cin: int, cout: int, stride: int) -> nn.Sequential:
    """A 3x3 convolution, BatchNorm and ReLU: one stage of `ChainNet`."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class PoolHead(nn.Module):
    """Global average pooling and a linear classifier: the last stage of `ChainNet`."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x.mean(dim=(2, 3)))
        return out


class ChainNet(_Classifier):
    """A residual-free convnet whose every layer is a stage in ``blocks`` (stem, conv stages, head).

    The blocks form a chain of single-tensor stages of different widths and resolutions: what
    `remat.chain` and `checkpoint_sequential` take. ``embed`` is the identity: the chain's input
    is the batch of images itself.

    Example:
        >>> import torch
        >>> from benchmarks.convnets import ChainNet, ChainNetConfig
        >>> model = ChainNet(ChainNetConfig(width=4, levels=(2, 1), image=8, batch=2))
        >>> len(model.blocks), model.loss(*model.sample(torch.device("cpu"))).shape
        (5, torch.Size([]))
    """

    config: ChainNetConfig

    def __init__(self, config: ChainNetConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        blocks: list[nn.Module] = [conv_stage(3, w, 1)]
        cin = w
        for level, count in enumerate(config.levels):
            cout = w * 2**level
            for i in range(count):
                blocks.append(conv_stage(cin, cout, 2 if level > 0 and i == 0 else 1))
                cin = cout
        blocks.append(PoolHead(cin, config.classes))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.run_blocks(self.embed(images))

    def embed(self, *batch: torch.Tensor) -> torch.Tensor:
        return batch[0]

    def describe(self) -> str:
        c = self.config
        widths = "-".join(str(c.width * 2**j) for j in range(len(c.levels)))
        return (
            f"{len(self.blocks)} stages (stem, conv/BN/ReLU levels of {list(c.levels)} stages, "
            f"widths {widths}, pooled head), {c.image}x{c.image} images, batch {c.batch}"
        )


# -- the tiny function of the overhead rows ----------------------------------------------------------------
