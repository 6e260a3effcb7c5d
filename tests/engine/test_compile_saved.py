"""Inside torch.compile every remat site lowers to torch's checkpoint operator with its policy.

The baseline is what the compiled forward saves for backward (counted in the partitioner's forward graph) when
the same blocks are marked with `torch.utils.checkpoint` and the equivalent selective-checkpoint policy; each
test also checks that the compiled gradients equal eager code without remat (float64).
"""

from __future__ import annotations

import functools
import shutil
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import remat

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's notes about C builtins

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _matmul_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


TORCH_SAC = functools.partial(create_selective_checkpoint_contexts, _matmul_policy)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.down(F.gelu(self.up(x)))).sin()


class Stack(nn.Module):
    """Blocks run one after another; `mark(i, block, x)` runs block i (checkpointed or not)."""

    def __init__(self, mark: Callable[[int, nn.Module, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3)).double()
        self.mark = mark

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x) if self.mark is None else self.mark(i, block, x)
        return x


def _torch_mark(context_fn: Any = None) -> Callable[[int, nn.Module, torch.Tensor], torch.Tensor]:
    extra = {} if context_fn is None else {"context_fn": context_fn}
    return lambda i, block, x: checkpoint(block, x, use_reentrant=False, **extra)


def saved_bytes(model: Callable[[torch.Tensor], torch.Tensor], params: list[torch.Tensor]) -> tuple[int, Any]:
    """Bytes the compiled forward saves for backward, and the compiled gradients of the input and `params`."""
    record: list[int] = []

    def partition(joint: Any, inputs: Any, **kwargs: Any) -> Any:
        forward, backward = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        outputs = next(node for node in forward.graph.nodes if node.op == "output").args[0]
        saved = [node.meta.get("val") for node in outputs[kwargs["num_fwd_outputs"] :]]
        record.append(sum(v.numel() * v.element_size() for v in saved if isinstance(v, torch.Tensor)))
        return forward, backward

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda graph, _: graph, partition_fn=partition)
    x = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grads = torch.autograd.grad(torch.compile(model, backend=backend)(x).sum(), [x, *params])
    assert len(record) == 1, "the model compiled to one graph"
    return record[0], grads


def eager_grads(params: list[torch.Tensor]) -> Any:
    model = Stack()
    with torch.no_grad():
        for p, q in zip(model.parameters(), params, strict=True):
            p.copy_(q)
    x = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return torch.autograd.grad(model(x).sum(), [x, *model.parameters()])


def check(model: nn.Module, expected: int, none: int) -> int:
    """`model` saves within 10% of `expected` bytes, less than `none`, and has eager no-remat gradients."""
    params = list(model.parameters())
    got, grads = saved_bytes(model, params)
    assert abs(got - expected) <= 0.1 * expected, (got, expected)
    assert got < none
    torch.testing.assert_close(grads, eager_grads(params))
    return got


@pytest.fixture(scope="module")
def baselines() -> dict[str, int]:
    """Saved bytes with no checkpointing, torch's checkpoint per block, and torch's SAC with a matmul policy."""
    out = {}
    for label, mark in (("none", None), ("full", _torch_mark()), ("matmuls", _torch_mark(TORCH_SAC))):
        model = Stack(mark)
        out[label] = saved_bytes(model, list(model.parameters()))[0]
    assert out["full"] < out["matmuls"] < out["none"]
    return out


def _function_site(policy: Any) -> Callable[[int, nn.Module, torch.Tensor], torch.Tensor]:
    @remat(policy=policy)
    def run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x)

    return lambda i, block, x: run(block, x)


def _instances(policy: Any) -> nn.Module:
    model = Stack()
    for block in model.blocks:
        remat(block, policy=policy)
    return model


def _applied(policy: Any) -> nn.Module:
    return remat.apply(Stack(), Block, policy=policy)


def _drop_in(policy: Any) -> nn.Module:
    context = None if policy is None else TORCH_SAC
    return Stack(lambda i, block, x: remat.checkpoint(block, x, use_reentrant=False, context_fn=context))


