"""Models the tests share: tiny float64 ones (MLP, conv + BatchNorm, a transformer block, an LSTM-style cell), the
convnet chain of `remat.chain`'s benchmark rows, and the seven workloads of the budget sweep (the benchmark in
`benchmarks/` imports the last two from here). The GPT-like stack and the ResNet-style convnet are remat's built-in
models, in remat/_demo.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._demo import CONVNET_SIZES, GPT, GPT_SIZES, Classifier, ConvNet


class MLP(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, 2 * width)
        self.fc3 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc3(torch.tanh(self.fc2(F.relu(self.fc1(x)))))
        return out


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
        out: torch.Tensor = self.out(h.transpose(1, 2).reshape(batch, length, width))
        return out


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
        out: torch.Tensor = x + self.drop(self.mlp(self.norm2(x)))
        return out


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
        out: torch.Tensor = self.conv2(F.relu(self.conv1(x))).relu()
        return out


def mlp() -> nn.Module:
    return MLP()


def conv_bn() -> nn.Module:
    return ConvBN()


def transformer() -> nn.Module:
    return TransformerBlock()


def unrolled() -> nn.Module:
    return Unrolled()


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


class ChainNet(Classifier):
    """A residual-free convnet whose every layer is a stage in ``blocks`` (stem, conv stages, head).

    The blocks form a chain of single-tensor stages of different widths and resolutions: what
    `remat.chain` and `checkpoint_sequential` take. ``embed`` is the identity: the chain's input
    is the batch of images itself.

    Example:
        >>> import torch
        >>> from tests.models import ChainNet, ChainNetConfig
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


# -- the workloads of the budget sweep ------------------------------------------------------------
# Seven training workloads, built from configs in float32 on CPU (no downloads). Each is a `Workload`: a model in
# training mode, the sample one step trains on (what `remat.apply(..., sample=...)` takes: a tensor or a dict of
# keyword arguments) and the loss from the model's output (None: the output's `.loss`). The Hugging Face ones (tiny
# GPT-2, Llama with grouped-query attention, T5, BERT, ViT) need the `hf` extra; the GPT-like stack and the convnet
# with BatchNorm are remat's built-in models.

VOCAB, SEQ, BATCH, LAYERS, HIDDEN = 512, 128, 4, 4, 128
CACHE = False


@dataclass
class Workload:
    """A model, the sample of one step, and its loss (None: the output's `.loss`)."""

    model: nn.Module
    sample: Any
    loss: Callable[[Any], torch.Tensor] | None

    def step(self) -> torch.Tensor:
        """One forward and the loss on the sample."""
        out = self.model(**self.sample) if isinstance(self.sample, dict) else self.model(self.sample)
        return self.loss(out) if self.loss is not None else out.loss


def _tokens(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, SEQ // 2 :] = 0  # one padded row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _gpt_like() -> Workload:
    model = GPT(GPT_SIZES["small"])
    idx, target = model.sample(torch.device("cpu"), seed=0)
    return Workload(model, idx, lambda logits: F.cross_entropy(logits.flatten(0, 1), target.flatten()))


def _convnet() -> Workload:
    model = ConvNet(CONVNET_SIZES["small"])
    images, target = model.sample(torch.device("cpu"), seed=0)
    return Workload(model, images, lambda logits: F.cross_entropy(logits, target))


def _hf(name: str) -> Workload:
    hf: Any = importlib.import_module("transformers")
    sample: dict[str, torch.Tensor] = _tokens()
    if name == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN * 2, n_layer=LAYERS, n_head=4, n_positions=SEQ, bos_token_id=0,
            eos_token_id=0,
        ))
    elif name == "llama":
        model = hf.LlamaForCausalLM(hf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=344, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        ))
    elif name == "t5":
        model = hf.T5ForConditionalGeneration(hf.T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_ff=512, d_kv=32, num_heads=4, num_layers=LAYERS,
            decoder_start_token_id=0,
        ))
        sample["decoder_attention_mask"] = sample["attention_mask"]
    elif name == "bert":
        model = hf.BertForMaskedLM(hf.BertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
            num_attention_heads=4, max_position_embeddings=SEQ,
        ))
    elif name == "vit":
        model = hf.ViTForImageClassification(hf.ViTConfig(
            image_size=64, patch_size=8, hidden_size=HIDDEN * 2, intermediate_size=HIDDEN * 8, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_labels=10,
        ))
        generator = torch.Generator().manual_seed(0)
        sample = {"pixel_values": torch.randn(BATCH * 4, 3, 64, 64, generator=generator),
                  "labels": torch.randint(0, 10, (BATCH * 4,), generator=generator)}
    else:  # pragma: no cover
        raise ValueError(f"remat: no workload {name!r}")
    model.config.use_cache = CACHE
    return Workload(model, sample, None)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "gpt-like": _gpt_like,
    "gpt2": lambda: _hf("gpt2"),
    "llama": lambda: _hf("llama"),
    "t5": lambda: _hf("t5"),
    "bert": lambda: _hf("bert"),
    "vit": lambda: _hf("vit"),
    "convnet": _convnet,
}


def build(name: str, seed: int = 1234) -> Workload:
    """Workload `name` (a key of `WORKLOADS`) in training mode, its weights drawn with `seed`."""
    torch.manual_seed(seed)
    workload = WORKLOADS[name]()
    workload.model.train()
    return workload


def tracked_peak(work: Workload) -> int:
    """The tracked peak of one step of `work` (forward, loss, backward), the gradients backward makes counted."""
    for p in work.model.parameters():
        p.grad = None  # as `optimizer.zero_grad()` leaves them: backward's new gradients count
    torch.manual_seed(0)
    with remat.track() as tracker:
        loss = work.step()
        torch.autograd.backward(loss)
        del loss
    return tracker.peak_bytes
