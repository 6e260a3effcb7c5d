"""Hugging Face models under torch.compile: `remat.apply(model)` with default arguments lowers every layer to
torch's checkpoint operator, so the compiled forward saves what transformers' own gradient checkpointing saves.

The baseline is the bytes the compiled forward saves for backward (the partitioner's forward graph outputs) with
`model.gradient_checkpointing_enable()`, and the gradients of eager code without checkpointing (float64).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import remat

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _configs() -> dict[str, Any]:
    return {
        "gpt2": transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "llama": transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
    }


def _nbytes(value: torch.Tensor) -> int:
    """A saved value's bytes; a size that is a symbol (Llama's rotary tables) counts at its traced value."""
    numel = 1
    for size in value.shape:
        numel *= size if isinstance(size, int) else int(size.node.hint)
    return numel * value.element_size()


def _loss(out: Any) -> torch.Tensor:
    """The logits' mean square (transformers' own loss logs once per process, which breaks a graph)."""
    return out.logits.square().mean()  # type: ignore[no-any-return]


class _Checkpointed(nn.Module):
    """A layer under `torch.utils.checkpoint`, by hand."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self.layer, *args, use_reentrant=False, **kwargs)


def _layers(model: nn.Module) -> nn.ModuleList:
    inner = model.transformer if hasattr(model, "transformer") else model.model
    return inner.h if hasattr(inner, "h") else inner.layers  # type: ignore[no-any-return]


def _compiled_step(model: nn.Module, ids: torch.Tensor, **kwargs: Any) -> int:
    """Run one compiled training step as one graph; return the bytes that graph saves for backward."""
    saved: list[int] = []

    def partition(joint: Any, inputs: Any, **kwargs: Any) -> Any:
        forward, backward = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        outputs = next(node for node in forward.graph.nodes if node.op == "output").args[0]
        values = [node.meta.get("val") for node in outputs[kwargs["num_fwd_outputs"]:]]
        saved.append(sum(_nbytes(v) for v in values if isinstance(v, torch.Tensor)))
        return forward, backward

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda graph, _: graph, partition_fn=partition)
    _loss(torch.compile(model, backend=backend, dynamic=False)(input_ids=ids, **kwargs)).backward()
    torch._dynamo.reset()
    assert len(saved) == 1, f"{len(saved)} graphs: the model did not compile as one"
    return saved[0]


@pytest.mark.slow  # inductor on Hugging Face models: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.equivalence
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_apply_under_compile_saves_what_torch_checkpoint_per_layer_saves(name: str) -> None:
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_configs()[name]).double().train()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    eager = copy.deepcopy(base)
    _loss(eager(input_ids=ids)).backward()

    none = _compiled_step(copy.deepcopy(base), ids, use_cache=False)
    by_hand = copy.deepcopy(base)
    layers = _layers(by_hand)
    for i, layer in enumerate(layers):
        layers[i] = _Checkpointed(layer)
    expected = _compiled_step(by_hand, ids, use_cache=False)
    assert expected < none

    ours = remat.apply(copy.deepcopy(base))
    got = _compiled_step(ours, ids)  # default arguments: transformers makes a cache, remat switches it off
    assert abs(got - expected) <= 0.1 * expected, (got, expected, none)
    for (label, p), q in zip(eager.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=label)
