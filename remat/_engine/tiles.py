"""Token-wise work in tiles: forward keeps the input only; backward rebuilds and differentiates one tile at a time.

See NOTE [ Tiles ]. The public form (`remat.tiled`) and the choice of what to tile live in remat/_sites/tiles.py.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .._core.errors import BUG, RecomputeMismatchError, RematError
from .._core.torch_compat import graph_task_keeps_graph, tensor_hooks_held, top_saved_hooks, tree_leaves
from . import stats as _stats
from .autocast import AutocastState
from .modes import Mode
from .once import parts
from .rng import RngStash, devices_of

__all__ = ["spans", "tiles"]

# NOTE [ Tiles ]
# A module whose output at each position depends only on that position's input (an MLP, a gated MLP, a norm) makes
# intermediates several times the size of its input (a transformer's MLP: three or four tensors, each several times
# as wide), and full remat of the block around it holds them all while the block's backward runs. Run over the
# positions in tiles, only one tile's intermediates are ever alive.
#
# Rules:
# 1. `tiles(fn, x, dim, count)` returns fn(x) for a token-wise `fn`: forward calls fn on one tile of `x` along
#    `dim` at a time, without a graph, and writes each tile's output into the output; it keeps `x` only. Backward
#    calls fn on one tile at a time again, with a graph, differentiates it and frees it before the next tile.
#    Tiles are independent, so the values are those of one call (up to the order of float sums inside a kernel).
# 2. The gradients of `x` and of every tensor that requires grad and that fn reads (a module's parameters, a
#    tensor in a closure) are made once: summed over the tiles (in float32 at least) and returned as the tiled
#    call's own gradients, so a parameter's gradient is accumulated once per backward, as without tiles, and hooks
#    on it (DDP's and FSDP2's reductions, ZeRO's gradient hooks, a user's `register_hook`) fire once, on the sum.
# 3. `x` is kept as autograd keeps a saved tensor: handed to the saved-tensor hooks in force (an enclosing remat
#    site, `save_on_cpu`, an offload block), and fetched back through them in backward. It is handed over before
#    the first tile runs, so the recompute of an enclosing remat site that needs nothing after it stops there
#    (early stop) without running fn again. Outside any hooks it is kept by reference, and a change in place
#    before backward raises as autograd's own check does.
# 4. Random ops inside fn (dropout) draw per tile, as calls of fn on each tile in turn would (so not the masks of
#    one untiled call); backward runs the tiles in forward's order from forward's RNG state, so each tile draws
#    again what it drew in forward, and the caller's RNG stream is put back after. Backward's calls run under
#    forward's autocast state, and cast each weight once for all the tiles, as forward's do (autocast drops its
#    casts when its outermost region exits: `AutocastState.kept_casts` keeps one open around the tiles).
# 5. The gradients of the tensors fn reads reach autograd as the node's own, after its backward: where module
#    hooks gather parameters (FSDP2, ZeRO-3), the caller runs the tiled module's hooks once around the tiles, so the
#    parameters are gathered once per forward (and per recompute) and once in backward, and released after their
#    gradients are accumulated (remat/_sites/tiles.py, NOTE [ What is tiled ]).
# 6. A second derivative (`create_graph=True`) goes through the tiles with every tile's graph kept, to the tiled
#    input and what is upstream of it as to the reads.
# 7. Chained tiles: a tiled call whose input is the output of the tiled call just before it (unchanged since,
#    along the same dimension, under the same autocast and the same saved-tensor hooks: the same site's forward,
#    the same recompute, or none), where that earlier function is cheap to run again (it
#    reads no tensor of more than one dimension, as a norm), draws no random numbers and has its parameters outside
#    its own call too (not a module that ZeRO-3 or FSDP2 gathers for itself), runs the two as one
#    token-wise function over the earlier call's input, which is all it keeps: each tile runs the earlier
#    function, then its own. The earlier output is then kept by nobody that only the tiles made keep it (a
#    transformer's MLP after its norm keeps the norm's input, not the norm's output too). Gradients reach the
#    earlier input and both functions' reads through the chained call; the earlier call's node gets gradients
#    only from other users of its output, if it has any.
# 8. More tensors of `x`'s positions (`along`: the same sizes up to `dim`; Bloom's MLP takes the residual) are
#    tiled with it: each tile calls fn on the tile of each, they are kept as `x` is (rule 3), and their gradients
#    are made tile by tile as `x`'s. Such a call does not chain (rule 7).
# 9. Every tensor from outside that fn reads (a parameter, a frozen weight, a buffer, a tensor in a closure) is
#    read again by backward's tiles, so one changed in place between forward and backward raises autograd's
#    "modified by an inplace operation" error, as `x` does (rule 3), never a gradient of the changed value.
# 10. A module that ran in forward with other tensors in place of its parameters (`torch.func.functional_call`)
#    is run again by backward's tiles with its own: a `RecomputeMismatchError`, as rerun's (NOTE [ Parameters in
#    recompute ] in hooks.py), where a parameter read in forward got no gradient from backward's tiles and the
#    module's parameter of that name is another tensor now.
#
# Implementation notes:
# 1. (rules 2, 9) Which tensors fn reads is seen on the first tile, which forward runs under a dispatch mode that
#    notes every op argument that no op of the tile made (a view stands for its base); those requiring grad
#    become inputs of the autograd function. Their versions after forward are checked at backward, and those of
#    the rest too, held weakly (a tensor a closure holds lives as long as fn does). fn must read the same tensors
#    on every tile, as a token-wise function does.
# 2. (rule 3) The first tile runs after `x` is handed over, outside the autograd function (it names the tensors
#    the function takes); the rest run inside it.
# 3. (rule 3) What backward needs (the kept `x`, fn, the reads) hangs on the node's context, which outlives the
#    node's run: a handle of an enclosing site would keep that site's frame, and its inputs, alive for the rest of
#    the backward (every block's input to the end of it, under full remat) and into the next step. So backward
#    drops them as soon as it is done when the running backward does not keep the graph (no `retain_graph`), as
#    autograd frees a node's saved tensors; where torch cannot say, an end-of-backward callback drops them once
#    autograd freed the node's own.
# 4. (rule 7) The last tiled call of each thread is noted (`_last`) with its output (weakly), its function, its input
#    and the saved-tensor hooks in force (held until the output dies or the next tiled call) and the versions;
#    the reads' shapes and the random ops are seen on its first tile, under `_Reads`. Forward and the recompute of
#    an enclosing site must chain alike, or the recompute keeps the earlier input where forward kept the earlier
#    output, of the same shape: a silent wrong gradient. Hence the input held: under a site's hooks forward lets a
#    temporary input go (a post-norm block's `norm(x + attn)`) that the recompute keeps; and hence the hooks: a
#    site's recompute never sees the call made before the site. The chained call's node takes the earlier input,
#    so the earlier node, unreachable from the loss once its output is gone, is freed with what it kept.
# 5. (rules 2, 4) Under autocast, a weight's cast stands for the weight among the reads. A cast taken from
#    autocast's cache (made by an earlier call of the same module in the region, or an earlier use of the weight)
#    would hide the weight it was cast from: the weight would not be a read, and a second call of a tiled module
#    in one region gave its weight no gradient. And a cast that was itself a read while backward's tiles used
#    another (their own, after the region) or the same (a backward run inside the region) either lost the
#    gradient or counted it twice. So a cast the first tile makes (`_to_copy` of a leaf requiring grad) is not a
#    read, its weight is; and one it takes from the cache (a `ToCopyBackward0` node over such a leaf) is noted as
#    its weight. The casts stay held to backward, as forward's node held them before (what a budget's profile
#    counts: NOTE [ Deriving choices ] in remat/_budget/costs_derived.py).
# 6. (rules 3, 6) The tiled inputs that need gradients are saved by a node of their own (`_Keep`), made before the
#    first tile runs, whose outputs the tiles' node takes: autograd packs them through the hooks in force then,
#    checks their versions, and unpacks them in backward with their place in the graph. A second derivative runs
#    backward's tiles on slices of them, so it reaches the input and what is upstream of it (a detached copy gave
#    the second-order part through the input no path: the input's gradient was off by 0.6, or None). Inputs that
#    need none are kept by `_KeptTile`.


def spans(length: int, count: int) -> list[tuple[int, int]]:
    """`(start, length)` of each tile: `count` tiles of `length` positions, as even as they can be.

    >>> spans(10, 4)
    [(0, 3), (3, 3), (6, 2), (8, 2)]
    """
    count = max(1, min(count, length))
    size, extra = divmod(length, count)
    out, start = [], 0
    for index in range(count):
        step = size + (1 if index < extra else 0)
        out.append((start, step))
        start += step
    return out


class _Reads(Mode):
    """Notes every tensor from outside that an op reads, other than the tiled inputs: those requiring grad
    (implementation note 1) and the rest (rule 9); a weight's cast stands for the weight (implementation note 5)."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip = skip  # the ids of the tiled inputs, their tiles and their bases (alive while the tile runs)
        self.found: dict[int, torch.Tensor] = {}  # requiring grad
        self.others: dict[int, torch.Tensor] = {}  # not requiring grad
        self.casts: dict[int, torch.Tensor] = {}  # the weights' casts the tile used
        self.made: set[int] = set()  # what the ops made (alive, so no id of a tensor from outside)
        self.drew = False  # a random op ran (rule 7)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.drew = True
        for item in tree_leaves((args, kwargs)):
            if isinstance(item, torch.Tensor) and id(item) not in self.made:
                base = item._base if item._base is not None else item
                if id(base) not in self.skip and id(item) not in self.skip:
                    weight = _cast_of(base)
                    if weight is not None:  # taken from autocast's cache
                        self.casts.setdefault(id(base), base)
                        base = weight
                    (self.found if base.requires_grad else self.others).setdefault(id(base), base)
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.made.update(id(t) for t in made)
        if func is torch.ops.aten._to_copy.default and _is_weight(args[0]):
            self.casts.update((id(t), t) for t in made)
        return out


