"""The chunked head as a choice of budgets, memory plans and estimates (docs/guides/head.md, NOTE [ The head as a
choice ]): a budget that only the head in chunks makes feasible is planned, not refused.

The model is a small GPT-2 whose vocabulary (16,000) dominates its step, as in real language models: full remat of
its blocks leaves the logits, which the chunked head does not hold. Needs the `hf` extra.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import garbage_collector_off
from torch import nn

import remat

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 16000, 64, 4
EQUIVALENCE_HELPERS = ("trained(",)


def make(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).to(dtype).train()


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def trained(model: nn.Module) -> tuple[bool, int, dict[str, torch.Tensor]]:
    """One step of a default loop (the output let go once the loss is made, gradients made by backward): whether
    it returned logits, its peak (as a budget counts it), the gradients."""
    for p in model.parameters():
        p.grad = None
    with remat.track() as tracker:
        out = model(**batch())
        logits, loss = out.logits is not None, out.loss
        del out
        loss.backward()
    return logits, tracker.peak_bytes, {name: p.grad for name, p in model.named_parameters()}


def no_remat_grads(model: nn.Module, inputs: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """No remat's gradients in float64, the loss taken from the logits (the model's own upcasts to float32)."""
    inputs = inputs or batch()
    logits = model(input_ids=inputs["input_ids"]).logits
    F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_budget_only_the_chunked_head_makes_feasible_is_planned_not_refused() -> None:
    base = make()
    _, none_peak, _ = trained(copy.deepcopy(base))
    _, full_peak, _ = trained(remat.apply(copy.deepcopy(base)))
    budget = 0.45
    assert full_peak > 1.05 * budget * none_peak  # full remat of the blocks alone cannot meet it
    with pytest.raises(remat.BudgetError):
        remat.apply(copy.deepcopy(base), budget=budget, sample=batch(), head=False)
    model = remat.apply(copy.deepcopy(base), budget=budget, sample=batch())
    plan = remat.plan(model)
    assert plan.budget is not None and "chosen by the budget" in str(plan)
    # the baselines were planned with the head: the table says so, where "no remat" alone would not be the step
    # the fraction is of
    assert "no remat (with the head in chunks): step peak" in str(plan)
    assert "full remat (with the head in chunks): step peak" in str(plan)
    logits, peak, _ = trained(model)
    assert not logits
    assert peak <= 1.05 * plan.budget.budget, (peak, plan.budget.budget)
    assert abs(plan.budget.budget - budget * none_peak) <= 0.05 * none_peak  # a fraction of the model's own step


def test_the_budgets_plan_with_the_head_keeps_no_remats_gradients() -> None:
    base = make(torch.float64)
    expected = no_remat_grads(copy.deepcopy(base))
    model = remat.apply(copy.deepcopy(base), budget=0.6, sample=batch())  # in float64 the head holds more
    logits, _, grads = trained(model)
    assert not logits and "chosen by the budget" in str(remat.plan(model))
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, k=name: f"gradient of {k}: {m}")


def test_a_budget_that_fits_without_the_head_leaves_it_alone() -> None:
    model = remat.apply(make(), budget=0.99, sample=batch())  # full remat alone reaches 0.96 here
    assert remat.plan(model).head is None
    assert model(**batch()).logits is not None


def test_head_true_with_a_budget_routes_it_as_the_users_and_the_fraction_is_of_its_own_step() -> None:
    base = make()
    plain = remat.plan(remat.apply(copy.deepcopy(base), budget=0.99, sample=batch(), head=False)).budget
    assert plain is not None and plain.no_remat is not None
    model = remat.apply(copy.deepcopy(base), budget=0.5, sample=batch(), head=True)
    plan = remat.plan(model)
    assert "head: lm_head" in str(plan) and "chosen by" not in str(plan)
    assert plan.budget is not None
    assert abs(plan.budget.budget - 0.5 * plain.no_remat[0]) <= 0.02 * plain.no_remat[0]


@pytest.mark.parametrize("earlier", [{"head": True}, {"tiles": 4}, {"head": True, "tiles": 4}, None],
                         ids=["head", "tiles", "head and tiles", "tiles in the same call"])
def test_a_fraction_is_of_the_step_without_remat_whatever_head_or_tiles_the_model_carries(
        earlier: dict[str, object] | None) -> None:
    """NOTE [ The head as a choice ], rule 2, and NOTE [ Tiles as a choice ], rule 2: the same bytes as on the fresh
    model, so a budget that full remat with the head meets is not refused for a head an earlier call routed."""
    base = make()
    fresh = remat.plan(remat.apply(copy.deepcopy(base), budget=0.8, sample=batch())).budget
    assert fresh is not None
    model = copy.deepcopy(base)
    if earlier is None:
        remat.apply(model, budget=0.8, sample=batch(), tiles=4)
    else:
        remat.apply(model, **earlier)  # type: ignore[arg-type]
        remat.apply(model, budget=0.8, sample=batch())
    plan = remat.plan(model).budget
    assert plan is not None and plan.budget == fresh.budget
    peaks = [trained(model)[1] for _ in range(3)]
    assert max(peaks) <= 1.05 * fresh.budget, (peaks, fresh.budget)


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_memory_that_only_the_chunked_head_fits_is_planned() -> None:
    base = make()
    full = remat.estimate(copy.deepcopy(base), batch(), optimizer="adamw", configs=("full", "full+head"))
    with_head, without = full["full+head"].peak_bytes, full["full"].peak_bytes
    assert with_head < 0.7 * without
    memory = (with_head + without) // 2
    with pytest.raises(remat.BudgetError):
        remat.apply(copy.deepcopy(base), memory=memory, sample=batch(), optimizer="adamw", head=False)
    model = remat.apply(copy.deepcopy(base), memory=memory, sample=batch(), optimizer="adamw")
    assert "chosen by the budget" in str(remat.plan(model))


def test_estimate_has_the_head_as_a_configuration_and_its_budget_chooses_it() -> None:
    base = make()
    report = remat.estimate(base, batch(), configs=("none", "full", "save_matmuls", "full+head", "save_matmuls+head",
                                                    0.45))
    assert report["full+head"].peak_bytes < 0.7 * report["full"].peak_bytes
    assert report["save_matmuls+head"].peak_bytes < report["save_matmuls"].peak_bytes
    assert report[0.45].peak_bytes < report["full"].peak_bytes  # the budget's planner routed the head
    assert "full+head" in str(report)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in base.modules())  # nothing left behind
    assert "forward" not in base.lm_head.__dict__ and "_loss_function" not in base.__dict__
    with pytest.raises(ValueError, match="Hugging Face causal LM"):
        remat.estimate(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(2, 4), configs=("full+head",))


def _state_bytes(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """What lives on the device before `remat.apply` runs: parameters, buffers and the sample."""
    tensors = [*model.parameters(), *model.buffers(), *inputs.values()]
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.parametrize("fraction", [0.45, 0.3])
def test_apply_plans_with_the_head_before_a_real_step_would_go_over_the_budget(fraction: float) -> None:
    """Planning needs no more than the plan (NOTE [ Planning on fake tensors ], rule 1): where only the chunked
    head fits, `apply` itself stays within the larger of the budget and the least it can plan (full remat with the
    head in chunks), +5%, as a device of that size would make it: no real step of the blocks without the head
    first. At 0.45 the plan with the head fits; at 0.3 nothing does, and the refusal names the head's least."""
    base = make()
    _, none_peak, _ = trained(copy.deepcopy(base))
    _, least, _ = trained(remat.apply(copy.deepcopy(base), head=True))  # full remat, the head in chunks
    assert 0.3 * none_peak < least < 0.45 * none_peak
    limit = int(1.05 * max(fraction * none_peak, least))
    model, inputs = copy.deepcopy(base), batch()
    if fraction < 0.4:
        with remat.track(limit=limit), pytest.raises(remat.BudgetError) as refused:
            remat.apply(model, budget=fraction, sample=inputs)
        assert refused.value.least_bytes is not None and refused.value.least_bytes <= 1.05 * least
        return
    with remat.track(limit=limit):
        remat.apply(model, budget=fraction, sample=inputs)
    assert "chosen by the budget" in str(remat.plan(model))
    _, peak, _ = trained(model)
    assert peak <= limit


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_apply_with_memory_plans_with_the_head_before_a_real_step_would_go_over_it() -> None:
    """`apply(memory=M)` keeps the process within M (the same NOTE) where only the chunked head fits: its real steps
    allocate no more than what M leaves beside the parameters, buffers and sample that were there before."""
    base = make()
    full = remat.estimate(copy.deepcopy(base), batch(), optimizer="adamw", configs=("full", "full+head"))
    memory = (full["full+head"].peak_bytes + full["full"].peak_bytes) // 2
    model, inputs = copy.deepcopy(base), batch()
    with remat.track(limit=memory - _state_bytes(model, inputs)):
        remat.apply(model, memory=memory, sample=inputs, optimizer="adamw")
    assert "chosen by the budget" in str(remat.plan(model))


