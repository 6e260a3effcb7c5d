"""Tiles as a choice of budgets and memory plans (NOTE [ Tiles as a choice ] in remat/_budget/tiles_choice.py): at a
sequence that full remat with the head in chunks cannot fit, `remat.apply(model, memory=M)` plans with the decoder
layers' MLPs and norms in tiles, and its first real AdamW steps stay within M; a plan that fits without tiles takes
none. The model is a Llama-shaped stand-in (benchmarks/long.py's proportions, scaled down). Needs the `hf` extra.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._apply import memory as _memory
from remat._budget.tiles_choice import TilesChoice
from remat._core.requests import request_for
from remat._engine import stats as _stats

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, WIDTH, LAYERS = 500, 1024, 32, 2


def make(dtype: torch.dtype = torch.float32) -> nn.Module:
    """benchmarks/long.py's model scaled down: MLP 3.5 times the width, 4 heads over 2 KV heads."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=WIDTH, intermediate_size=7 * WIDTH // 2, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0.0,
    )
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def peaks(model: nn.Module) -> dict[str, int]:
    report = remat.estimate(copy.deepcopy(model), batch(), optimizer="adamw", configs=("full+head", "full+head+tiles"))
    return {config: report[config].peak_bytes for config in ("full+head", "full+head+tiles")}