def _region_function(policy: Any) -> nn.Module:
    run = remat.region(policy=policy)(lambda block, x: block(x))
    return Stack(lambda i, block, x: run(block, x))


SITES: dict[str, Callable[[Any], nn.Module]] = {
    "function": lambda policy: Stack(_function_site(policy)),
    "instance": _instances,
    "apply": _applied,
    "drop-in": _drop_in,
    "region function": _region_function,
}


@pytest.mark.parametrize("site", sorted(SITES))
@pytest.mark.parametrize("policy", ["full", "matmuls"])
def test_each_site_saves_what_torch_checkpoint_saves(site: str, policy: str, baselines: dict[str, int]) -> None:
    model = SITES[site](None if policy == "full" else remat.policies.save_matmuls)
    check(model, baselines[policy], baselines["none"])


def test_a_rematerialized_class_saves_what_torch_checkpoint_saves(baselines: dict[str, int]) -> None:
    @remat
    class Marked(Block):
        pass

    model = Stack()
    model.blocks = nn.ModuleList(Marked() for _ in range(3)).double()
    model.blocks.load_state_dict(Stack().blocks.state_dict())
    check(model, baselines["full"], baselines["none"])


def test_a_chain_follows_its_eager_plan_inside_compile(baselines: dict[str, int]) -> None:
    class Chained(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x)  # type: ignore[no-any-return]

    model = Chained()
    model.blocks = remat.chain(list(model.blocks), segments=3)  # type: ignore[assignment]
    x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    model(x).sum().backward()  # the eager call makes the plan: like checkpoint_sequential, the last stage is kept
    model.zero_grad()
    assert model.blocks._lowered == ((0, 1, True), (1, 2, True), (2, 3, False))  # type: ignore[attr-defined]
    full = _torch_mark()
    same = Stack(lambda i, block, x: block(x) if i == 2 else full(i, block, x))
    check(model, saved_bytes(same, list(same.parameters()))[0], baselines["none"])


def test_a_budget_plan_lowers_each_blocks_choice(baselines: dict[str, int]) -> None:
    sample = torch.randn(32, 16, dtype=torch.float64)
    model = remat.apply(Stack(), Block, budget=0.6, sample=sample)
    choice = {int(site.name.split(".")[-1]): site.choice for site in remat.plan(model).sites}
    assert choice and set(choice.values()) <= {"full", "matmuls"}, choice
    marks = {"full": _torch_mark(), "matmuls": _torch_mark(TORCH_SAC)}
    same = Stack(lambda i, block, x: marks[choice[i]](i, block, x) if i in choice else block(x))
    expected = saved_bytes(same, list(same.parameters()))[0]
    check(model, expected, baselines["none"])


