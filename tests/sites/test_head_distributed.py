"""The routed head under FSDP2 and DeepSpeed ZeRO-3 (NOTE [ A causal LM's head ], rule 5): 2 processes on CPU with
gloo.

Each rank takes half of a fixed batch and runs two training steps of a tiny Hugging Face Llama (float64) whose loss
`remat.apply(model, head=True)` routes; the full parameter gradients after each backward equal a single-process
run without remat on the whole batch. The head is sharded with the root (FSDP2's usual set-up), alone
(`fully_shard(model.lm_head)`), or by ZeRO-3 with every module (routed before or after `deepspeed.initialize`):
in the last two, the head's parameters exist only inside its own calls, which the routed loss must run in. Each
step also counts the head's gathers: one more per step than the model's own head (its first call gathers them for
nothing). A head that FSDP2 shards in a group with other modules is refused, before or after it is sharded.
DeepSpeed cases are skipped where deepspeed is absent.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import (
    assert_full_gradients_close,
    build_and_train,
    case_results,
    fsdp2_full_grads,
    ranks_results,
    run_cases,
    train_steps,
    zero3_config,
    zero3_full_grads,
)
from torch import nn

import remat
from remat._engine import stats

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # two gloo ranks (torch.multiprocessing.spawn): NOTE [ Slow tests ] in tests/conftest.py

WORLD, VOCAB, WIDTH, LENGTH, BATCH, STEPS, LR = 2, 96, 32, 12, 4, 2, 0.1
DEADLINE_S = 900.0  # DeepSpeed builds its communication op on its first use on a machine (minutes)


def make_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * LENGTH,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).double().train()


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(42))


# --- FSDP2 -------------------------------------------------------------------------------------------------


def fsdp2(head: bool, layout: str, routed_after: bool = False) -> Callable[[], Any]:
    """`layout`: "root" (the head in the root's group), "alone" (`fully_shard` on the head), "grouped" (one group
    of the final norm and the head)."""

    def build() -> Any:
        from torch.distributed.fsdp import fully_shard

        model = make_model()
        if head and not routed_after:
            remat.apply(model, head=True)
        for layer in model.model.layers:
            fully_shard(layer)
        if layout == "alone":
            fully_shard(model.lm_head)
        elif layout == "grouped":
            fully_shard([model.model.norm, model.lm_head])
        fully_shard(model)
        if head and routed_after:
            remat.apply(model, head=True)
        return model

    return build


def train_fsdp2(model: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    gathers: Counter[str] = Counter()
    phase = ["forward"]
    original = group.FSDPParamGroup.unshard
    head = model.lm_head

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(param._module_info.module is head for param in self.fsdp_params) and not self.is_unsharded:
            gathers[phase[0]] += 1
        return original(self, *args, **kwargs)

    group.FSDPParamGroup.unshard = counted  # type: ignore[method-assign]
    try:
        return _train(model, ids, phase, gathers, lambda loss: loss.backward(), fsdp2_full_grads)
    finally:
        group.FSDPParamGroup.unshard = original  # type: ignore[method-assign]



# --- DeepSpeed ZeRO-3 --------------------------------------------------------------------------------------


ZERO3 = zero3_config(BATCH, WORLD, LR)


def zero3(head: str) -> Callable[[], Any]:
    """`head`: "" (the model's own), "before" or "after" `deepspeed.initialize`."""

    def build() -> Any:
        import deepspeed

        model = make_model()
        if head == "before":
            remat.apply(model, head=True)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ZERO3)
        if head == "after":
            remat.apply(engine.module, head=True)
        return engine

    return build


def train_zero3(engine: Any, ids: torch.Tensor) -> dict[str, Any]:
    gathers: Counter[str] = Counter()
    phase = ["forward"]
    weight = engine.module.lm_head.weight
    original = weight.all_gather_coalesced

    def counted(params: Any, *args: Any, **kwargs: Any) -> Any:
        params = list(params)
        gathers[phase[0]] += sum(1 for p in params if p is weight)
        return original(params, *args, **kwargs)

    weight.all_gather_coalesced = counted
    return _train(engine, ids, phase, gathers, engine.backward, zero3_full_grads, engine.step)


# --- training ----------------------------------------------------------------------------------------------