def state_bytes(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """What lives on the device before `remat.apply` runs: parameters, buffers and the sample."""
    tensors = [*model.parameters(), *model.buffers(), *inputs.values()]
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def tiles_of(model: nn.Module) -> list[tuple[str, int, str | None]]:
    return [(t.name, t.tiles, t.chosen_by) for t in remat.plan(model).tiles]


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_memory_that_only_tiles_fit_is_planned_with_tiles_and_its_first_three_steps_stay_within_it() -> None:
    """The issue's done-when on the CPU: full remat with the head in chunks does not fit in M (the estimate says so);
    `apply(memory=M)` plans with tiles, and apply itself and three real AdamW steps (optimizer state made in the
    first, gradients set to None between) allocate no more than M leaves beside what was there before (the
    parameters, buffers and sample: as a device of size M would count them)."""
    base = make()
    estimated = peaks(base)
    assert estimated["full+head+tiles"] < 0.9 * estimated["full+head"]
    memory = (estimated["full+head+tiles"] + estimated["full+head"]) // 2
    with pytest.raises(remat.BudgetError):  # without tiles, nothing fits
        remat.apply(copy.deepcopy(base), memory=memory, sample=batch(), optimizer="adamw", tiles=False)
    model, inputs = copy.deepcopy(base), batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tiles = _stats.tiles
    with remat.track(limit=memory - state_bytes(model, inputs)) as tracked:
        remat.apply(model, memory=memory, sample=inputs, optimizer=optimizer)
        for _ in range(3):
            optimizer.zero_grad()
            model(**inputs).loss.backward()
            optimizer.step()
    assert tracked.peak_bytes <= memory - state_bytes(model, inputs)
    assert _stats.tiles - tiles >= 3 * LAYERS * 8  # the steps ran the MLPs in tiles
    plan = remat.plan(model)
    assert tiles_of(model) == [(f"model.layers.{i}.{name}", 8, "the budget") for i in range(LAYERS)
                               for name in ("mlp", "input_layernorm", "post_attention_layernorm")]
    assert "in 8 tiles, chosen by the budget" in str(plan) and "head: lm_head" in str(plan)


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_plan_that_fits_without_tiles_takes_none() -> None:
    base = make()
    memory = int(1.1 * peaks(base)["full+head"])
    model = remat.apply(copy.deepcopy(base), memory=memory, sample=batch(), optimizer="adamw")
    assert remat.plan(model).budget is not None and not remat.plan(model).tiles
    model = remat.apply(copy.deepcopy(base), budget=0.99, sample=batch())
    assert not remat.plan(model).tiles


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.equivalence
def test_the_plan_with_tiles_keeps_no_remats_gradients_and_a_replan_chooses_again() -> None:
    base = make(torch.float64)
    batch_ = batch()
    expected_model = copy.deepcopy(base)
    logits = expected_model(input_ids=batch_["input_ids"]).logits
    F.cross_entropy(logits[:, :-1].flatten(0, 1), batch_["labels"][:, 1:].flatten()).backward()
    estimated = peaks(base)
    memory = (estimated["full+head+tiles"] + estimated["full+head"]) // 2
    model = remat.apply(copy.deepcopy(base), memory=memory, sample=batch_, optimizer="adamw")
    assert {chosen for _, _, chosen in tiles_of(model)} == {"the budget"}
    tiles = _stats.tiles
    model(**batch_).loss.backward()
    assert _stats.tiles > tiles
    for (name, p), expected in zip(model.named_parameters(), expected_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, expected.grad, msg=lambda m, k=name: f"gradient of {k}: {m}")
    remat.apply(model, memory=4 * memory, sample=batch_, optimizer="adamw")  # room enough: the tiles go
    assert not tiles_of(model)


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_tiles_the_user_gives_are_planned_with_and_stay_the_users() -> None:
    base = make()
    estimated = peaks(base)
    memory = (estimated["full+head+tiles"] + estimated["full+head"]) // 2
    model = remat.apply(copy.deepcopy(base), memory=memory, sample=batch(), optimizer="adamw", head=True, tiles=8)
    assert {(count, chosen) for _, count, chosen in tiles_of(model)} == {(8, None)}
    remat.apply(model, memory=4 * memory, sample=batch(), optimizer="adamw")  # a re-plan leaves the user's tiles
    assert len(tiles_of(model)) == 3 * LAYERS
    model = copy.deepcopy(base)
    remat.tiled(model.model.layers[0].mlp, tiles=4)  # the user's own, before a plan that chooses tiles
    remat.apply(model, memory=memory, sample=batch(), optimizer="adamw")
    assert ("model.layers.0.mlp", 4, None) in tiles_of(model)  # was taken over: 8 tiles, chosen by the budget
    assert ("model.layers.1.mlp", 8, "the budget") in tiles_of(model)
    remat.apply(model, memory=4 * memory, sample=batch(), optimizer="adamw")  # was untiled by the re-plan
    assert tiles_of(model) == [("model.layers.0.mlp", 4, None)]


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.xfail(strict=True, reason="the profile run per choice misprices bytes that die before backward")
def test_a_budgets_profile_prices_tiles_under_autocast_as_a_real_step_runs_them() -> None:
    """Known gap. Where more than 5% of what the blocks' forwards left alive dies before the first backward (here
    the KV cache that `use_cache=True`, transformers' default, fills in the kept blocks), the profile runs every
    choice instead of deriving them (NOTE [ Profiling rounds ], rule 1), and that run prices full remat with tiles
    under autocast 4.1% under a real step (948,232 bytes against 989,192): NOTE [ Budget model ] counts a block's
    bytes to its backward, and under autocast some die with the step's autocast region. The first training step's
    check catches a plan it misses (NOTE [ The first step ])."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    base = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}

    def step(model: nn.Module) -> int:
        model.zero_grad(set_to_none=True)
        with remat.track() as tracked:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**inputs).loss
            loss.backward()
        return tracked.peak_bytes

    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = remat.apply(copy.deepcopy(base), budget=0.99, sample=inputs, tiles=8)
    plan = remat.plan(planned).budget
    assert plan is not None and plan.full_remat is not None
    real = step(remat.apply(copy.deepcopy(base), tiles=8))
    assert _stats.tiles > 0
    assert abs(plan.full_remat[0] / real - 1) < 0.01, (plan.full_remat[0], real)


def test_a_replan_that_fails_puts_back_the_tiles_the_plan_before_it_chose() -> None:
    """NOTE [ Tiles as a choice ], rule 3, and NOTE [ Budgeted models ], rule 4: a training forward of a longer
    sequence plans again, first untiled; where that plan is refused, the previous choices come back with the tiles
    they were planned with (they came back untiled, and the next steps went over the budget)."""
    base = make()
    report = remat.estimate(copy.deepcopy(base), batch(), configs=("full+head", "full+head+tiles"))
    steps = {config: report[config].step_peak_bytes for config in ("full+head", "full+head+tiles")}
    model = remat.apply(copy.deepcopy(base), budget=(steps["full+head"] + steps["full+head+tiles"]) // 2,
                        sample=batch(), head=True)
    before, tiled = str(remat.plan(model)), tiles_of(model)
    assert {chosen for _, _, chosen in tiled} == {"the budget"}
    model.config.max_position_embeddings = 4 * SEQ
    ids = torch.randint(0, VOCAB, (1, 4 * SEQ), generator=torch.Generator().manual_seed(2))
    with pytest.raises(remat.BudgetError):
        model(input_ids=ids, labels=ids)
    assert tiles_of(model) == tiled and str(remat.plan(model)) == before


def test_the_head_no_better_alone_is_tried_again_with_the_tiles() -> None:
    """A model whose step peaks in its MLPs' backward: the head in chunks alone lowers nothing (the plan puts it
    back, NOTE [ The head as a choice ], implementation note 2), the tiles alone move the peak to the logits in
    forward, and only both fit. The budget was refused, with a plan that fits at hand."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                                      max_position_embeddings=SEQ, use_cache=False)
    base = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 2000, (1, SEQ), generator=torch.Generator().manual_seed(1))
    sample = {"input_ids": ids, "labels": ids}
    report = remat.estimate(copy.deepcopy(base), sample, configs=("full", "full+head", "full+head+tiles"))
    full, head, both = (report[c].step_peak_bytes for c in ("full", "full+head", "full+head+tiles"))
    assert head == full and both < head / 2  # the head alone saves nothing at the peak
    budget = (head + both) // 2
    model = remat.apply(copy.deepcopy(base), budget=budget, sample=sample)
    plan = remat.plan(model)
    assert "chosen by the budget" in str(plan.head) and {chosen for _, _, chosen in tiles_of(model)} == {"the budget"}
    for p in model.parameters():
        p.grad = None
    with remat.track() as tracker:
        model(**sample).loss.backward()
    assert tracker.peak_bytes <= budget


def test_the_choice_is_closed_under_compile_where_a_tiled_call_runs_untiled() -> None:
    """NOTE [ Tiles as a choice ], rule 5: a budget with `compile=True` took the tiles, which ran untiled in the
    compiled step (a warning per module), profiled for nothing; `memory=`'s least estimate counted them."""
    model = make()
    names = [f"model.layers.{i}" for i in range(LAYERS)]
    assert TilesChoice(model, names, None).open
    assert not TilesChoice(model, names, None, compiled=True).open
    assert not TilesChoice(model, names, False).open
    request = request_for(memory="1GiB", sample=batch(), compile=True)
    estimated: list[str] = []
    with mock.patch.object(_memory, "estimate", lambda *args, configs, **kwargs: estimated.extend(configs) or {
            configs[0]: mock.Mock(peak_bytes=1 << 40)}):
        _memory._least(model, request, 1 << 20, torch.device("cpu"))
    assert estimated and not any("tiles" in config for config in estimated), estimated
