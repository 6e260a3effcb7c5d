"""Distributed training (docs/guides/distributed.md): DDP and FSDP2 (`fully_shard`), 2 processes on CPU with gloo.

Two processes (`torch.multiprocessing.spawn`, backend gloo, loopback only) each take half of a fixed float64
batch and run two training steps (forward, backward, SGD) of a small pre-norm transformer-ish model whose
blocks are rematerialized in several ways. After each step every rank saves its parameter gradients (full
tensors: FSDP2's sharded gradients are gathered) with `torch.save`; the pytest process compares them with a
single-process run of the same model, without remat, on the whole batch (mean loss), in float64.

All cases run in one spawn, so torch is imported once per rank. A case that raises inside a rank is recorded
with the rank's traceback and fails that case's test only; a rank that dies or hangs fails every test.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from conftest import ranks_results, run_cases
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat

pytestmark = pytest.mark.slow  # two gloo ranks (torch.multiprocessing.spawn): NOTE [ Slow tests ] in tests/conftest.py

WORLD = 2
WIDTH, HEADS, LENGTH, BATCH, STEPS, LR = 16, 2, 6, 8, 2, 0.1
DEADLINE_S = 120.0
BODY_CALLS = [0]


# --- the model -------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN block: causal self-attention, then an MLP; dropout present with p=0 (ranks see different data)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.0)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        BODY_CALLS[0] += 1  # forward calls plus reruns: shows that recompute happened
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(h.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class DecoratedBlock(Block):
    """The same block with `@remat` on its `forward` (docs/guides/sites.md, 'Functions and methods')."""

    @remat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class RegionBlock(Block):
    """The same block with its body in a `with remat.region():` block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            return self.body(x)


class Net(nn.Module):
    """Input projection, two blocks (or one block applied twice: `shared`), final norm, pooled head."""

    def __init__(self, block: type[Block] = Block, *, shared: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        first = block()
        self.blocks = nn.ModuleList([first] if shared else [first, block()])
        self.repeats = 2 if shared else 1
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.repeats):
            for block in self.blocks:
                h = block(h)
        return self.head(self.norm(h).mean(1))  # pooled over the sequence: not a view (FSDP2 warns on views)


def make_net(block: type[Block] = Block, *, shared: bool = False) -> Net:
    """The same float64 parameters in every process and for every block class."""
    torch.manual_seed(0)
    net = Net(shared=shared).double()
    if block is not Block:
        state = net.state_dict()
        net = Net(block, shared=shared).double()
        net.load_state_dict(state)
    return net


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(BATCH, LENGTH, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randn(BATCH, 3, generator=generator, dtype=torch.float64)
    return x, y


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, list[Any]]:
    """`STEPS` steps of mean-squared-error and SGD: the full parameter gradients after each backward, and
    how many times a block's body ran in each step (forward and rerun)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads, calls = [], []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        BODY_CALLS[0] = 0
        F.mse_loss(model(x), y).backward()
        calls.append(BODY_CALLS[0])
        grads.append({_plain_name(name): _full(p.grad) for name, p in model.named_parameters()})
        optimizer.step()
    return {"grads": grads, "calls": calls}


def _plain_name(name: str) -> str:
    return name.removeprefix("module.")


def _full(grad: torch.Tensor | None) -> torch.Tensor:
    assert grad is not None, "a parameter got no gradient"
    full_tensor = getattr(grad, "full_tensor", None)  # a DTensor under FSDP2
    return (full_tensor() if full_tensor is not None else grad).detach().clone()


# --- the cases: how each rank builds its model -------------------------------------------------------------


def _ddp(model: nn.Module, **kwargs: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, **kwargs)


def ddp_apply_rerun() -> nn.Module:
    return _ddp(remat.apply(make_net(), Block))


def ddp_apply_replay() -> nn.Module:
    return _ddp(remat.apply(make_net(), Block, strategy="replay"))


def ddp_decorated_forward() -> nn.Module:
    return _ddp(make_net(DecoratedBlock), find_unused_parameters=False)


def ddp_decorated_forward_shared_block() -> nn.Module:
    # One block applied twice: torch's reentrant checkpoint runs one inner backward per call, so DDP's hook
    # for each of the block's parameters fires twice ("marked ready twice"); remat's single backward does not.
    return _ddp(make_net(DecoratedBlock, shared=True), find_unused_parameters=False)


def ddp_region() -> nn.Module:
    return _ddp(make_net(RegionBlock))


def ddp_apply_find_unused() -> nn.Module:
    # DDP walks the autograd graph from the outputs after every forward to find unused parameters.
    return _ddp(remat.apply(make_net(), Block), find_unused_parameters=True)


def ddp_budget() -> nn.Module:
    # Planned on rank 0's half of the batch (every rank takes rank 0's plan); the first training step checks it on
    # every rank, and the next forward takes the largest peak over the ranks (NOTE [ The first step ]).
    model = remat.apply(make_net(), Block, budget=0.95, sample=batch()[0][: BATCH // WORLD])
    plan = remat.plan(model).budget
    assert plan is not None and any(plan.choices[c] != "kept" for c in plan.choice), plan
    return _ddp(model)


def fsdp2_apply_rerun() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = remat.apply(make_net(), Block)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def fsdp2_apply_replay() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = remat.apply(make_net(), Block, strategy="replay")
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def fsdp2_shard_then_remat() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return remat.apply(model, Block)


class Case(NamedTuple):
    build: Callable[[], nn.Module]
    shared: bool = False  # the model applies one block twice
    reruns: bool = True  # strategy "rerun": each block's body runs again in backward
    planned: bool = False  # a budget plan: some blocks' bodies run again, not every one


CASES = {
    "ddp_apply_rerun": Case(ddp_apply_rerun),
    "ddp_apply_replay": Case(ddp_apply_replay, reruns=False),
    "ddp_decorated_forward": Case(ddp_decorated_forward),
    "ddp_decorated_forward_shared_block": Case(ddp_decorated_forward_shared_block, shared=True),
    "ddp_region": Case(ddp_region, reruns=False),
    "ddp_apply_find_unused": Case(ddp_apply_find_unused),
    "ddp_budget": Case(ddp_budget, planned=True),
    "fsdp2_apply_rerun": Case(fsdp2_apply_rerun),
    "fsdp2_apply_replay": Case(fsdp2_apply_replay, reruns=False),
    "fsdp2_shard_then_remat": Case(fsdp2_shard_then_remat),
}


class ReentrantBlock(Block):
    """The control: torch's reentrant checkpoint on the same block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.body, x, use_reentrant=True)
        return out


