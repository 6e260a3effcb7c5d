"""`remat.tiled` (docs/guides/long-sequences.md, NOTE [ Tiles ] and NOTE [ What is tiled ]): token-wise work over the
positions in tiles, gradients equal to the untiled call's in float64, and proof that it ran in tiles: each tile's
shape is seen by the function, backward's peak shrinks with the tile count, and an enclosing site's recompute does
not run the tiles again.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_grads
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._engine import stats as _stats
from remat._sites.tiles import TiledForward, not_token_wise, tile_blocks

pytestmark = pytest.mark.usefixtures("float64_default")

WIDTH, HIDDEN, SEQ = 8, 24, 12


class GatedMLP(nn.Module):
    """A Llama-style gated MLP that records the shape of every input it is called on."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(dropout)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(x.shape))
        return self.drop(self.down(F.silu(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    """Pre-norm residual block: a norm, the MLP (tiled or not), the residual."""

    def __init__(self, tiles: int | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = GatedMLP(dropout)
        self.tiles = tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = self.mlp(h) if self.tiles is None else remat.tiled(self.mlp, h, dim=1, tiles=self.tiles)
        return x + out


def inputs(batch: int = 2, seq: int = SEQ) -> tuple[torch.Tensor]:
    return (torch.randn(batch, seq, WIDTH, generator=torch.Generator().manual_seed(3), requires_grad=True),)


def tiled_call(tiles: int, dim: int = 1) -> Callable[[nn.Module], Callable[..., Any]]:
    return lambda mlp: lambda x: remat.tiled(mlp, x, dim=dim, tiles=tiles)


# -- the functional form ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiles", [1, 3, 5, 12, 40])
def test_tiled_gradients_equal_untiled_and_each_tile_ran_alone(tiles: int) -> None:
    before = _stats.tiles
    _, ours = assert_same_grads(GatedMLP, inputs(), tiled_call(tiles))
    count = min(tiles, SEQ)
    assert _stats.tiles - before == count
    sizes = [shape[1] for shape in ours.target.seen]
    assert len(sizes) == 2 * count, "forward and backward each call the MLP once per tile"
    assert sum(sizes[:count]) == sum(sizes[count:]) == SEQ and max(sizes) == -(-SEQ // count)


def test_tiles_shrink_backwards_peak_by_the_tile_count() -> None:
    mlp = GatedMLP().float()
    x = torch.randn(1, 4096, WIDTH, dtype=torch.float32, requires_grad=True)

    def peak(tiles: int | None) -> int:
        with remat.track() as tracker:
            out = mlp(x) if tiles is None else remat.tiled(mlp, x, tiles=tiles)
            out.sum().backward()
        return tracker.peak_bytes

    untiled, eight = peak(None), peak(8)
    intermediates = 4 * 4096 * HIDDEN * 4  # gate, up, silu(gate), their product
    assert untiled - eight > 0.6 * intermediates, (untiled, eight)


def test_tiled_along_another_dimension_and_a_plain_function() -> None:
    weight = torch.randn(WIDTH, WIDTH, requires_grad=True)

    def make() -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: torch.tanh(x @ weight) * 2  # the closure's weight gets its gradient

    x = torch.randn(SEQ, 3, WIDTH, requires_grad=True)
    plain = torch.autograd.grad(make()(x).sum(), (x, weight))
    ours = torch.autograd.grad(remat.tiled(make(), x, dim=0, tiles=4).sum(), (x, weight))
    for expected, got in zip(plain, ours, strict=True):
        torch.testing.assert_close(got, expected)


def test_extra_arguments_go_whole_to_every_tile() -> None:
    scale = torch.randn(WIDTH, requires_grad=True)

    def fn(x: torch.Tensor, scale: torch.Tensor, *, shift: float) -> torch.Tensor:
        assert scale.shape == (WIDTH,)
        return x * scale + shift

    x = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    plain = torch.autograd.grad(fn(x, scale, shift=1.0).pow(2).sum(), (x, scale))
    ours = torch.autograd.grad(remat.tiled(fn, x, scale, shift=1.0, tiles=3).pow(2).sum(), (x, scale))
    for expected, got in zip(plain, ours, strict=True):
        torch.testing.assert_close(got, expected)


def test_a_parameter_shaped_like_the_positions_goes_whole() -> None:
    """NOTE [ What is tiled ], rule 1: a weight whose first size is the number of positions was tiled with the input
    (`F.linear` gave 16 features for 64)."""
    x = torch.randn(64, WIDTH, requires_grad=True)
    weight = nn.Parameter(torch.randn(64, WIDTH))
    expected = torch.autograd.grad(F.linear(x, weight).pow(2).sum(), (x, weight))
    out = remat.tiled(F.linear, x, weight, dim=0, tiles=4)
    assert out.shape == (64, 64)
    for want, got in zip(expected, torch.autograd.grad(out.pow(2).sum(), (x, weight)), strict=True):
        torch.testing.assert_close(got, want)


def test_a_parameters_gradient_is_accumulated_once_per_backward() -> None:
    mlp = GatedMLP()
    calls = {name: 0 for name, _ in mlp.named_parameters()}
    for name, param in mlp.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls[name] + 1))
    x = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    remat.tiled(mlp, x, tiles=4).sum().backward()
    assert set(calls.values()) == {1}, calls


def test_a_gradient_hook_on_a_parameter_runs_once_on_the_sum() -> None:
    """NOTE [ Tiles ], rule 2: hooks of `register_hook` ran on each tile's gradient and again on the sum (a hook
    halving the gradient gave a quarter of it, with four tiles)."""

    def halved(tiles: int | None) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        mlp, calls = GatedMLP(), [0]

        def hook(grad: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return grad * 0.5

        for param in mlp.parameters():
            param.register_hook(hook)
        x = torch.randn(2, SEQ, WIDTH, requires_grad=True, generator=torch.Generator().manual_seed(1))
        (mlp(x) if tiles is None else remat.tiled(mlp, x, tiles=tiles)).pow(2).sum().backward()
        return [x.grad, *(p.grad for p in mlp.parameters())], calls[0]  # type: ignore[list-item]

    expected, calls = halved(None)
    before = _stats.tiles
    got, tiled_calls = halved(4)
    assert _stats.tiles - before == 4  # backward ran four tiles
    assert tiled_calls == calls == 4  # once per parameter
    torch.testing.assert_close(got, expected)


def test_a_parameter_whose_gradient_is_the_incoming_one() -> None:
    """A tile of one position and a bias of its shape: the bias's first gradient was the incoming gradient itself,
    which the next tile's was added to in place, changing the gradient another branch reads (or raising where it
    was expanded)."""

    class AddBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(1, 1, WIDTH))

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t * 2 + self.bias

    x = torch.randn(1, 4, WIDTH)
    weights = torch.arange(4 * WIDTH, dtype=torch.float64).view(1, 4, WIDTH)
    grads = []
    for tiles in (None, 4):
        torch.manual_seed(0)
        module, other = AddBias(), torch.ones(1, 4, WIDTH, requires_grad=True)
        out = module(x) if tiles is None else remat.tiled(module, x, tiles=tiles)
        ((other * 3 + out) * weights).sum().backward()  # one gradient tensor for both branches
        grads.append([module.bias.grad, other.grad])
        module.bias.grad = None
        (module(x) if tiles is None else remat.tiled(module, x, tiles=tiles)).sum().backward()  # expanded
        grads[-1].append(module.bias.grad)
    torch.testing.assert_close(grads[1], grads[0])


def test_a_forward_with_other_parameters_is_a_mismatch() -> None:
    """NOTE [ Tiles ], rule 10: under `functional_call` backward's tiles ran with the module's own parameters (the
    input gradient off by 1.4, the given parameters without gradients), without a word."""
    torch.manual_seed(0)
    mlp = remat.tiled(GatedMLP(), tiles=3)
    given = {name: (p.detach() + 0.1).requires_grad_() for name, p in mlp.named_parameters()}
    x = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    out = torch.func.functional_call(mlp, given, (x,))
    with pytest.raises(remat.RecomputeMismatchError, match=r"tiled `GatedMLP` ran in forward with another tensor "
                       r"in place of its parameter `gate.weight` \(`torch.func.functional_call`"):
        out.sum().backward()
    with remat.enabled(False):
        torch.func.functional_call(mlp, given, (x,)).sum().backward()
    assert all(p.grad is not None for p in given.values())


def test_autograd_grad_on_parameters_and_a_subset() -> None:
    mlp = GatedMLP()
    x = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    params = list(mlp.parameters())
    expected = torch.autograd.grad(mlp(x).pow(2).sum(), params)
    got = torch.autograd.grad(remat.tiled(mlp, x, tiles=5).pow(2).sum(), params)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a)
    assert x.grad is None and all(p.grad is None for p in params), "autograd.grad accumulates nothing"


@pytest.mark.parametrize("loss", ["squares", "sum"])
@pytest.mark.parametrize("where", ["alone", "in a rematerialized block"])
def test_double_backward_through_tiles(where: str, loss: str) -> None:
    """NOTE [ Tiles ], rule 6: a gradient penalty's gradients, the input's and what is upstream of it included
    (their second-order part through the tiled input was missing: the input's off by 0.6, silently, or None)."""
    torch.manual_seed(0)
    block = Block().double()
    x = torch.randn(2, SEQ, WIDTH, dtype=torch.float64, requires_grad=True)
    of = {"squares": lambda out: out.pow(2).sum(), "sum": lambda out: out.sum()}[loss]

    def penalty(model: nn.Module) -> torch.Tensor:
        h = x * 1.5  # upstream of the block, not a leaf
        (grad,) = torch.autograd.grad(of(model(h)), h, create_graph=True)
        return grad.pow(2).sum()

    leaves = [x, *block.parameters()]
    expected = torch.autograd.grad(penalty(block), leaves, allow_unused=True)
    tiled = copy.deepcopy(block)
    tiled.tiles = 3
    if where != "alone":
        remat(tiled)
    before = _stats.tiles
    got = torch.autograd.grad(penalty(tiled), [x, *tiled.parameters()], allow_unused=True)
    assert _stats.tiles > before
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a)


def test_retain_graph_backward_twice() -> None:
    assert_same_grads(GatedMLP, inputs(), tiled_call(4), backward=lambda loss, leaves: (
        loss.backward(retain_graph=True), [t.grad.zero_() for t in leaves if t.grad is not None], loss.backward()))


def test_input_not_requiring_grad_and_frozen_parameters() -> None:
    mlp = GatedMLP()
    mlp.gate.weight.requires_grad_(False)
    x = torch.randn(2, SEQ, WIDTH)
    mlp(x).pow(2).sum().backward()
    expected = {name: p.grad.clone() for name, p in mlp.named_parameters() if p.grad is not None}
    mlp.zero_grad(set_to_none=True)
    remat.tiled(mlp, x, tiles=4).pow(2).sum().backward()
    got = {name: p.grad for name, p in mlp.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and "gate.weight" not in got
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad)


def test_without_grad_the_call_is_tiled_and_equal() -> None:
    mlp = GatedMLP()
    x = torch.randn(2, SEQ, WIDTH)
    with torch.no_grad():
        expected = mlp(x)
        mlp.seen.clear()
        got = remat.tiled(mlp, x, tiles=4)
    torch.testing.assert_close(got, expected)
    assert [shape[1] for shape in mlp.seen] == [3, 3, 3, 3]


def test_switch_off_is_the_plain_call() -> None:
    mlp = GatedMLP()
    x = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    with remat.enabled(False):
        remat.tiled(mlp, x, tiles=4).sum().backward()
    assert mlp.seen == [(2, SEQ, WIDTH)]


# -- inside a rematerialized block --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_inside_a_rematerialized_block_whose_recompute_stops_before_the_tiles(strategy: str) -> None:
    def variant(block: nn.Module) -> nn.Module:
        block.tiles = 4
        return remat(block, strategy=strategy)

    before = _stats.tiles
    _, ours = assert_same_grads(Block, inputs(), variant)
    assert _stats.tiles - before == 4
    # forward's four tiles and backward's four: the block's recompute stopped when the MLP's input was back
    assert [shape[1] for shape in ours.target.mlp.seen] == [3] * 8


def test_a_block_whose_recompute_needs_the_tiles_output_runs_them_again() -> None:
    class PostNorm(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x + remat.tiled(self.mlp, x, dim=1, tiles=self.tiles or 1))

    def variant(block: nn.Module) -> nn.Module:
        block.tiles = 3
        return remat(block)

    _, ours = assert_same_grads(PostNorm, inputs(), variant)
    assert [shape[1] for shape in ours.target.mlp.seen] == [4] * 9  # forward, recompute, backward


def test_tiles_in_a_rematerialized_block_keep_the_peak_down() -> None:
    def peak(tiles: int | None) -> int:
        torch.manual_seed(0)
        block = remat(Block(tiles).float())
        x = torch.randn(1, 4096, WIDTH, dtype=torch.float32, requires_grad=True)
        with remat.track() as tracker:
            block(x).sum().backward()
        return tracker.peak_bytes

    intermediates = 4 * 4096 * HIDDEN * 4
    assert peak(None) - peak(8) > 0.6 * intermediates


def test_the_kept_input_goes_with_the_backward() -> None:
    """What backward needs hangs on the graph's node: dropped once backward ran, not when the output goes."""
    mlp = GatedMLP()
    x = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    h = x * 2
    kept = weakref.ref(h)
    loss = remat.tiled(mlp, h, tiles=3).sum()
    del h
    gc.collect()
    assert kept() is not None, "backward needs it"
    loss.backward()
    gc.collect()
    assert kept() is None, "the tiles' input outlived backward while the loss is alive"
    del loss


def test_an_input_changed_in_place_before_backward_raises() -> None:
    mlp = GatedMLP()
    h = torch.randn(2, SEQ, WIDTH, requires_grad=True) * 1
    out = remat.tiled(mlp, h, tiles=3)
    with torch.no_grad():
        h.mul_(2)
    with pytest.raises(remat.RematError, match="modified by an inplace operation"):
        out.sum().backward()


class ScaledMLP(nn.Module):
    """An MLP that also reads a buffer and a tensor from a closure, neither requiring grad, both saved by autograd
    (a multiplication's other operand)."""

    def __init__(self, extra: torch.Tensor) -> None:
        super().__init__()
        self.mlp = GatedMLP()
        self.register_buffer("scale", torch.rand(WIDTH) + 0.5)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mlp(x) * self.scale) * self.extra


