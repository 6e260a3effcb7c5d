"""The seven training workloads of the budget sweep, built from configs in float32 on CPU (no downloads).

Each is a `Workload`: a model in training mode, the sample one step trains on (what `remat.apply(...,
sample=...)` takes: a tensor or a dict of keyword arguments) and the loss from the model's output (None: the
output's `.loss`). The Hugging Face ones (tiny GPT-2, Llama with grouped-query attention, T5, BERT, ViT) need the
`hf` extra; the GPT-like stack and the convnet with BatchNorm are the benchmark's own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .convnets import CONVNET_SIZES, ConvNet
from .models import GPT, GPT_SIZES

__all__ = ["WORKLOADS", "Workload", "build"]

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
