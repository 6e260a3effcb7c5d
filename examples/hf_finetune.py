"""Fine-tune a small Hugging Face causal LM with `remat.apply(model)`: no layer class to name, default arguments.

The model is built from its config (nothing is downloaded). remat picks the decoder layers that transformers'
own gradient checkpointing would wrap, switches their KV cache off in training (one log line), and the loop is
an ordinary AdamW loop on a padded batch. `remat.measure(..., compare=True)` prints one step's memory with
remat on and off.

Run: `pip install -e '.[hf]'`, then `python examples/hf_finetune.py`.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import remat

VOCAB, LAYERS, HIDDEN, SEQ, BATCH = 256, 4, 64, 32, 4


def toy_batch() -> dict[str, torch.Tensor]:
    """Token ids with a right-padded row or two: attention_mask 0 and labels -100 on the padding."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    lengths = torch.tensor([SEQ, SEQ - 5, SEQ, SEQ // 2])
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config).train()
    remat.apply(model)  # no class named: the layers transformers' gradient checkpointing would wrap
    print(remat.plan(model))

    batch = toy_batch()

    def training_loss(**inputs: torch.Tensor) -> torch.Tensor:
        return model(**inputs).loss

    print(remat.measure(training_loss, compare=True, **batch))
    model.zero_grad(set_to_none=True)  # measure ran a backward through the parameters

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(3):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