def _is_weight(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_leaf and tensor.requires_grad


def _cast_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The weight that `tensor` is a cast of (autocast's: `_to_copy` of a leaf that requires grad), or None."""
    node = tensor.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return None
    source = getattr(node.next_functions[0][0], "variable", None) if node.next_functions else None
    return source if _is_weight(source) else None


class _Keep(torch.autograd.Function):
    """The tiled inputs, saved as autograd saves a node's tensors (NOTE [ Tiles ], rules 3 and 6): packed now by the
    saved-tensor hooks in force, before any tile runs, and unpacked in backward with their place in the graph,
    which a second derivative follows back through them. Passes them on unchanged."""

    @staticmethod
    def forward(ctx: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(*xs)
        passed = tuple(x.view_as(x) for x in xs)
        ctx.mark_non_differentiable(*(p for p, want in zip(passed, ctx.needs_input_grad, strict=True) if not want))
        return passed

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return grads


class _Kept:
    """The tiled inputs (`x`, then `along`'s), kept as autograd keeps saved tensors (NOTE [ Tiles ], rules 3 and 6):
    by a `_Keep` node where one requires grad, else each as `_KeptTile` keeps it. `keep` makes it."""

    __slots__ = ("count", "node", "plain")

    def __init__(self, count: int, node: Any, plain: tuple[_KeptTile, ...]) -> None:
        self.count, self.node, self.plain = count, node, plain

    @staticmethod
    def keep(xs: Sequence[torch.Tensor]) -> tuple[_Kept, tuple[torch.Tensor, ...]]:
        """The tiled inputs kept, and what the tiles' node takes for them: the `_Keep` node's outputs (held by
        nothing else, or they would hold `x` on its device past the hooks that pack it), or the inputs."""
        if not any(t.requires_grad for t in xs):
            return _Kept(len(xs), None, tuple(_KeptTile(t) for t in xs)), tuple(xs)
        passed: tuple[torch.Tensor, ...] = _Keep.apply(*xs)  # type: ignore[no-untyped-call, unused-ignore]
        return _Kept(len(xs), next(t.grad_fn for t in passed if t.grad_fn is not None), ()), passed

    def get(self, site: str, graph: bool) -> list[torch.Tensor]:
        """The tiled inputs again, in forward's graph where `graph` (a second derivative: rule 6), else detached."""
        if self.node is None:
            return [kept.get(site) for kept in self.plain]
        try:
            saved: tuple[torch.Tensor, ...] = self.node.saved_tensors
        except RuntimeError as e:
            if "modified by an inplace operation" not in str(e):
                raise
            raise _changed(f"an input of the tiled `{site}` changed in place between forward and backward "
                           f"(autograd: {str(e).splitlines()[0]})") from None
        return [t if graph else t.detach() for t in saved]


class _KeptTile:
    """`x`, kept as autograd keeps a saved tensor (NOTE [ Tiles ], rule 3), where it needs no gradient."""

    __slots__ = ("packed", "tensor", "unpack", "version")

    def __init__(self, x: torch.Tensor) -> None:
        hooks = top_saved_hooks(False)
        self.tensor: torch.Tensor | None
        if hooks is None:
            self.tensor = x
            self.version = x._version
            self.packed: Any = None
            self.unpack: Callable[[Any], torch.Tensor] | None = None
        else:
            self.tensor, self.version = None, 0
            self.packed, self.unpack = hooks[0](x), hooks[1]

    def get(self, site: str) -> torch.Tensor:
        if self.unpack is not None:
            return self.unpack(self.packed).detach()
        tensor = self.tensor
        assert tensor is not None
        _unchanged(tensor, self.version, f"the input of the tiled `{site}` (shape {{shape}})")
        return tensor.detach()


def _unchanged(tensor: torch.Tensor, version: int, what: str) -> None:
    """Raise as autograd does where `tensor` changed in place since it was at `version` (rules 3 and 9); `what`
    names it, with `{shape}` where its shape goes."""
    if tensor._version != version:
        raise _changed(f"{what.format(shape=list(tensor.shape))} was at version {version} after forward and is at "
                       f"version {tensor._version} now")


def _changed(what: str) -> RematError:
    """The error for a tensor backward's tiles read that changed in place since forward (rules 3 and 9)."""
    return RematError(
        f"remat: one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"{what}; backward would run the tiles on the changed value and give wrong gradients. Don't modify it in "
        "place between forward and backward (clone it first)."
    )


class _TileSpec:
    """What backward needs besides tensors; `release` drops what it holds once no backward can come (implementation
    note 3)."""

    __slots__ = ("autocast", "casts", "devices", "dim", "fn", "kept", "names", "owner", "reads", "rng", "site",
                 "spans", "watched")

    def __init__(self, fn: Callable[..., torch.Tensor], dim: int, cuts: list[tuple[int, int]],
                 site: str, kept: _Kept, devices: tuple[torch.device, ...]) -> None:
        self.fn: Callable[..., torch.Tensor] | None = fn
        self.dim, self.spans, self.site = dim, cuts, site
        self.kept: _Kept | None = kept  # the tiled inputs: `x`, then `along`'s
        self.devices = devices
        self.rng = RngStash.capture(devices)
        self.autocast = AutocastState.capture(devices)
        self.reads: tuple[torch.Tensor, ...] = ()
        self.casts: tuple[torch.Tensor, ...] = ()  # held to backward, as forward's node held them (note 5)
        # the module fn belongs to, and per read, its name among the module's parameters in forward (rule 10)
        self.owner: weakref.ref[nn.Module] | None = None
        self.names: dict[int, str] = {}
        # every read from outside, weakly, with its version (rule 9, implementation note 1)
        self.watched: list[tuple[weakref.ref[torch.Tensor], int]] = []

    def watch(self, others: Sequence[torch.Tensor]) -> None:
        """Note the versions of the reads and of `others` (those needing no grad) after forward."""
        self.watched = [(weakref.ref(t), t._version) for t in (*self.reads, *others)]

    def rewatch(self) -> None:
        """Note the versions again after a backward, whose tiles may write a buffer as forward's did."""
        self.watched = [(ref, t._version) for ref, _ in self.watched if (t := ref()) is not None]

    def check(self) -> None:
        """Raise as autograd does where a read changed in place since it was noted (rule 9)."""
        for ref, version in self.watched:
            tensor = ref()
            if tensor is not None:
                _unchanged(tensor, version, f"a tensor of shape {{shape}} that the tiled `{self.site}` reads")

    def release(self) -> None:
        self.fn = self.kept = None
        self.reads = self.casts = ()
        self.watched = []


def _release_when_freed(ctx: Any) -> None:
    """At the end of a backward: if autograd freed the node's saved tensors (no `retain_graph`), free ours too."""
    try:
        saved = ctx._raw_saved_tensors  # raises once autograd freed them
        del saved
    except RuntimeError:
        ctx.spec.release()


def tiles(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    dim: int,
    count: int,
    *,
    site: str,
    module: nn.Module | None = None,
    chain: bool = True,
    along: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """`fn(x, *along)` computed over `count` tiles of `x` along `dim` (NOTE [ Tiles ]); `dim` is non-negative.

    `module`: the module fn belongs to, whose parameters' devices the RNG state covers. `chain`: whether a later
    tiled call may run fn again as part of its own (rule 7; not where fn's parameters exist only inside its call).
    `along`: more tensors of `x`'s positions, tiled with it (rule 8).

    >>> lin = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 6, 4, requires_grad=True)
    >>> torch.testing.assert_close(tiles(lin, x, 1, 3, site="lin"), lin(x))
    """
    found = _earlier(x, dim) if torch.is_grad_enabled() and not along else None
    _last.made = None  # this call is the one just before the next (rule 7)
    if found is not None:  # rule 7
        earlier, first_fn, x = found
        fn, site = functools.partial(_one_after_other, first_fn, fn), f"{earlier.site} then {site}"
    xs = (x, *along)
    cuts = spans(x.shape[dim], count)
    start, length = cuts[0]
    # without a graph: not one of fn's reads (a copy, if not contiguous)
    tile = [_tile(t.detach(), dim, start, length) for t in xs]
    if not torch.is_grad_enabled():
        first = fn(*tile)
        _check_tile(first, tile[0], dim, site, 0)
        return _rest(fn, xs, first, dim, cuts, site)
    kept, passed = _Kept.keep(xs)  # rule 3: before any tile runs
    spec = _TileSpec(fn, dim, cuts, site, kept, devices_of(xs, module))
    skip = {id(t) for t in (*xs, *tile)} | {id(t._base) for t in (*xs, *tile) if t._base is not None}
    with torch.no_grad(), _Reads(skip) as reads:
        first = fn(*tile)
    _check_tile(first, tile[0], dim, site, 0)
    del tile
    spec.reads = tuple(reads.found.values())
    spec.casts = tuple(t for t in reads.casts.values() if t.grad_fn is not None)  # autocast's: cast with grad on
    if module is not None:  # rule 10
        at = {id(t): index for index, t in enumerate(spec.reads)}
        spec.owner = weakref.ref(module)
        spec.names = {at[id(p)]: name for name, p in module.named_parameters() if id(p) in at}
    if not any(t.requires_grad for t in xs) and not spec.reads:  # nothing to differentiate: as without grad
        return _rest(fn, xs, first, dim, cuts, site)
    out: torch.Tensor = _TilesFunction.apply(spec, first, *passed, *spec.reads)  # type: ignore[no-untyped-call, unused-ignore]
    spec.watch(tuple(reads.others.values()))
    if chain and not along and found is None and not reads.drew and all(t.dim() <= 1 for t in spec.reads):
        _last.made = _Made(fn, x, out, dim, site, spec.devices, spec.autocast)
    return out


class _Made:
    """The tiled call just made, which the next tiled call may chain onto (NOTE [ Tiles ], rule 7)."""

    __slots__ = ("autocast", "devices", "dim", "held", "input_version", "output", "site", "version")

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out: torch.Tensor, dim: int,
                 site: str, devices: tuple[torch.device, ...], autocast: AutocastState | None) -> None:
        self.dim, self.site, self.devices = dim, site, devices
        # the function, its input and the saved-tensor hooks in force, held until the output dies (implementation
        # note 4)
        self.held: list[Any] = [fn, x, top_saved_hooks(False)]
        self.output = weakref.ref(out, functools.partial(_drop_held, self.held))
        self.version, self.input_version = out._version, x._version
        self.autocast = None if autocast is None else autocast.key()


def _drop_held(held: list[Any], _: object) -> None:
    held.clear()


_last = threading.local()
"""`made`: this thread's last tiled call with a graph, a `_Made` where a later call may chain onto it, else None."""


def _earlier(x: torch.Tensor, dim: int) -> tuple[_Made, Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | None:
    """The tiled call just before, where `x` is its unchanged output and this call may chain onto it (rule 7), with
    that call's function and input; else None."""
    made: _Made | None = getattr(_last, "made", None)
    if made is None or not made.held or made.output() is not x or made.dim != dim or x._version != made.version:
        return None
    fn, earlier, hooks = made.held
    if earlier._version != made.input_version or not _same_hooks(hooks, top_saved_hooks(False)):
        return None
    now = AutocastState.capture(made.devices)
    return (made, fn, earlier) if (None if now is None else now.key()) == made.autocast else None


def _same_hooks(hooks: tuple[Any, Any] | None, now: tuple[Any, Any] | None) -> bool:
    """Whether the same saved-tensor hooks are in force: the same site's forward, the same recompute, or none."""
    if hooks is None or now is None:
        return hooks is now
    return hooks[0] is now[0] and hooks[1] is now[1]


def _one_after_other(first: Callable[[torch.Tensor], torch.Tensor], then: Callable[[torch.Tensor], torch.Tensor],
             part: torch.Tensor) -> torch.Tensor:
    return then(first(part))


def _even(cuts: list[tuple[int, int]]) -> bool:
    """Whether the tiles are all of one size (`spans` makes the longer ones first)."""
    return cuts[0][1] == cuts[-1][1]


def _tile(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """One tile of `x`, contiguous where `x` is (a tile along a later dimension than the first is not), as the
    function would have been given it untiled: token-wise code often flattens its input with `view` (GPT-2's
    `Conv1D`)."""
    part = x.narrow(dim, start, length)
    return part.contiguous() if x.is_contiguous() else part


def _tile_of(x: torch.Tensor, dim: int, start: int, length: int, want: bool, create: bool) -> torch.Tensor:
    """One tile of a kept input for backward's call of fn: in forward's graph for a second derivative (rule 6; a
    copy, which fn may change in place), else a leaf of its own that requires grad where its gradient is wanted."""
    if create and x.requires_grad:
        return x.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)
    return _tile(x, dim, start, length).detach().requires_grad_(want)


def _check_tile(out: Any, part: torch.Tensor, dim: int, site: str, index: int) -> None:
    """A tile's output must be a tensor with the tile's positions along `dim`."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"remat: the tiled `{site}` returned `{type(out).__name__}` for tile {index}; tiles need a "
                        "function that returns one tensor.")
    if out.dim() != part.dim() or out.shape[dim] != part.shape[dim]:
        raise RematError(
            f"remat: the tiled `{site}` gave an output of shape {list(out.shape)} for a tile of shape "
            f"{list(part.shape)} (tile {index}, dimension {dim}): a token-wise function keeps each position of "
            f"dimension {dim}, since its output at a position depends only on that position's input. Tile only "
            "such functions (an MLP, a norm), along the dimension of positions."
        )


def _rest(fn: Callable[..., torch.Tensor], xs: Sequence[torch.Tensor], first: torch.Tensor, dim: int,
          cuts: list[tuple[int, int]], site: str) -> torch.Tensor:
    """The whole output, from the first tile's and the others computed now (without a graph)."""
    if len(cuts) == 1:
        return first
    shape = list(first.shape)
    shape[dim] = xs[0].shape[dim]
    out = first.new_empty(shape)
    out.narrow(dim, 0, first.shape[dim]).copy_(first)
    del first
    with torch.no_grad():  # the first tile ran already; an estimate on fake tensors runs a few: NOTE [ Counted once ]
        for index, (start, length) in parts(list(enumerate(cuts)), xs[0], even=_even(cuts))[1:]:
            tile = [_tile(t, dim, start, length) for t in xs]
            piece = fn(*tile)
            _check_tile(piece, tile[0], dim, site, index)
            out.narrow(dim, start, length).copy_(piece)
            del piece
    return out


class _TilesFunction(torch.autograd.Function):
    """The tiles as one autograd node: inputs the first tile's output (no gradient), the tiled inputs (`x`, then
    `along`'s) and the tensors fn reads."""

    @staticmethod
    def forward(ctx: Any, spec: _TileSpec, first: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.save_for_backward()  # none, but autograd marks them freed after a backward without `retain_graph`
        assert spec.fn is not None and spec.kept is not None
        return _rest(spec.fn, tensors[:spec.kept.count], first, spec.dim, spec.spans, spec.site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        spec: _TileSpec = ctx.spec
        wanted: Sequence[bool] = ctx.needs_input_grad
        if grad is None:
            return (None,) * len(wanted)
        if spec.kept is None or spec.fn is None:
            raise RematError(f"remat: the tiled `{spec.site}` was asked for gradients after its graph was freed; "
                             f"{BUG}.")
        keeps = graph_task_keeps_graph()
        if keeps is None:  # not known: implementation note 4
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_release_when_freed, ctx))
        begun = time.perf_counter()
        tiled = spec.kept.count
        create = torch.is_grad_enabled()  # a second derivative (rule 6): every tile's graph is kept
        xs = spec.kept.get(spec.site, graph=create)
        spec.check()
        grads = _differentiate(spec, xs, grad, wanted[2:2 + tiled], wanted[2 + tiled:], create)
        del xs
        spec.rewatch()
        if keeps is False:  # no backward can come again: free what forward kept now, as autograd frees its own
            spec.release()
        _stats.add_recompute(time.perf_counter() - begun)
        return (None, None, *grads)


def _differentiate(spec: _TileSpec, xs: Sequence[torch.Tensor], grad: torch.Tensor, xs_wanted: Sequence[bool],
                   reads_wanted: Sequence[bool], create: bool) -> list[torch.Tensor | None]:
    """The gradients of the tiled inputs and of the reads, tile by tile (NOTE [ Tiles ], rules 2, 4, 6 and 8);
    `create`: a second derivative, every tile's graph kept."""
    dim, cuts = spec.dim, spec.spans
    fn = spec.fn
    assert fn is not None
    reads = [t for t, want in zip(spec.reads, reads_wanted, strict=True) if want]
    sums: list[torch.Tensor | None] = [None] * len(reads)
    wanted = [i for i, want in enumerate(xs_wanted) if want]
    # each wanted input's gradient, written a tile at a time; with `create`, its tiles' pieces, joined at the end
    grads_x: list[torch.Tensor | None] = [None if create else xs[i].new_empty(xs[i].shape) for i in wanted]
    pieces: list[list[torch.Tensor]] = [[] for _ in wanted]
    every = list(enumerate(cuts))
    caller_rng = spec.rng.swap_in()
    try:
        tiles = every if create else parts(every, xs[0], even=_even(cuts))  # NOTE [ Counted once ]
        with AutocastState.kept_casts(spec.autocast):  # rule 4: each weight cast once for all the tiles
            for index, (start, length) in tiles:
                tile = [_tile_of(x, dim, start, length, want, create) for x, want in zip(xs, xs_wanted, strict=True)]
                with torch.enable_grad(), AutocastState.enter(spec.autocast, spec.devices):
                    out = fn(*tile)
                _check_tile(out, tile[0], dim, spec.site, index)
                _stats.add_tile()
                inputs = [tile[i] for i in wanted] + reads
                if not out.requires_grad or not inputs:
                    made: Sequence[torch.Tensor | None] = [None] * len(inputs)
                else:
                    with tensor_hooks_held(reads):  # rule 2: a read's hooks run once, on the sum
                        made = torch.autograd.grad(out, inputs, grad.narrow(dim, start, length), allow_unused=True,
                                                   create_graph=create)
                del out
                for slot, i in enumerate(wanted):
                    got = made[slot]
                    piece = got if got is not None else torch.zeros_like(tile[i])
                    whole = grads_x[slot]
                    if whole is not None:
                        whole.narrow(dim, start, length).copy_(piece)
                    else:
                        pieces[slot].append(piece)
                    del got, piece, whole
                del tile
                made = made[len(wanted):]
                for slot, g in enumerate(made):
                    if g is None:
                        continue
                    total = sums[slot]
                    if total is None:  # a copy: `g` may be the incoming gradient itself (`x + bias`), or a view of it
                        sums[slot] = g if create else g.float() if g.dtype.itemsize < 4 else g.clone()
                    elif create:
                        sums[slot] = total + g
                    else:
                        total.add_(g)
                del made
                g = total = None  # the last tile's gradient would sit beside the next tile's
    finally:
        caller_rng.apply()
    _same_parameters(spec, reads_wanted, sums)
    joined = iter(whole if whole is not None else torch.cat(tiles_of, dim)
                  for whole, tiles_of in zip(grads_x, pieces, strict=True))
    out_reads = iter(None if s is None else s.to(t.dtype) for s, t in zip(sums, reads, strict=True))
    return [*(next(joined) if want else None for want in xs_wanted),
            *(next(out_reads) if want else None for want in reads_wanted)]


def _same_parameters(spec: _TileSpec, reads_wanted: Sequence[bool], sums: Sequence[torch.Tensor | None]) -> None:
    """Raise where backward's tiles gave no gradient to a read that was one of the module's parameters in forward
    and is not now (NOTE [ Tiles ], rule 10): forward ran with other tensors in their place."""
    module = spec.owner() if spec.owner is not None else None
    if module is None or all(s is not None for s in sums):
        return
    wanted = [index for index, want in enumerate(reads_wanted) if want]
    for slot, index in enumerate(wanted):
        name = spec.names.get(index)
        if sums[slot] is None and name is not None and module.get_parameter(name) is not spec.reads[index]:
            raise RecomputeMismatchError(
                f"remat: the tiled `{spec.site}` ran in forward with another tensor in place of its parameter "
                f"`{name}` (`torch.func.functional_call`, or a parameter replaced between forward and backward), and "
                "its tiles run again in backward with the parameters it has now: its gradients would be wrong. Call "
                "it untiled there (`remat.enabled(False)`, or `remat.undo` on the tiled module).")

