"""Offload as a choice of budgets and memory plans (NOTE [ Offload as a choice ] in remat/_budget/offload_choice.py), on
the device written in Python (tests/pydevice.py), where host memory is not the device's: at a sequence that full remat
with the head in chunks and tiles cannot fit in M, `remat.apply(model, memory=M)` plans with per-block offload too, and
its first three real AdamW steps stay within M; `offload=True` with a budget offloads every block the plan
rematerializes and keeps no remat's gradients; on the CPU the choice is closed. Needs the `hf` extra.
"""

from __future__ import annotations

from typing import Any

import pydevice
import pytest
import torch
from conftest import assert_same_on_device
from torch import nn

import remat
from remat._budget.choices import Choices
from remat._budget.offload_choice import OffloadChoice
from remat._budget.regimes import regime_for
from remat._core.requests import request_for
from remat._engine import transfer as _transfer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("test_device")

D0 = "remat_test:0"
EQUIVALENCE_HELPERS = ("assert_same_on_device(",)


def llama(seq: int, width: int, layers: int, vocab: int) -> nn.Module:
    """benchmarks/long.py's proportions: MLP 3.5 times the width, 4 heads over 2 KV heads; attention fused as on a GPU
    (its memory per token), no cache (a training loop's; the fake twin of a model on this device cannot make one)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=width, intermediate_size=7 * width // 2, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=seq, attention_dropout=0.0, use_cache=False,
        attn_implementation=pydevice.fused_attention(),
    )
    return transformers.LlamaForCausalLM(config).train().to(D0)


def tokens(seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1)).to(D0)


def choices_of(model: nn.Module) -> list[str]:
    return [site.choice for site in remat.plan(model).sites]


def test_the_choice_is_open_on_an_accelerator_in_eager_code_only_and_offload_true_is_taken_before_planning() -> None:
    request = request_for(budget=0.5, sample=torch.zeros(1))
    for devices, offload, expected in (([torch.device("cpu")], None, False), ([torch.device(D0)], None, True),
                                       ([torch.device(D0)], False, False), ([torch.device(D0)], True, False)):
        choices = Choices(("0",), regime_for(request))
        choice = OffloadChoice(choices, devices, offload)
        assert choice.open is expected, (devices, offload)
        assert (choices.offload is not None) is (offload is True)
    compiled = OffloadChoice(Choices(("0",), regime_for(request)), [torch.device(D0)], None, compiled=True)
    assert not compiled.open  # nothing is offloaded inside one compiled graph
    assert request_for(every=2).options(None).offload is False  # one policy: no offload unless asked


class Loss(nn.Module):
    """A small Llama's own loss, in float64."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama(64, 32, 3, 96).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
        return loss


def test_a_budget_with_offload_true_offloads_every_rematerialized_block_and_keeps_no_remats_gradients() -> None:
    ids = tokens(64, 96)
    before = _transfer.traffic()

    def variant(target: Loss) -> Loss:
        remat.apply(target.model, budget=0.7, sample={"input_ids": ids, "labels": ids}, offload=True)
        chosen = choices_of(target.model)
        assert chosen and all(choice.endswith(" + offload") for choice in chosen), chosen
        assert "full + offload" in str(remat.plan(target.model)) and "on the host" in str(remat.plan(target.model))
        return target

    assert_same_on_device(Loss, (ids,), variant)
    assert _transfer.traffic().out_bytes > before.out_bytes, "what the blocks keep went to the host"


@pytest.mark.slow  # plans and measures real training steps for a minute: NOTE [ Slow tests ] in tests/conftest.py
def test_memory_that_only_offload_fits_is_planned_with_it_and_its_first_three_steps_stay_within_it() -> None:
    """The issue's done-when on the Python device: full remat with the head in chunks and tiles does not fit in M (the
    estimate says so, and `offload=False` is refused); `apply(memory=M)` plans with the head, tiles and per-block
    offload, and three real AdamW steps (optimizer state made in the first, gradients set to None between) allocate
    and reserve no more than M on the device, as its allocator counts them."""
    seq, vocab = 8192, 2000

    def make() -> nn.Module:
        return llama(seq, 128, 8, vocab)

    def batch() -> dict[str, Any]:
        ids = tokens(seq, vocab)
        return {"input_ids": ids, "labels": ids}

    configs = ("full+head+tiles", "full+head+tiles+offload")
    report = remat.estimate(make(), batch(), optimizer="adamw", configs=configs)
    tiled, offloaded = (report[config].peak_bytes for config in configs)
    assert offloaded < 0.85 * tiled
    memory = int((offloaded + 0.85 * (tiled - offloaded)) / 0.9)  # a tenth is the allocator's: NOTE [ The allocator's
    assert 0.9 * memory < tiled  # reserve ]
    with pytest.raises(remat.BudgetError):  # without offload, nothing fits
        remat.apply(make(), memory=memory, sample=batch(), optimizer="adamw", offload=False)
    model, inputs = make(), batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    remat.apply(model, memory=memory, sample=inputs, optimizer=optimizer)
    assert choices_of(model) == ["full + offload"] * 8
    plan = remat.plan(model)
    assert "chosen by the budget" in str(plan) and len(plan.tiles) == 3 * 8
    pydevice.DEVICE.reset_peak_memory_stats(0)
    sent = _transfer.traffic().out_bytes
    for _ in range(3):
        optimizer.zero_grad()
        model(**inputs).loss.backward()
        optimizer.step()
    assert _transfer.traffic().out_bytes - sent >= 3 * 6 * seq * 128 * 4  # the block inputs crossed, every step
    assert pydevice.DEVICE.max_memory_allocated(0) <= memory
    assert pydevice.DEVICE.max_memory_reserved(0) <= memory
    del model, optimizer, inputs


