"""`remat.estimate` on transformers models and repeated inputs: exact against real tracked steps."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import remat
from benchmarks.estimate import check
from remat._estimate_cli import Case, hf_case


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
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


# -- the step a default loop runs: the output let go of once the loss is made ----------------------------


def _gpt2() -> tuple[torch.nn.Module, dict[str, Any]]:
    """Tiny GPT-2 whose logits are a large part of the step, as a language model's are."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=2048, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    return transformers.GPT2LMHeadModel(config).train(), {"input_ids": ids, "labels": ids, "use_cache": False}


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _default_loop_peak(config: Any, keep_output: bool = False) -> int:
    """A user's warm AdamW step, `loss = model(**batch).loss` (or the output kept through backward), tracked."""
    model, batch = _gpt2()
    if config == "full":
        remat.apply(model, policy=None)
    elif config == "save_matmuls":
        remat.apply(model, policy=remat.policies.save_matmuls)
    elif config != "none":
        remat.apply(model, budget=config, sample=batch)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # makes the optimizer's state, as in a run's second step
    opt.zero_grad()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    base = _bytes([*model.parameters(), *model.buffers(), batch["input_ids"], *state])
    with remat.enabled(config != "none"), remat.track() as t:
        if keep_output:
            out = model(**batch)
            loss = out.loss
            loss.backward()
            del out
        else:
            loss = model(**batch).loss
            loss.backward()
        del loss
        opt.step()
        opt.zero_grad()
    return base + t.peak_bytes


@pytest.mark.slow  # a GPT-2 training loop, real and estimated: NOTE [ Slow tests ] in tests/conftest.py
def test_gpt2_estimate_matches_a_default_training_loop() -> None:
    """Every configuration within 5% of `loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()`;
    a loop that keeps the output through backward peaks higher by the row's `output_bytes`, at most."""
    pytest.importorskip("transformers")
    configs = ("none", "full", "save_matmuls", 0.7)
    model, batch = _gpt2()
    report = remat.estimate(model, batch, optimizer="adamw", configs=configs)
    measured = {config: _default_loop_peak(config) for config in configs}
    for config in configs:
        ratio = report[config].peak_bytes / measured[config]
        assert abs(ratio - 1) < 0.05, (config, ratio)
    assert measured["full"] < measured["save_matmuls"] < measured["none"]  # remat was active
    assert report["full"].peak_bytes < report["none"].peak_bytes
    logits = 2 * 64 * 2048 * 4
    assert report["full"].output_bytes == logits
    kept = _default_loop_peak("full", keep_output=True)
    assert report["full"].peak_bytes < kept <= report["full"].peak_bytes + report["full"].output_bytes
    assert "a loop that keeps it through backward peaks up to 1.00 MiB higher" in str(report)


@pytest.mark.parametrize("padded", [False, True])
def test_an_attention_mask_in_the_sample_is_made_as_a_real_step_makes_it(padded: bool) -> None:
    """A tokenizer's batch carries `attention_mask`. With no padding a real step skips the causal mask (SDPA's
    `is_causal`); transformers cannot tell that from a fake mask and made a sequence x sequence one, which the
    estimate counted (29% over a real step here). With padding both make it (NOTE [ transformers and fake tensors ]
    in remat/_measure/hf_fake.py)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                      max_position_embeddings=1024, attn_implementation="sdpa")
    ids = torch.randint(0, 500, (2, 512), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :100] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    torch.manual_seed(0)
    report = remat.estimate(transformers.LlamaForCausalLM(config), batch, configs=("none", "full"))
    for name in ("none", "full"):
        with remat.track() as tracked:  # the model made inside: the row's peak counts the parameters
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config)
            if name == "full":
                remat.apply(model)
            model(**batch).loss.backward()
            del model
        assert abs(report[name].peak_bytes / tracked.peak_bytes - 1) < 0.01, (name, report[name].peak_bytes,
                                                                             tracked.peak_bytes)
    assert report["full"].peak_bytes < report["none"].peak_bytes


def test_a_budget_on_a_batch_with_an_attention_mask_is_its_fraction_of_a_real_step() -> None:
    """`budget=0.5` on a tokenizer's batch (an `attention_mask`, no padding) plans half of a real step's peak, and the
    step meets it: the budget's profile on fake tensors made no causal mask that the real step skips (it had planned
    for 70% of the real peak: NOTE [ transformers and fake tensors ] in remat/_measure/hf_fake.py)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                      max_position_embeddings=2048, attn_implementation="sdpa")
    ids = torch.randint(0, 500, (2, 1024), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def peak(model: torch.nn.Module) -> int:
        with remat.track() as tracked:
            model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        return tracked.peak_bytes

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    plain = peak(model)
    remat.apply(model, budget=0.5, sample=batch)
    assignment = remat.plan(model).budget
    assert assignment is not None and assignment.no_remat is not None
    assert abs(assignment.no_remat[0] / plain - 1) < 0.01, (assignment.no_remat[0], plain)
    assert peak(model) <= 1.05 * assignment.budget <= 1.05 * 0.5 * plain


def test_an_encoders_bidirectional_mask_is_made_as_a_real_step_makes_it() -> None:
    """Megatron-BERT run as a language model without `is_decoder` masks bidirectionally: with no padding a real step
    makes no mask, eager attention too; the estimate made one, sequence x sequence (NOTE [ transformers and fake
    tensors ], rule 2)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MegatronBertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, vocab_size=500, max_position_embeddings=1024,
                                             attn_implementation="eager")
    ids = torch.randint(0, 500, (1, 1024), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)
    model = transformers.MegatronBertForCausalLM(config)
    row = remat.estimate(model, batch, configs=("full",))["full"]
    state = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers(), ids])
    remat.apply(model)
    with remat.track() as tracked:
        model(**batch).loss.backward()
    assert abs(row.peak_bytes / (state + tracked.peak_bytes) - 1) < 0.01, (row.peak_bytes, state + tracked.peak_bytes)