def test_a_model_whose_budget_routed_the_head_is_freed_when_its_last_reference_goes() -> None:
    """No cycle through the route the budget chose keeps the model (and its gradients) until the garbage collector
    runs (the same for `head=True`: tests/sites/test_head.py)."""
    model = remat.apply(make(), budget=0.5, sample=batch())
    logits, _, _ = trained(model)
    assert not logits and "chosen by the budget" in str(remat.plan(model))
    ref = weakref.ref(model)
    with garbage_collector_off():
        del model
        assert ref() is None, "a cycle through the head's route kept the model"


@pytest.mark.parametrize("shape", [(BATCH, SEQ // 2), (2 * BATCH, SEQ)], ids=["shorter", "larger batch"])
def test_a_training_forward_with_new_shapes_plans_again_and_keeps_no_remats_gradients(shape: tuple[int, int]) -> None:
    """NOTE [ The head as a choice ], rule 3: the budget's hook plans again inside the forward of a new input shape,
    taking back (and routing again, where needed) the head it routed, while that forward runs the model's hooks:
    the route taken back was still called, without the forward's keyword arguments, and raised a TypeError."""
    base = make(torch.float64)
    model = remat.apply(copy.deepcopy(base), budget=0.6, sample=batch())
    assert "chosen by the budget" in str(remat.plan(model))
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(2))
    expected = no_remat_grads(copy.deepcopy(base), {"input_ids": ids, "labels": ids})
    for twin in (model, copy.deepcopy(model)):
        out = twin(input_ids=ids, labels=ids)
        out.loss.backward()
        for name, p in twin.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], msg=lambda m, k=name: f"gradient of {k}: {m}")
        assert remat.plan(twin).budget is not None


def test_a_replan_that_fails_leaves_the_head_as_the_plan_before_it_had_it() -> None:
    """NOTE [ The head as a choice ], rule 3, and NOTE [ Budgeted models ], rule 4: a re-plan that is refused puts
    back the previous plan's choices and its routed head (it took the head off and left it off)."""
    least = remat.estimate(make(), batch(), configs=("full+head",))["full+head"].step_peak_bytes
    model = remat.apply(make(), budget=least, sample=batch())
    before = str(remat.plan(model))
    assert "chosen by the budget" in before
    ids = torch.randint(0, VOCAB, (4 * BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    with pytest.raises(remat.BudgetError):
        model(input_ids=ids, labels=ids)
    assert str(remat.plan(model)) == before
    logits, _, _ = trained(model)
    assert not logits


def test_apply_again_with_head_false_takes_off_the_head_an_earlier_budget_routed() -> None:
    model = remat.apply(make(), budget=0.5, sample=batch())
    assert "chosen by the budget" in str(remat.plan(model))
    remat.apply(model, budget=0.99, sample=batch(), head=False)
    assert remat.plan(model).head is None
    assert model(**batch()).logits is not None
