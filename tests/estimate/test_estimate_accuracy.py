"""`remat.estimate` on transformers models and repeated inputs: exact against real tracked steps."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import remat
from benchmarks.estimate import check
from remat._estimate_cli import Case, hf_case


@pytest.mark.parametrize(("kind", "kv_heads"), [("gpt2", None), ("llama", 4), ("llama", 2)])
def test_transformers_activations_match_a_real_step(kind: str, kv_heads: int | None) -> None:
    """No causal mask or expanded keys/values that a real step does not hold (GQA with 2 key/value heads)."""
    pytest.importorskip("transformers")

    def build() -> Case:
        case = hf_case(kind, tiny=True, seq=32, batch=2, device="cpu")
        if kv_heads is not None:
            import transformers

            config: Any = case.model.config
            config.num_key_value_heads = kv_heads
            torch.manual_seed(0)
            case.model = transformers.LlamaForCausalLM(config).train()
        return case

    for row in check(build(), build, configs=("none", "full"), optimizer="sgd"):
        assert row.predicted.activation_bytes == row.measured.activation_bytes, row.config
        assert abs(row.peak_ratio - 1) < 0.01, (row.config, row.peak_ratio)
    masking = sys.modules["transformers.masking_utils"]
    assert masking.find_packed_sequence_indices.__name__ == "find_packed_sequence_indices"  # put back


def test_a_tensor_passed_twice_counts_once() -> None:
    model = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.sum()

    once = remat.estimate(model, {"input": x}, loss=loss, configs=("none",))["none"]

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.inner(a) + 0 * b.sum()
            return out

    twice = remat.estimate(Twice(), (x, x), loss=loss, configs=("none",))["none"]
    assert once.input_bytes == twice.input_bytes == x.untyped_storage().nbytes()
    other = remat.estimate(Twice(), (x, x.clone()), loss=loss, configs=("none",))["none"]
    assert other.input_bytes == 2 * x.untyped_storage().nbytes()