def test_tag_names_cannot_be_kept_under_compile_and_say_so_once(baselines: dict[str, int]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(_instances(remat.policies.save_tagged("h")), baselines["full"], baselines["none"])
    messages = [str(w.message) for w in caught if str(w.message).startswith("remat:")]
    assert len(messages) == 1 and "tagged ['h']" in messages[0], messages


def test_the_switch_turns_compiled_sites_off_with_one_recompile(baselines: dict[str, int]) -> None:
    model = remat.apply(Stack(), Block)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    for enabled in (True, False, True, False):
        remat.set_enabled(enabled)
        for _ in range(2):
            compiled(x).sum().backward()
    assert counter.frame_count == 2  # one graph per switch position, reused after
    remat.set_enabled(False)
    try:
        got, _ = saved_bytes(model, list(model.parameters()))
    finally:
        remat.set_enabled(True)
    assert got == baselines["none"]


def test_a_region_block_in_compiled_code_warns_once_and_keeps_eager_gradients() -> None:
    layer = nn.Linear(8, 8).double()

    def model(x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            h = torch.tanh(layer(x)).sin()
        return (h * 2).sum()

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(torch.tanh(layer(x)).sin().mul(2).sum(), (x, layer.weight))
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [torch.autograd.grad(compiled(x), (x, layer.weight)) for _ in range(2)]
    messages = [str(w.message) for w in caught if str(w.message).startswith("remat:")]
    assert len(messages) <= 1 and all("@remat" in m for m in messages), messages
    torch.testing.assert_close(got[-1], expected)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own imports
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_inductor_compiles_rematerialized_instances_with_eager_gradients() -> None:
    """The one inductor test (about 20 s on 2 cores): blocks marked by `remat.apply`, with a matmul policy."""
    model = remat.apply(Stack(), Block, policy=remat.policies.save_matmuls)
    params = list(model.parameters())
    x = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    got = torch.autograd.grad(torch.compile(model, backend="inductor")(x).sum(), [x, *params])
    torch.testing.assert_close(got, eager_grads(params))
    assert torch._dynamo.explain(model)(x).graph_break_count == 0


def _compiled_one_by_one(policies: list[Any]) -> list[int]:
    """Bytes each block's compiled forward saved, in the order they ran (second step), with the first blocks under
    `policies` (None: full remat) and the rest kept, each block compiled with `block.compile()`."""
    torch._dynamo.reset()
    saved: dict[int, int] = {}
    ran: list[int] = []

    def partition(joint: Any, inputs: Any, **kwargs: Any) -> Any:
        forward, backward = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        outputs = next(node for node in forward.graph.nodes if node.op == "output").args[0]
        values = [node.meta.get("val") for node in outputs[kwargs["num_fwd_outputs"] :]]
        saved[id(forward)] = sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
        return forward, backward

    def compiler(graph: Any, _: Any) -> Any:
        def run(*args: Any) -> Any:
            if id(graph) in saved:
                ran.append(saved[id(graph)])
            return graph(*args)

        return run

    model = Stack()
    for block, policy in zip(model.blocks, policies, strict=False):
        remat(block, policy=policy)
    backend = aot_autograd(fw_compiler=compiler, partition_fn=partition)  # one backend: one cache for all blocks
    for block in model.blocks:
        block.compile(backend=backend)
    x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        ran.clear()
        model(x).sum().backward()
    return ran


def test_blocks_compiled_one_by_one_each_run_their_own_choice() -> None:
    """`block.compile()` shares one compiled forward among identical blocks: each must still get its own graph."""
    ran = _compiled_one_by_one([None, remat.policies.save_matmuls])
    assert len(ran) == 3 and ran[0] < ran[1] < ran[2], ran  # full, matmuls, kept: in the second call too


@pytest.mark.equivalence
def test_blocks_compiled_one_by_one_keep_their_own_calls() -> None:
    """Policies that differ only in which calls they keep (a budget plan's parts) are told apart too."""
    from remat._core.policies import Policy, matmuls

    first, second = Policy(ops=(matmuls,), calls=frozenset({0})), Policy(ops=(matmuls,), calls=frozenset({1}))
    alone = [_compiled_one_by_one([policy, policy, policy])[0] for policy in (first, second)]
    assert alone[0] != alone[1], alone  # the up-projection (64 wide) and the down-projection keep different bytes
    ran = _compiled_one_by_one([first, second])
    assert ran[:2] == alone, (ran, alone)
    ran = _compiled_one_by_one([remat.policies.save_matmuls, first])
    assert ran[1] == alone[0] and ran[0] > ran[1], ran


def _up_only(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the up-projection's output only, told apart by its bias (64 wide), not by counting calls."""
    wide = op is torch.ops.aten.addmm.default and args[0].shape[-1] == 64
    return CheckpointPolicy.MUST_SAVE if wide else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.equivalence
def test_a_policy_keeping_some_calls_keeps_those_calls_inside_compile(baselines: dict[str, int]) -> None:
    """A budget plan's part (the first matmul call of each block, its up-projection) keeps just that call."""
    from remat._core.policies import Policy, matmuls

    up_only = _torch_mark(functools.partial(create_selective_checkpoint_contexts, _up_only))
    reference = Stack(up_only)
    expected = saved_bytes(reference, list(reference.parameters()))[0]
    assert baselines["full"] < expected < baselines["matmuls"]
    got = check(_instances(Policy(ops=(matmuls,), calls=frozenset({0}))), expected, baselines["none"])
    assert got < baselines["matmuls"]  # every matmul kept would be more