def _train(model: Any, ids: torch.Tensor, phase: list[str], gathers: Counter[str],
           backward: Callable[[torch.Tensor], Any], grads_of: Callable[[Any], dict[str, torch.Tensor]],
           step: Callable[[], Any] | None = None) -> dict[str, Any]:
    return train_steps(model, lambda m: m(input_ids=ids, labels=ids).loss, STEPS, LR, phase, gathers, backward,
                       grads_of, step, chunks=lambda: stats.head_chunks)


CASES: dict[str, tuple[Callable[[], Any], Callable[..., dict[str, Any]]]] = {
    "fsdp2_root": (fsdp2(True, "root"), train_fsdp2),
    "fsdp2_alone": (fsdp2(True, "alone"), train_fsdp2),
    "fsdp2_alone_own_head": (fsdp2(False, "alone"), train_fsdp2),
    "fsdp2_grouped": (fsdp2(True, "grouped"), train_fsdp2),
    "fsdp2_grouped_routed_after": (fsdp2(True, "grouped", routed_after=True), train_fsdp2),
    "zero3_before_init": (zero3("before"), train_zero3),
    "zero3_after_init": (zero3("after"), train_zero3),
    "zero3_own_head": (zero3(""), train_zero3),
}
DEEPSPEED = [name for name in CASES if name.startswith("zero3")]
REFUSED = {"fsdp2_grouped": "sharded by FSDP2 in one group with `model.norm`",
           "fsdp2_grouped_routed_after": "FSDP2 shards it in one group with other modules"}


def _rank(rank: int, port: int, out: str, names: list[str]) -> None:
    warnings.simplefilter("ignore")  # DeepSpeed and FSDP2 warn about CPU and float64 set-ups
    share = BATCH // WORLD
    run_cases(rank, port, WORLD, out, names, build_and_train(CASES, batch()[rank * share:(rank + 1) * share]))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return ranks_results(_rank, tmp_path_factory.mktemp("head_distributed"), CASES, DEEPSPEED, WORLD, DEADLINE_S)


@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    """Single process, whole batch, no remat: full gradients after each step."""
    model = make_model()
    ids = batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})  # type: ignore[union-attr]
        optimizer.step()
    return grads


ROUTED = [name for name in CASES if name not in REFUSED and "own_head" not in name]
OWN = [name for name in CASES if "own_head" in name]  # the gathers' references


def _assert_trained_as_one_process(results: list[dict[str, Any]], name: str,
                                   reference: list[dict[str, torch.Tensor]], routed: bool) -> None:
    for rank, got in enumerate(case_results(results, name, DEEPSPEED)):
        assert all((chunks > 0) == routed for chunks in got["chunks"]), f"rank {rank}: chunks {got['chunks']}"
        for step, (ours, theirs) in enumerate(zip(got["grads"], reference, strict=True)):
            assert_full_gradients_close(ours, theirs, step)


@pytest.mark.equivalence
@pytest.mark.parametrize("name", ROUTED)
def test_gradients_equal_a_single_process_without_remat(
    name: str, results: list[dict[str, Any]], reference: list[dict[str, torch.Tensor]]
) -> None:
    _assert_trained_as_one_process(results, name, reference, routed=True)


@pytest.mark.parametrize("name", OWN)
def test_the_models_own_head_trains_as_one_process(
    name: str, results: list[dict[str, Any]], reference: list[dict[str, torch.Tensor]]
) -> None:
    """The harness itself: the references of the gathers below train as one process does."""
    _assert_trained_as_one_process(results, name, reference, routed=False)


@pytest.mark.parametrize("name", ["fsdp2_alone", "zero3_before_init", "zero3_after_init"])
def test_the_head_is_gathered_at_most_once_more_per_step_than_the_models_own(
    name: str, results: list[dict[str, Any]]
) -> None:
    """Rule 5, implementation note 3: the head's first call gathers its parameters and uses none of them."""
    own = "fsdp2_alone_own_head" if name.startswith("fsdp2") else "zero3_own_head"
    for ours, theirs in zip(case_results(results, name, DEEPSPEED), case_results(results, own, DEEPSPEED), strict=True):
        for mine, plain in zip(ours["gathers"], theirs["gathers"], strict=True):
            assert plain.get("forward", 0) > 0, "the counter saw no gather"
            assert sum(mine.values()) <= sum(plain.values()) + 1, (ours["gathers"], theirs["gathers"])


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_head_fsdp2_shards_in_a_group_with_other_modules_is_refused(
    name: str, results: list[dict[str, Any]]
) -> None:
    for got in case_results(results, name, DEEPSPEED, failed=True):
        assert isinstance(got, str) and REFUSED[name] in got, got