def test_an_estimates_budget_row_takes_offload_as_apply_does_and_counts_it_on_fake_tensors() -> None:
    """A budget between what head + tiles and what per-block offload too need: the estimate's budget row plans as
    `remat.apply` does and takes offload, whose fake step counts it through `HostOffload` (NOTE [ Offload as a
    choice ], rule 2): its step peak is offload's, not the blocks' without it."""
    seq, vocab = 4096, 2000
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=448, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=seq, use_cache=False, attn_implementation=pydevice.fused_attention(),
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, vocab, (1, seq))
    sample = {"input_ids": ids, "labels": ids}
    configs = ("full+head+tiles", "full+head+tiles+offload")
    report = remat.estimate(model, sample, configs=configs, device=D0)
    tiled, offloaded = (report[config].step_peak_bytes for config in configs)
    assert offloaded < 0.8 * tiled
    budget = (tiled + offloaded) // 2
    row = remat.estimate(model, sample, configs=(budget,), device=D0)[budget]
    assert row.step_peak_bytes == offloaded


@pytest.mark.slow  # plans and measures real training steps: NOTE [ Slow tests ] in tests/conftest.py
def test_memory_with_offload_true_is_sized_with_it() -> None:
    """`offload=True` with `memory=`: the least estimate that decides whether anything fits counts what the blocks
    keep on the host, so a memory that only offload fits is planned, not refused (and every rematerialized block
    offloads)."""
    seq, vocab = 8192, 2000
    ids = tokens(seq, vocab)
    sample = {"input_ids": ids, "labels": ids}
    configs = ("full+head+tiles", "full+head+tiles+offload")
    report = remat.estimate(llama(seq, 128, 8, vocab), sample, optimizer="adamw", configs=configs)
    tiled, offloaded = (report[config].peak_bytes for config in configs)
    memory = int((offloaded + 0.85 * (tiled - offloaded)) / 0.9)
    model = remat.apply(llama(seq, 128, 8, vocab), memory=memory, sample=sample, optimizer="adamw", head=True,
                        tiles=True, offload=True)
    assert choices_of(model) == ["full + offload"] * 8
    del model


@pytest.mark.slow  # plans three times on real steps: NOTE [ Slow tests ] in tests/conftest.py
def test_a_replan_that_fails_puts_back_the_offload_the_previous_plan_chose() -> None:
    """NOTE [ Budgeted models ], rule 4: a training forward with a longer sequence plans again; where that plan is
    refused, the previous choices go back on the blocks with the offload the previous plan chose."""

    def least(offload: bool) -> int:
        with pytest.raises(remat.BudgetError) as refused:
            remat.apply(Long().model, budget=1, sample=Long.sample(), offload=offload)
        assert refused.value.least_bytes is not None
        return refused.value.least_bytes

    offloaded, kept_on_device = least(True), least(False)
    assert offloaded < kept_on_device
    model = Long()
    remat.apply(model.model, budget=(offloaded + kept_on_device) // 2, sample=Long.sample())
    before = choices_of(model.model)
    assert before == ["full + offload"] * Long.LAYERS
    with pytest.raises(remat.BudgetError):
        model(tokens(4 * Long.SEQ, 96))
    assert choices_of(model.model) == before


class Long(nn.Module):
    """A small Llama at a sequence where the blocks' inputs weigh: only offload fits between the two least budgets."""

    SEQ, LAYERS = 512, 6

    def __init__(self) -> None:
        super().__init__()
        self.model = llama(4 * self.SEQ, 32, self.LAYERS, 96).double()

    @classmethod
    def sample(cls) -> dict[str, torch.Tensor]:
        ids = tokens(cls.SEQ, 96)
        return {"input_ids": ids, "labels": ids}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
        return loss