@pytest.mark.parametrize("changed", ["weight", "frozen weight", "buffer", "closure"])
def test_a_read_changed_in_place_before_backward_raises(changed: str) -> None:
    """NOTE [ Tiles ], rule 9: as autograd raises without tiles, never a gradient of the changed value (this gave
    one before the reads' versions were checked)."""
    extra = torch.rand(WIDTH) + 0.5
    module = ScaledMLP(extra)
    if changed == "frozen weight":
        module.mlp.up.weight.requires_grad_(False)
    target = {"weight": module.mlp.gate.weight, "frozen weight": module.mlp.up.weight, "buffer": module.scale,
              "closure": extra}[changed]
    h = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    plain = module(h)
    with torch.no_grad():
        target.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain.sum().backward()  # the baseline: autograd's own check
    with torch.no_grad():
        target.div_(2)
    out = remat.tiled(module, h, tiles=3, dim=1)
    with torch.no_grad():
        target.mul_(2)
    with pytest.raises(remat.RematError, match=r"modified by an inplace operation: a tensor of shape \[\d+(, \d+)?\] "
                       r"that the tiled `ScaledMLP` reads"):
        out.sum().backward()


def test_reads_unchanged_since_forward_pass_backward_twice() -> None:
    """The reads' versions are checked, not their identity: an unchanged buffer passes, twice with `retain_graph`,
    and gradients equal the untiled call's."""
    module = ScaledMLP(torch.rand(WIDTH) + 0.5)
    h = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    expected = torch.autograd.grad(module(h).sum(), [h, *module.parameters()])
    module.mlp.seen.clear()
    out = remat.tiled(module, h, tiles=3, dim=1).sum()
    for _ in range(2):
        got = torch.autograd.grad(out, [h, *module.parameters()], retain_graph=True)
        torch.testing.assert_close(got, expected)
    assert module.mlp.seen == [(2, SEQ // 3, WIDTH)] * 9, "forward's tiles, then each backward's"


# -- chained tiles (NOTE [ Tiles ], rule 7) ----------------------------------------------------------------


class NormThenMLP(nn.Module):
    """A norm and the MLP after it, each tiled on its own; `also` uses the norm's output besides the MLP, `change`
    changes it in place first."""

    def __init__(self, also: bool = False, change: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = GatedMLP()
        self.also, self.change = also, change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.change:
            h.mul_(2)
        out = x + self.mlp(h)
        return out + h.pow(2) if self.also else out


def _tile_both(block: nn.Module) -> nn.Module:
    remat.tiled(block.norm, tiles=3, dim=1)
    remat.tiled(block.mlp, tiles=3, dim=1)
    return block


def test_an_mlp_after_a_tiled_norm_runs_with_it_and_keeps_only_the_norms_input() -> None:
    before = _stats.tiles
    assert_same_grads(NormThenMLP, inputs(), _tile_both, expect_recompute=False)
    assert _stats.tiles - before == 3, "one chained call: the norm's node ran no backward of its own"
    block = _tile_both(NormThenMLP())
    outputs: list[weakref.ref[torch.Tensor]] = []
    block.norm.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    loss = block(inputs()[0]).sum()
    gc.collect()
    assert outputs[0]() is None, "the norm's output is not kept for backward"
    loss.backward()


@pytest.mark.parametrize("also, change", [(True, False), (False, True)], ids=["another-user", "changed-in-place"])
def test_a_chain_keeps_gradients_where_the_norms_output_has_another_user_or_changed(also: bool,
                                                                                    change: bool) -> None:
    before = _stats.tiles
    assert_same_grads(lambda: NormThenMLP(also, change), inputs(), _tile_both, expect_recompute=False)
    # another user: the chained call's tiles and the norm's own (its output's gradient from that user);
    # changed in place: the norm's and the MLP's tiles, not chained
    assert _stats.tiles - before == 6


def test_no_chain_after_a_module_that_gathers_its_parameters_for_its_own_call() -> None:
    """ZeRO-3 (marked by `ds_id`, as remat reads it) has a module's parameters only inside its call: the MLP may not
    run the norm again inside its own."""

    def sharded_norm(block: nn.Module) -> nn.Module:
        for param in _tile_both(block).norm.parameters():
            param.ds_id = 0  # type: ignore[attr-defined]
        return block

    before = _stats.tiles
    assert_same_grads(NormThenMLP, inputs(), sharded_norm, expect_recompute=False)
    assert _stats.tiles - before == 6


def test_no_chain_after_a_function_that_draws_random_numbers_or_reads_a_matrix() -> None:
    mlp, other = GatedMLP(), GatedMLP()
    x = inputs()[0]
    before = _stats.tiles
    torch.manual_seed(0)
    h = remat.tiled(lambda t: F.dropout(t, 0.5), x, dim=1, tiles=3)
    out = remat.tiled(mlp, h, dim=1, tiles=3)
    torch.testing.assert_close(out, mlp(h), msg="the MLP saw the dropout's output, not a mask of its own")
    out.sum().backward()
    h = remat.tiled(other, x, dim=1, tiles=3)
    remat.tiled(mlp, h, dim=1, tiles=3).sum().backward()
    assert _stats.tiles - before == 12, "no chain: each tiled call ran its backward"


def test_no_chain_across_an_autocast_change() -> None:
    block = _tile_both(NormThenMLP()).float()
    x = torch.randn(2, SEQ, WIDTH, dtype=torch.float32, requires_grad=True)
    before = _stats.tiles
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = block.norm(x)
    out = block.mlp(h)
    assert out.dtype == torch.float32
    out.float().sum().backward()
    assert _stats.tiles - before == 6


class PostNorm(nn.Module):
    """A post-norm block as openai-gpt writes it: the norm's input a temporary, its output used twice (the MLP and the
    residual). Under remat the temporary is let go of in forward and kept by the recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = GatedMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.inner(x))
        return h + self.mlp(h)


def test_a_chain_is_the_same_in_forward_and_in_the_recompute_where_the_norms_input_is_a_temporary() -> None:
    """Forward let the temporary go before the MLP's call and did not chain, the recompute kept it and chained: the
    MLP's backward ran on the norm's input in place of its output, a silent wrong gradient (openai-gpt)."""
    before = _stats.tiles
    assert_same_grads(PostNorm, inputs(), lambda block: remat.remat(_tile_both(block)))
    assert _stats.tiles - before == 6, "chained in forward and in the recompute: the chained call's tiles and the " \
        "norm's own (its output's gradient from the residual)"


class Blocks(nn.Module):
    """Two rematerialized blocks: the first ends in a tiled norm, the second starts with a tiled MLP on its input."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, WIDTH), GatedMLP()
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ending(x)
        return h * 2 + self.starting(h)

    def ending(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.first(x))

    def starting(self, h: torch.Tensor) -> torch.Tensor:
        return self.second(h)


def test_no_chain_across_a_sites_boundary() -> None:
    """A tiled call never chains onto one made under other saved-tensor hooks (another site's forward, or outside
    the recompute it runs in): in the recompute the earlier call is not there to chain onto."""

    def sites(model: nn.Module) -> nn.Module:
        remat.tiled(model.norm, tiles=3, dim=1)
        remat.tiled(model.second, tiles=3, dim=1)
        model.ending, model.starting = remat.remat(model.ending), remat.remat(model.starting)
        return model

    assert_same_grads(Blocks, inputs(), sites)


def test_the_last_tiled_call_holds_nothing_once_its_output_is_gone() -> None:
    """What a later call would chain onto (the function, its input) is let go of with the output: a model dropped
    after its step is freed, without another tiled call first."""
    norm = remat.tiled(nn.LayerNorm(WIDTH), tiles=3, dim=1)
    x = inputs()[0]
    out = norm(x)
    out.sum().backward()
    dropped, kept = weakref.ref(norm), weakref.ref(x)
    del norm, out, x
    gc.collect()
    assert dropped() is None and kept() is None


# -- RNG and autocast ---------------------------------------------------------------------------------------


def test_dropout_draws_per_tile_and_backward_draws_the_same_masks() -> None:
    """The reference is the MLP called on each tile in turn without remat: same masks, same gradients, same RNG
    state after backward."""

    def per_tile(mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: torch.cat([mlp(part) for part in x.split(4, dim=1)], dim=1)

    def make() -> nn.Module:
        return GatedMLP(dropout=0.5)

    x = inputs()[0]
    results = []
    for wrap in (per_tile, lambda mlp: lambda t: remat.tiled(mlp, t, dim=1, tiles=3)):
        torch.manual_seed(0)
        mlp = make()
        leaf = x.detach().clone().requires_grad_()
        torch.manual_seed(1)
        out = wrap(mlp)(leaf)
        out.pow(2).sum().backward()
        results.append((out.detach(), leaf.grad, [p.grad for p in mlp.parameters()], torch.get_rng_state()))
    (out_a, gx_a, gp_a, rng_a), (out_b, gx_b, gp_b, rng_b) = results
    torch.testing.assert_close(out_b, out_a)
    torch.testing.assert_close(gx_b, gx_a)
    for a, b in zip(gp_a, gp_b, strict=True):
        torch.testing.assert_close(b, a)
    assert torch.equal(rng_a, rng_b)
    assert (out_a == 0).any(), "dropout dropped something"


@pytest.mark.filterwarnings("ignore:remat.*has a forward hook")  # the hook only reads a dtype
def test_autocast_in_forward_is_autocast_in_backward() -> None:
    mlp = GatedMLP().float()
    dtypes: list[torch.dtype] = []
    mlp.up.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    x = torch.randn(2, SEQ, WIDTH, dtype=torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = mlp(x)
    expected.float().pow(2).sum().backward()
    want = [x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    dtypes.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = remat.tiled(mlp, x, tiles=4)
    got.float().pow(2).sum().backward()
    assert got.dtype == expected.dtype == torch.bfloat16
    assert dtypes == [torch.bfloat16] * 8, "backward's calls ran under forward's autocast"
    for a, b in zip(want, [x.grad, *(p.grad for p in mlp.parameters())], strict=True):
        torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward after the region", "backward in the region"])
def test_autocast_gradients_whatever_autocast_cached_before(calls: int, backward_inside: bool) -> None:
    """NOTE [ Tiles ], implementation note 5. Autocast caches a weight's cast for its region. A second call of the
    tiled module in one region took its casts from the cache, so its tiles never read the weights: their gradients
    lost the second call's share (84% off). With backward run inside the region, the first call's cast was both a
    read of the tiles and the cast backward used: the weights' gradients counted twice (100% off)."""
    torch.manual_seed(0)
    mlp = GatedMLP().float()
    x = torch.randn(2, SEQ, WIDTH, dtype=torch.float32)

    def grads(tiles: int | None) -> list[torch.Tensor]:
        model = copy.deepcopy(mlp)
        h = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = h
            for _ in range(calls):
                out = model(out.float()) if tiles is None else remat.tiled(model, out.float(), tiles=tiles)
            loss = out.float().pow(2).sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        if tiles is not None:
            assert (2, SEQ // tiles, WIDTH) in model.seen, "ran in tiles"
        return [h.grad, *(p.grad for p in model.parameters())]

    for a, b in zip(grads(None), grads(4), strict=True):  # bfloat16's rounding, of the largest gradient
        torch.testing.assert_close(b, a, atol=2e-2 * a.abs().max().item(), rtol=0)


class _CastsOf(TorchDispatchMode):
    """Counts the casts (`aten._to_copy`) of the tensors whose storages are `storages`."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages, self.count = storages, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.storages:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_backward_casts_each_weight_once_for_all_tiles_as_forward_does() -> None:
    """Autocast keeps a weight's cast for its region and drops it when the outermost region exits: re-entered per
    tile in backward, each tile cast every weight again (a copy of the MLP's weights in the lower precision per
    tile, on a GPU about the time of the tile's matmuls). Backward's casts now stay for all the tiles; the
    gradients, and a second derivative, are the untiled ones to bfloat16's rounding."""
    def casts_in_backward(tiles: int, create_graph: bool = False) -> tuple[int, list[torch.Tensor]]:
        torch.manual_seed(0)
        mlp = GatedMLP().float()
        x = torch.randn(2, SEQ, WIDTH, dtype=torch.float32, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = remat.tiled(mlp, x, tiles=tiles)
        loss = out.float().pow(2).sum()
        weights = {p.data_ptr() for p in mlp.parameters()}
        with _CastsOf(weights) as seen:
            grads = torch.autograd.grad(loss, [x, *mlp.parameters()], create_graph=create_graph)
        if create_graph:
            grads = torch.autograd.grad(sum(g.float().pow(2).sum() for g in grads), [x, *mlp.parameters()])
        return seen.count, list(grads)

    once, _ = casts_in_backward(4)
    assert once == len(list(GatedMLP().parameters())), "each weight cast once"
    for create_graph in (False, True):
        _, untiled = casts_in_backward(1, create_graph)
        _, tiled = casts_in_backward(4, create_graph)
        for a, b in zip(untiled, tiled, strict=True):  # bfloat16's rounding, of the largest gradient
            torch.testing.assert_close(b, a, atol=2e-2 * a.abs().max().item(), rtol=0)


# -- the in-place form --------------------------------------------------------------------------------------


def test_in_place_form_keeps_the_instance_and_undo_takes_it_off() -> None:
    block = Block()
    keys = list(block.state_dict())
    mlp = block.mlp
    assert remat.tiled(mlp, tiles=4) is mlp and type(mlp) is GatedMLP
    assert list(block.state_dict()) == keys
    x = inputs()[0]
    _, ours = assert_same_grads(Block, inputs(), lambda block: remat.tiled(block.mlp, tiles=4) and block)
    assert [shape[1] for shape in ours.target.mlp.seen] == [3] * 8
    assert isinstance(mlp.__dict__["forward"], TiledForward)
    remat.undo(block)
    assert "forward" not in mlp.__dict__
    mlp.seen.clear()
    block(x)
    assert mlp.seen == [tuple(x.shape)]


def test_in_place_form_runs_the_modules_hooks_once_per_call() -> None:
    mlp = remat.tiled(GatedMLP(), tiles=4)
    calls: list[int] = []
    mlp.register_forward_pre_hook(lambda module, args: calls.append(1))
    mlp(torch.randn(2, SEQ, WIDTH, requires_grad=True)).sum().backward()
    assert len(calls) == 1 and len(mlp.seen) == 8


def test_in_place_form_copies_pickles_and_keeps_its_signature() -> None:
    import inspect

    mlp = remat.tiled(GatedMLP(), tiles=4)
    x = torch.randn(2, SEQ, WIDTH)
    for other in (copy.deepcopy(mlp), pickle.loads(pickle.dumps(mlp))):
        assert isinstance(other.__dict__["forward"], TiledForward)
        other.seen.clear()
        torch.testing.assert_close(other(x), mlp(x))
        assert len(other.seen) == 4
    assert list(inspect.signature(mlp.forward).parameters) == ["x"]
    mlp.seen.clear()
    mlp(x=x)  # the input by keyword
    assert len(mlp.seen) == 4


def test_in_place_form_under_a_site_and_retiled() -> None:
    block = Block()
    remat.tiled(block.mlp, tiles=4)
    remat(block.mlp)  # a site over the tiled forward
    remat.tiled(block.mlp, tiles=2)  # the same module tiled again: the new count
    block.mlp.seen.clear()
    block(inputs()[0]).sum().backward()
    assert [shape[1] for shape in block.mlp.seen] == [6, 6, 6, 6]
    remat.undo(block)
    assert "forward" not in block.mlp.__dict__


def test_compiled_runs_untiled_with_one_warning() -> None:
    mlp = remat.tiled(GatedMLP(), tiles=4)
    x = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    expected = torch.autograd.grad(GatedMLP.forward(mlp, x).pow(2).sum(), list(mlp.parameters()))
    compiled = torch.compile(mlp, backend="eager")
    with pytest.warns(UserWarning, match="runs untiled under torch.compile"):
        got = torch.autograd.grad(compiled(x).pow(2).sum(), list(mlp.parameters()))
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a)
    torch._dynamo.reset()


# -- what is refused ----------------------------------------------------------------------------------------


def test_bad_arguments_are_clear_errors() -> None:
    mlp = GatedMLP()
    x = torch.randn(2, SEQ, WIDTH)
    with pytest.raises(ValueError, match=r"`tiles` must be a positive int .* got 0"):
        remat.tiled(mlp, x, tiles=0)
    with pytest.raises(ValueError, match=r"`tiles` must be a positive int"):
        remat.tiled(mlp, tiles=True)
    with pytest.raises(ValueError, match=r"was given dim=3, but its input has 3 dimensions"):
        remat.tiled(mlp, x, dim=3, tiles=2)
    with pytest.raises(TypeError, match="takes a tensor to tile"):
        remat.tiled(mlp, [x], tiles=2)
    with pytest.raises(TypeError, match="tiles a module in place"):
        remat.tiled(torch.sin, tiles=2)


@pytest.mark.parametrize("module", [
    nn.MultiheadAttention(WIDTH, 2), nn.LSTM(WIDTH, WIDTH), nn.Conv1d(WIDTH, WIDTH, 3), nn.BatchNorm1d(WIDTH),
], ids=["attention", "lstm", "conv", "batchnorm"])
def test_modules_that_are_not_token_wise_are_refused(module: nn.Module) -> None:
    with pytest.raises(ValueError, match="cannot run in tiles"):
        remat.tiled(module, tiles=2)
    with pytest.raises(ValueError, match="cannot run in tiles"):
        remat.tiled(module, torch.randn(2, SEQ, WIDTH), tiles=2)


def test_a_mixture_of_experts_is_refused() -> None:
    class SparseMoeBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(WIDTH, 2)
            self.experts = nn.ModuleList([GatedMLP(), GatedMLP()])

    why = not_token_wise(SparseMoeBlock())
    assert why is not None and "mixture of experts" in why
    with pytest.raises(ValueError, match="mixture of experts"):
        remat.tiled(SparseMoeBlock(), tiles=2)


def test_an_output_that_reduces_over_positions_is_caught() -> None:
    with pytest.raises(remat.RematError, match="a token-wise function keeps each position"):
        remat.tiled(lambda x: x.sum(1, keepdim=True), torch.randn(2, SEQ, WIDTH, requires_grad=True), tiles=3)
    with pytest.raises(TypeError, match="returned `tuple`"):
        remat.tiled(lambda x: (x, x), torch.randn(2, SEQ, WIDTH, requires_grad=True), tiles=3)


class ResidualMLP(nn.Module):
    """Bloom's and MPT's MLP: the residual comes in as a second tensor of the same positions."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = GatedMLP()

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) + residual


@pytest.mark.parametrize("strategy", ["plain", "rerun"])
def test_tensors_of_the_inputs_positions_beside_it_are_tiled_with_it(strategy: str) -> None:
    """Bloom's and MPT's MLPs take the residual, a second tensor of the same positions: it is tiled with the input
    (handed whole, the first step failed on a shape), its gradient made tile by tile, and kept as the input is."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.mlp = nn.Linear(WIDTH, WIDTH), ResidualMLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(torch.tanh(x), residual=self.inner(x))

    def tiled(model: nn.Module) -> nn.Module:
        remat.tiled(model.mlp, tiles=3, dim=1)
        return remat.remat(model) if strategy == "rerun" else model

    before = _stats.tiles
    assert_same_grads(Residual, inputs(), tiled, expect_recompute=strategy == "rerun")
    assert _stats.tiles - before == 3
    block = Block()
    block.mlp = ResidualMLP()  # type: ignore[assignment]
    assert tile_blocks([("b", block)], 2).tiled == ("b.norm", "b.mlp")
    x, r = inputs()[0], torch.randn(2, SEQ, WIDTH, requires_grad=True)
    scale = torch.randn(WIDTH, requires_grad=True)

    def fn(t: torch.Tensor, scale: torch.Tensor, r: torch.Tensor, *, also: torch.Tensor) -> torch.Tensor:
        assert r.shape == t.shape == also.shape and scale.shape == (WIDTH,), "each tile of r, all of scale"
        return t * scale + r.sin() * also

    expected = torch.autograd.grad(fn(x, scale, r, also=r * 2).square().sum(), (x, scale, r))
    got = torch.autograd.grad(remat.tiled(fn, x, scale, r, also=r * 2, dim=1, tiles=4).square().sum(), (x, scale, r))
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want)


# -- the token-wise modules of blocks -----------------------------------------------------------------------


def test_tile_blocks_finds_feed_forward_modules_and_skips_experts() -> None:
    class Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList([GatedMLP()])

    blocks = [Block(), Block()]
    blocks[1].mlp = Moe()  # type: ignore[assignment]
    report = tile_blocks([("layers.0", blocks[0]), ("layers.1", blocks[1])], 4)
    assert report.tiled == ("layers.0.norm", "layers.0.mlp", "layers.1.norm")
    assert [name for name, _ in report.skipped] == ["layers.1.mlp"]
    assert "mixture of experts" in str(report)
    report = tile_blocks([("b", Block())], 2, where=GatedMLP)
    assert report.tiled == ("b.mlp",)
    with pytest.raises(ValueError, match="cannot run in tiles"):
        tile_blocks([("b", blocks[1])], 2, where=lambda name, module: name == "mlp")


def test_a_hook_inside_a_tiled_module_is_warned_of_once() -> None:
    """NOTE [ What is tiled ], rule 7: a capture by a hook on a module inside sees tiles and has no gradient (an
    auxiliary loss on it gets none through it, silently); hooks on the tiled module itself are not warned of."""
    from remat._engine import compiled

    mlp = GatedMLP()
    mlp.register_forward_hook(lambda module, args, out: None)  # around the tiles: fine
    x = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    remat.tiled(mlp, x, tiles=3).sum().backward()  # no warning (warnings are errors here)
    captured: list[torch.Tensor] = []
    handle = mlp.up.register_forward_hook(lambda module, args, out: captured.append(out))
    compiled._warned.discard("tiles:hooks:GatedMLP")
    try:
        with pytest.warns(UserWarning, match=r"`GatedMLP.up` has a forward hook .* no gradient"):
            remat.tiled(mlp, x, tiles=3).sum().backward()
        assert [tuple(t.shape) for t in captured[:3]] == [(2, 4, HIDDEN)] * 3 and captured[0].grad_fn is None
    finally:
        handle.remove()
