"""Tiles under FSDP2 and DeepSpeed ZeRO-3 (NOTE [ What is tiled ], rule 4): 2 processes on CPU with gloo.

Each rank takes half of a fixed float64 batch and runs two training steps of a small model whose blocks' MLPs run
in tiles (with and without remat of the blocks); the full parameter gradients after each backward equal a
single-process run without tiles or remat on the whole batch. Each step also counts the gathers of each parameter
(FSDP2's all-gathers of a parameter group, ZeRO-3's all-gathers of a parameter) in forward and in backward: with
tiles they are those of the same model without tiles (with remat of the blocks, fewer: their recompute stops
before the tiles), so no parameter is gathered once per tile. DeepSpeed tests are
skipped where deepspeed is absent.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
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

pytestmark = pytest.mark.slow  # two gloo ranks (torch.multiprocessing.spawn): NOTE [ Slow tests ] in tests/conftest.py

WORLD, WIDTH, HIDDEN, LENGTH, BATCH, STEPS, LR, TILES = 2, 8, 24, 12, 4, 2, 0.1, 4
DEADLINE_S = 900.0  # DeepSpeed builds its communication op on its first use on a machine (minutes)
MLP_CALLS = [0]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        MLP_CALLS[0] += 1  # per tile with tiles: shows that tiling happened
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(x).cumsum(1) / LENGTH  # something not token-wise before the MLP
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(42)
    return (torch.randn(BATCH, LENGTH, WIDTH, generator=generator, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=generator, dtype=torch.float64))


def tile(net: Net) -> Net:
    for block in net.blocks:
        remat.tiled(block.mlp, dim=1, tiles=TILES)
    return net


# --- FSDP2 -------------------------------------------------------------------------------------------------


def fsdp2(tiles: bool, rematerialized: bool, mlp_sharded: bool = False) -> Callable[[], Any]:
    def build() -> Any:
        from torch.distributed.fsdp import fully_shard

        net = make_net()
        if tiles:
            tile(net)
        if rematerialized:
            remat.apply(net, Block)
        for block in net.blocks:
            if mlp_sharded:
                fully_shard(block.mlp)
            fully_shard(block)
        return fully_shard(net)

    return build


def train_fsdp2(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    gathers: Counter[str] = Counter()
    phase = ["forward"]
    original = group.foreach_all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers[phase[0]] += 1
        return original(*args, **kwargs)

    group.foreach_all_gather = counted
    try:
        return _train(model, x, y, phase, gathers, lambda loss: loss.backward(), fsdp2_full_grads)
    finally:
        group.foreach_all_gather = original



# --- DeepSpeed ZeRO-3 --------------------------------------------------------------------------------------


ZERO3 = zero3_config(BATCH, WORLD, LR)


def zero3(tiles: str, rematerialized: bool) -> Callable[[], Any]:
    """`tiles`: "" (none), "before" or "after" `deepspeed.initialize`."""

    def build() -> Any:
        import deepspeed

        net = make_net()
        if tiles == "before":
            tile(net)
        if rematerialized:
            remat.apply(net, Block)
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=ZERO3)
        if tiles == "after":
            tile(engine.module)
        return engine

    return build


def train_zero3(engine: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    gathers: Counter[str] = Counter()
    phase = ["forward"]
    for param in engine.module.parameters():
        original = param.all_gather_coalesced

        def counted(params: Any, *args: Any, original: Any = original, **kwargs: Any) -> Any:
            gathers[phase[0]] += len(list(params))
            return original(params, *args, **kwargs)

        param.all_gather_coalesced = counted
    return _train(engine, x, y, phase, gathers, engine.backward, zero3_full_grads, engine.step)


# --- training ----------------------------------------------------------------------------------------------


def _train(model: Any, x: torch.Tensor, y: torch.Tensor, phase: list[str], gathers: Counter[str],
           backward: Callable[[torch.Tensor], Any], grads_of: Callable[[Any], dict[str, torch.Tensor]],
           step: Callable[[], Any] | None = None) -> dict[str, Any]:
    return train_steps(model, lambda m: F.mse_loss(m(x), y), STEPS, LR, phase, gathers, backward, grads_of, step,
                       calls=lambda: MLP_CALLS[0])


CASES: dict[str, tuple[Callable[[], Any], Callable[..., dict[str, Any]]]] = {
    "fsdp2": (fsdp2(False, False), train_fsdp2),
    "fsdp2_tiles": (fsdp2(True, False), train_fsdp2),
    "fsdp2_remat": (fsdp2(False, True), train_fsdp2),
    "fsdp2_remat_tiles": (fsdp2(True, True), train_fsdp2),
    "fsdp2_mlp_sharded": (fsdp2(False, False, mlp_sharded=True), train_fsdp2),
    "fsdp2_mlp_sharded_tiles": (fsdp2(True, False, mlp_sharded=True), train_fsdp2),
    "zero3": (zero3("", False), train_zero3),
    "zero3_tiles_before_init": (zero3("before", False), train_zero3),
    "zero3_tiles_after_init": (zero3("after", False), train_zero3),
    "zero3_remat": (zero3("", True), train_zero3),
    "zero3_remat_tiles_before_init": (zero3("before", True), train_zero3),
}
DEEPSPEED = [name for name in CASES if name.startswith("zero3")]


def _rank(rank: int, port: int, out: str, names: list[str]) -> None:
    warnings.simplefilter("ignore")  # DeepSpeed and FSDP2 warn about CPU and float64 set-ups
    x, y = batch()
    share = BATCH // WORLD
    run_cases(rank, port, WORLD, out, names,
              build_and_train(CASES, x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return ranks_results(_rank, tmp_path_factory.mktemp("tiles_distributed"), CASES, DEEPSPEED, WORLD, DEADLINE_S)


@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    """Single process, whole batch, no tiles, no remat: full gradients after each step."""
    model = make_net()
    x, y = batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})  # type: ignore[union-attr]
        optimizer.step()
    return grads


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_equal_a_single_process_without_tiles(
    name: str, results: list[dict[str, Any]], reference: list[dict[str, torch.Tensor]]
) -> None:
    per_mlp = 2 * TILES if "tiles" in name else 2 if "remat" in name else 1  # with remat of the blocks, their
    calls = [2 * per_mlp] * STEPS  # recompute stops before the tiles: forward's tiles and backward's, per MLP
    for rank, got in enumerate(case_results(results, name, DEEPSPEED)):
        assert got["calls"] == calls, f"rank {rank}: the MLPs ran {got['calls']} times per step"
        for step, (ours, theirs) in enumerate(zip(got["grads"], reference, strict=True)):
            assert_full_gradients_close(ours, theirs, step)


@pytest.mark.parametrize("name", [name for name in CASES if "tiles" in name])
def test_parameters_are_gathered_no_more_than_without_tiles(name: str, results: list[dict[str, Any]]) -> None:
    """As often as without tiles; with remat of the blocks, less (their recompute stops before the tiles)."""
    untiled = name.replace("_tiles", "").replace("_before_init", "").replace("_after_init", "")
    tiled, plain_runs = (case_results(results, case, DEEPSPEED) for case in (name, untiled))
    for ours, theirs in zip(tiled, plain_runs, strict=True):
        for mine, plain in zip(ours["gathers"], theirs["gathers"], strict=True):
            assert mine.keys() == plain.keys(), (ours["gathers"], theirs["gathers"])
            if "remat" in name:
                assert all(mine[phase] <= plain[phase] for phase in plain), (ours["gathers"], theirs["gathers"])
            else:
                assert mine == plain, (ours["gathers"], theirs["gathers"])
        assert all(gathers.get("forward", 0) > 0 for gathers in ours["gathers"]), "the counter saw no gather"
