"""Peak memory of one training step of Hugging Face models: no remat, `remat.apply(model)`, a budget of half of no
remat's activation peak, and transformers' own `model.activation_checkpointing_enable()`, measured in one run.

Run: `python -m benchmarks.hf` (needs the `hf` extra). Each model is built from a small config in float32 on
CPU, in training mode, with its default arguments (so `use_cache` is on), and trained one step on a padded batch.
Each configuration gets its own copy of the same weights. One warm-up step makes the gradients; they are zeroed
in place, and the next step runs under `remat.track`, so "peak" counts what the step adds: activations,
temporaries and the KV cache (see NOTE [ What the memory columns count ] in cli.py). Peaks are exact and
deterministic; for step times use `python -m benchmarks`.
"""

from __future__ import annotations

import copy
import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import remat

__all__ = ["main"]

VOCAB, SEQ, BATCH, LAYERS = 1000, 256, 4, 6


def _models() -> dict[str, Callable[[], nn.Module]]:
    hf: Any = importlib.import_module("transformers")

    def lora_llama() -> nn.Module:
        peft: Any = importlib.import_module("peft")
        config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        with warnings.catch_warnings():  # peft asks for transformers' deprecated `is_gradient_checkpointing`
            warnings.simplefilter("ignore", FutureWarning)
            return peft.get_peft_model(llama(), config)  # type: ignore[no-any-return]

    def llama() -> nn.Module:
        return hf.LlamaForCausalLM(hf.LlamaConfig(  # type: ignore[no-any-return]
            vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        ))

    return {
        "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(
            vocab_size=VOCAB, n_embd=256, n_layer=LAYERS, n_head=4, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
        )),
        "llama": llama,
        "t5": lambda: hf.T5ForConditionalGeneration(hf.T5Config(
            vocab_size=VOCAB, d_model=256, d_ff=1024, d_kv=64, num_heads=4, num_layers=LAYERS, decoder_start_token_id=0,
        )),
        "bert": lambda: hf.BertForMaskedLM(hf.BertConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=LAYERS, num_attention_heads=4,
            max_position_embeddings=SEQ,
        )),
        "lora-llama": lora_llama,
    }


def _batch(name: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, SEQ // 2:] = 0  # one padded row
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if name == "t5":
        batch["decoder_attention_mask"] = mask
    return batch


def _hf_checkpointing(model: nn.Module, batch: dict[str, torch.Tensor]) -> nn.Module:
    model.activation_checkpointing_enable()  # type: ignore[operator]
    return model


BUDGET = 0.5

CONFIGS: dict[str, Callable[[nn.Module, dict[str, torch.Tensor]], nn.Module]] = {
    "no remat": lambda model, batch: model,
    "remat.apply(model)": lambda model, batch: remat.apply(model),
    f"remat.apply(model, budget={BUDGET})": lambda model, batch: remat.apply(model, budget=BUDGET, sample=batch),
    "activation_checkpointing_enable()": _hf_checkpointing,
}


def _step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model(**batch).loss.backward()


def measure_model(name: str, make: Callable[[], nn.Module]) -> list[tuple[str, int]]:
    """(configuration, peak bytes) for each configuration of one model."""
    torch.manual_seed(0)
    base = make().train()
    batch = _batch(name)
    rows = []
    for label, configure in CONFIGS.items():
        model = configure(copy.deepcopy(base), batch)
        torch.manual_seed(1)
        _step(model, batch)  # warm-up; makes every .grad
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.zero_()
        with remat.track() as tracker:
            _step(model, batch)
        rows.append((label, tracker.peak_bytes))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Print one table: per model and configuration, the step's peak and its ratio to no remat."""
    names = list(argv if argv is not None else sys.argv[1:]) or list(_models())
    models = _models()
    print(f"one training step, float32, CPU, batch {BATCH} x seq {SEQ}, {LAYERS} layers, hidden 256, vocab {VOCAB}")
    print(f"{'model':11s} {'configuration':36s} {'peak MiB':>9s} {'vs none':>8s}")
    for name in names:
        rows = measure_model(name, models[name])
        none = rows[0][1]
        for label, peak in rows:
            print(f"{name:11s} {label:36s} {peak / 2**20:9.2f} {peak / none:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