def control_torch_reentrant_shared_block() -> nn.Module:
    return _ddp(make_net(ReentrantBlock, shared=True), find_unused_parameters=False)


CONTROL = "control_torch_reentrant_shared_block"
RUNS = {**CASES, CONTROL: Case(control_torch_reentrant_shared_block, shared=True)}  # the control runs last


# --- the ranks ---------------------------------------------------------------------------------------------


def _rank(rank: int, port: int, out: str, names: list[str]) -> None:
    """One process: run every case on this rank's half of the batch, save gradients or the traceback."""
    warnings.simplefilter("error")  # as pytest's filterwarnings = ["error"]: a warning is a failure here too
    x, y = batch()
    share = BATCH // WORLD
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    run_cases(rank, port, WORLD, out, names, lambda name: train(RUNS[name].build(), x, y))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results: case name -> gradients after each step, or the rank's traceback."""
    return ranks_results(_rank, tmp_path_factory.mktemp("distributed"), RUNS, (), WORLD, DEADLINE_S)


@pytest.fixture(scope="module")
def references() -> dict[bool, dict[str, list[Any]]]:
    """Single process, whole batch, no remat: gradients after each step, per model shape (shared block?)."""
    x, y = batch()
    return {shared: train(make_net(shared=shared), x, y) for shared in (False, True)}


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_equal_single_process_reference(
    name: str, results: list[dict[str, Any]], references: dict[bool, dict[str, list[Any]]]
) -> None:
    case = CASES[name]
    expected = references[case.shared]
    applications = 2  # block calls per forward: two blocks, or one block twice
    for rank, result in enumerate(results):
        got = result[name]
        if isinstance(got, str):
            pytest.fail(got, pytrace=False)
        if case.planned:
            assert all(applications < calls < 2 * applications for calls in got["calls"]), got["calls"]
        else:
            assert got["calls"] == [applications * (2 if case.reruns else 1)] * STEPS, (
                f"rank {rank}: a block's body ran {got['calls']} times per step"
            )
        assert len(got["grads"]) == len(expected["grads"]) == STEPS
        for step, (ours, theirs) in enumerate(zip(got["grads"], expected["grads"], strict=True)):
            assert ours.keys() == theirs.keys(), f"rank {rank}, step {step}: parameter names differ"
            for param, grad in theirs.items():
                torch.testing.assert_close(
                    ours[param], grad, msg=lambda m, r=rank, s=step, n=param: f"rank {r}, step {s}, {n}: {m}"
                )


def test_torch_reentrant_checkpoint_fails_on_the_shared_block(results: list[dict[str, Any]]) -> None:
    """The control: where `ddp_decorated_forward_shared_block` passes, torch's reentrant checkpoint raises."""
    for result in results:
        assert isinstance(result[CONTROL], str), "torch's reentrant checkpoint no longer fails here"
        assert "Expected to mark a variable ready only once" in result[CONTROL], result[CONTROL]


def test_reference_is_not_trivial(references: dict[bool, dict[str, list[Any]]]) -> None:
    """The comparison means something: every gradient is nonzero and the two steps differ."""
    for reference in references.values():
        assert reference["calls"] == [2] * STEPS
        first, second = reference["grads"]
        for name, grad in first.items():
            assert grad.abs().sum() > 0, name
        assert any(not torch.equal(first[n], second[n]) for n in first)
