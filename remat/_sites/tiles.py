"""`remat.tiled`: token-wise work (an MLP, a norm) over the sequence in tiles, and which modules of a model are such.

The mechanism is remat/_engine/tiles.py (NOTE [ Tiles ]); this module is what users and `remat.apply` call: the
functional form, the in-place form for a module instance, the checks that refuse what is not token-wise, and the
search for the token-wise modules of a model's blocks (NOTE [ What is tiled ]).
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch
from torch import nn

from .._core import switch as _switch
from .._core.errors import alive
from .._core.public import claim
from .._engine.compiled import SiteForward, compiling, warn_once
from .._engine.tiles import tiles

__all__ = ["TILED_NAMES", "TileReport", "not_token_wise", "nothing_tiled", "tile_blocks", "tile_module", "tiled",
           "tiled_of", "untile"]

_M = TypeVar("_M", bound=nn.Module)

# NOTE [ What is tiled ]
# Rules:
# 1. A module is tiled when it is token-wise: its output at each position depends only on that position's
#    input. remat cannot prove that of a module, but it refuses what it can tell is not: attention (`Attention` in
#    the class name, `nn.MultiheadAttention`), recurrences and scans (RNNs, Mamba, linear attention, retention),
#    convolutions and pools over more than one position, norms over positions (batch, instance and group norms),
#    and mixtures of experts, whose routing may see all tokens (capacity, load balancing): a module with a
#    submodule named `experts` or a `MoE`, `Moe`, `Router` or `Sparse` class name (a transformers class named
#    without its family: Qwen2-MoE's `Qwen2MoeRMSNorm` is a norm). A tile's output must also keep the tile's
#    positions, which is checked on every call. The call's other arguments go whole to each tile, except tensors of
#    the input's positions (as many dimensions, the same sizes up to the tiled one, and not a parameter: Bloom's and
#    MPT's MLPs take the residual), which are tiled with it: handed whole, they could not line up with a tile.
# 2. By default the modules tiled in a block (a Hugging Face decoder layer) are its feed-forward modules as
#    transformers names them (`TILED_NAMES`: `mlp`, `feed_forward`, `ffn`, ...), the outermost in the block, and
#    the norms that are the block's own children (`input_layernorm`, `ln_1`, ...: a norm keeps its normalized
#    input for backward, which tiled it does not, and the feed-forward module after a tiled norm runs with it and
#    keeps only the norm's input: NOTE [ Tiles ], rule 7); a mixture of experts found there is skipped, and the
#    report says so. Norms deeper inside (a query norm inside attention, over heads) are left alone. Elsewhere the
#    caller says which (`where`).
# 3. The in-place form gives the instance its own `forward` (the class is never changed), which runs what the
#    instance ran before over tiles of its first argument: the module's hooks run once per call, around the
#    tiles. `remat.undo` takes it off.
# 4. Parameters are gathered once per call of the tiled module, not once per tile, and released after their
#    gradients are accumulated: the tiled module's hooks run once around the tiles (FSDP2's `fully_shard` on it or
#    on a module around it, as FSDP2 users write it). DeepSpeed ZeRO-3 hooks every module, and the modules inside a
#    tiled one run once per tile; so the in-place form makes the tiled module a ZeRO-3 "leaf module" (`_z3_leaf`,
#    the attribute `deepspeed.utils.set_z3_leaf_modules` sets and only DeepSpeed reads): ZeRO-3's hooks on it then
#    gather every parameter inside it when it is called (and, in backward, before its backward) and release them
#    when it returns (after their gradients are accumulated), and the hooks inside find them gathered. Tiled before
#    `deepspeed.initialize`, the modules inside get no hooks at all. The mark stays after `remat.undo` while ZeRO-3
#    partitions the module (its modules inside may have no hooks of their own). What would gather or reduce per
#    tile is refused: `fully_shard` on a module inside a tiled one, and the functional form on a module whose own
#    hooks gather (sharded by FSDP2 or ZeRO-3), which it calls once per tile.
# 5. Under torch.compile a tiled call runs untiled, with one warning per site: its backward calls autograd
#    itself, which dynamo does not trace.
# 6. With the switch off (`REMAT=0`) a tiled call is the plain call.
# 7. Forward runs the tiles without a graph, and a module inside a tiled one is called once per tile (in forward,
#    and again in backward): a forward hook on it sees tiles, and a tensor it keeps has no gradient (an auxiliary
#    loss on such a capture gets none through it). A tiled call with gradients on warns once per site where a
#    module inside has a forward hook or pre-hook that is not a sharding framework's (FSDP2's, DeepSpeed's) or
#    remat's own; hooks on the tiled module itself run once around the tiles.

TILED_NAMES = ("mlp", "feed_forward", "ffn", "mlp_block", "ffn1", "ffn2", "feed_forward1", "feed_forward2",
               "block_sparse_moe")
"""The names transformers gives the feed-forward module of a layer (NOTE [ What is tiled ], rule 2)."""

_RECURRENT = re.compile(r"Attention|Mamba|Ssm|SSM|Rnn|RNN|LSTM|GRU|DeltaNet|Retention|Rwkv|RWKV|Recurrent|"
                        r"ShortConv|CausalConv")
_EXPERTS = re.compile(r"MoE|Moe|MOE|Router|Sparse|Experts")


def _kind(module: nn.Module) -> str:
    return type(module).__qualname__


def _role(module: nn.Module) -> str:
    """The class name of a transformers module without its family's (`Qwen2MoeRMSNorm` -> `RMSNorm`): the family
    says experts are somewhere in the model, not in this module (NOTE [ What is tiled ], rule 1)."""
    kind = _kind(module)
    found = re.match(r"transformers\.models\.(\w+)\.", type(module).__module__)
    if found is None:
        return kind
    family, plain = found.group(1).replace("_", "").lower(), kind.replace("_", "")
    return plain[len(family):] or kind if plain.lower().startswith(family) else kind


def not_token_wise(module: nn.Module) -> str | None:
    """Why remat can tell that `module` is not token-wise (NOTE [ What is tiled ], rule 1), or None.

    >>> not_token_wise(nn.Linear(2, 2)) is None, not_token_wise(nn.MultiheadAttention(4, 2))
    (True, 'MultiheadAttention is attention: its output at a position reads other positions')
    """
    for name, inner in module.named_modules():
        where = f"{_kind(inner)}" + (f" (`{name}` inside it)" if name else "")
        if name.rsplit(".", 1)[-1] == "experts" or _EXPERTS.search(_role(inner)):
            return (f"{where} is a mixture of experts: its routing may see all tokens (capacity, load balancing), "
                    "so it is not tiled")
        if isinstance(inner, nn.MultiheadAttention) or _RECURRENT.search(_kind(inner)) or isinstance(
                inner, (nn.RNNBase, nn.Transformer, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            what = "attention" if "ttention" in _kind(inner) else "a recurrence, a scan or a convolution"
            return f"{where} is {what}: its output at a position reads other positions"
        if isinstance(inner, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
                              nn.GroupNorm, nn.LocalResponseNorm)):
            return f"{where} normalizes over positions"
        if isinstance(inner, nn.modules.conv._ConvNd) and (
                any(k != 1 for k in inner.kernel_size) or any(s != 1 for s in inner.stride)):
            return f"{where} is a convolution over more than one position"
        if type(inner).__module__.startswith("torch.nn.modules.pooling"):
            return f"{where} pools over positions"
    return None


def _sharded_inside(module: nn.Module) -> str | None:
    """The name of a module inside `module` (not itself) that FSDP2's `fully_shard` was applied to, if any."""
    for name, inner in module.named_modules():
        if name and any(kind.__name__ == "FSDPModule" for kind in type(inner).__mro__):
            return str(name)
    return None


def _tile_count(tiles: object) -> int:
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"remat: `tiles` must be a positive int (how many tiles), but got {tiles!r}.")
    return tiles


def _dim(dim: object, x: torch.Tensor, site: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"remat: the tiled `{site}` takes `dim` as an int, but got `{type(dim).__name__}`.")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"remat: the tiled `{site}` was given dim={dim}, but its input has {x.dim()} dimensions (shape "
            f"{list(x.shape)}): `dim` names the dimension of positions (tokens), which the input must have."
        )
    return dim % x.dim()


def _site_of(fn: Any) -> str:
    if isinstance(fn, nn.Module):
        return _kind(fn)
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


def _module_of(fn: Any) -> nn.Module | None:
    """The module whose parameters `fn` reads, where it says: the module itself, or a bound method's."""
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return owner
    if isinstance(fn, functools.partial):
        return _module_of(fn.func) or next((a for a in fn.args if isinstance(a, nn.Module)), None)
    return None


def _gathers(module: nn.Module) -> str | None:
    """What shards `module` so that its own hooks gather its parameters per call: FSDP2 or ZeRO-3, or None."""
    if any(kind.__name__ == "FSDPModule" for kind in type(module).__mro__):
        return "FSDP2's fully_shard"
    if any(hasattr(param, "ds_id") for param in module.parameters()):  # ZeRO-3's marks
        return "DeepSpeed ZeRO-3"
    return None


def _refuse(module: nn.Module | None, site: str) -> None:
    if module is None:
        return
    why = not_token_wise(module)
    if why is not None:
        raise ValueError(f"remat: `{site}` cannot run in tiles: {why}. Tile only token-wise modules (an MLP, a "
                         "norm): those whose output at a position depends only on that position's input.")
    inside = _sharded_inside(module)
    if inside is not None:
        raise ValueError(
            f"remat: `{site}` cannot run in tiles: `{inside}` inside it is sharded by FSDP2 (`fully_shard`), which "
            "would gather its parameters and reduce their gradients once per tile. Apply `fully_shard` to the tiled "
            "module or to a module around it (the block) instead."
        )


def _tiled_call(fn: Callable[..., torch.Tensor], x: Any, args: tuple[Any, ...], kwargs: dict[str, Any], count: int,
         dim: object, site: str, module: nn.Module | None) -> torch.Tensor:
    """One tiled call: the checks that need the input, then the engine (or the plain call: rules 5, 6)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"remat: the tiled `{site}` takes a tensor to tile as its first argument, but got "
                        f"`{type(x).__name__}`.")
    axis = _dim(dim, x, site)
    if not _switch._state[0] or x.shape[axis] <= 1:
        return fn(x, *args, **kwargs)
    if compiling():
        warn_once(f"tiles:{site}", f"remat: the tiled `{site}` runs untiled under torch.compile (its backward "
                  "calls autograd, which dynamo does not trace); its intermediates are not tiled there.")
        return fn(x, *args, **kwargs)
    if module is not None:
        _warn_of_hooks_inside(module, site)
    # tensors of the input's positions among the other arguments are tiled with it (NOTE [ What is tiled ], rule 1);
    # the call holds the rest, never them (they are kept as the tiled input is: NOTE [ Tiles ], rule 3)
    keys = [i for i, a in enumerate(args) if _positions_of(a, x, axis)]
    names = [k for k, v in kwargs.items() if _positions_of(v, x, axis)]
    along = tuple(args[i] for i in keys) + tuple(kwargs[k] for k in names)
    if along:
        args = tuple(None if i in keys else a for i, a in enumerate(args))
        kwargs = {k: None if k in names else v for k, v in kwargs.items()}
    call = fn if not args and not kwargs else functools.partial(_with_rest, fn, args, kwargs, (*keys, *names))
    # a module whose own hooks gather its parameters (ZeRO-3, FSDP2 on it) has them only inside its own call: a
    # later tiled call may not run it again (NOTE [ Tiles ], rule 7)
    return tiles(call, x, axis, count, site=site, module=module, chain=module is None or _gathers(module) is None,
                 along=along)


_FRAMEWORKS = ("torch.distributed.", "deepspeed.", "remat.")
"""Where the hooks come from that rule 7 does not warn of: sharding frameworks' and remat's own."""


def _warn_of_hooks_inside(module: nn.Module, site: str) -> None:
    """Rule 7: warn once per site where a module inside `module` has a hook of the user's."""
    for inner in module.modules():  # names are made only for a hook found: this runs on every tiled call
        if inner is module or not (inner._forward_hooks or inner._forward_pre_hooks):
            continue
        for hook in (*inner._forward_pre_hooks.values(), *inner._forward_hooks.values()):
            origin = getattr(getattr(hook, "func", hook), "__module__", None) or ""
            if getattr(hook, "_remat_owned", False) or origin.startswith(_FRAMEWORKS):
                continue
            name = next(name for name, found in module.named_modules() if found is inner)
            warn_once(f"tiles:hooks:{site}", (
                f"remat: `{site}.{name}` has a forward hook (`{getattr(hook, '__qualname__', type(hook).__name__)}`)"
                f" inside the tiled `{site}`: it sees one tile per call, in forward and again in backward, without "
                "a graph in forward, so a tensor it keeps has no gradient. Hook the tiled module itself (its hooks "
                "run once around the tiles) or leave it untiled."), stacklevel=5)
            return


def _positions_of(value: object, x: torch.Tensor, axis: int) -> bool:
    """Whether `value` is a tensor of `x`'s positions: as many dimensions, the same sizes up to `axis` included, and
    no parameter (a weight whose first size happens to be the number of positions is a weight)."""
    return (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.dim() == x.dim()
            and value.shape[:axis + 1] == x.shape[:axis + 1])


def _with_rest(fn: Callable[..., torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any],
               where: tuple[int | str, ...], part: torch.Tensor, *tiled: torch.Tensor) -> torch.Tensor:
    """`fn(part, *args, **kwargs)` with the tiles of the tensors of the input's positions put back `where` they were
    (an index of `args`, a key of `kwargs`)."""
    if not tiled:
        return fn(part, *args, **kwargs)
    rest, named = list(args), dict(kwargs)
    for key, tile in zip(where, tiled, strict=True):
        if isinstance(key, int):
            rest[key] = tile
        else:
            named[key] = tile
    return fn(part, *rest, **named)


_NOTHING: Any = object()


@overload
def tiled(fn: _M, /, *, tiles: int, dim: int = -2) -> _M: ...
@overload
def tiled(fn: Callable[..., torch.Tensor], x: torch.Tensor, /, *args: Any, tiles: int, dim: int = -2,
          **kwargs: Any) -> torch.Tensor: ...


def tiled(fn: Any, x: Any = _NOTHING, /, *args: Any, tiles: int, dim: int = -2, **kwargs: Any) -> Any:
    """Run token-wise work (an MLP, a gated MLP, a norm) over the positions of its input in `tiles` tiles.

    `remat.tiled(mlp, x, tiles=8)` returns `mlp(x)`: forward calls `mlp` on one tile of `x` along `dim` at a time
    and keeps only `x`; backward calls it again on one tile at a time and differentiates it, so its intermediates
    (a transformer MLP's are several times its input) are never alive for more than one tile. Gradients are those of
    the untiled call: those of `x` and of every tensor `fn` reads that requires grad (its parameters, a tensor it
    closes over) are summed over the tiles and accumulated once. Inside a rematerialized block, the block's
    recompute stops before the tiles where nothing after them is needed.

    `remat.tiled(module, tiles=8)` (no input) tiles the module instance in place and returns it: every call of it
    then runs its forward over tiles of its first argument (its hooks run once per call, around the tiles);
    `remat.undo(module)` takes that off.

    `fn` must be token-wise along `dim`: its output at each position depends only on that position's input. remat
    refuses what it can tell is not (attention, recurrences, convolutions and norms over positions, mixtures of
    experts) and checks that each tile's output keeps the tile's positions. Random ops inside (dropout) draw per
    tile, and backward draws again exactly what forward drew. Under torch.compile the call runs untiled (one
    warning); with `REMAT=0`, it is the plain call.

    Args:
        fn: a module, or any callable of the tensor to tile (and of `args`, `kwargs`, passed whole to every tile,
            except tensors of the input's positions: as many dimensions and the same sizes up to `dim`, tiled with
            it, as Bloom's MLP takes the residual).
        x: the tensor to tile; leave it out to tile the module `fn` in place.
        tiles: how many tiles (at most one per position).
        dim: the dimension of positions in `x` (default -2: ``(..., positions, features)``).

    Returns:
        `fn(x, *args, **kwargs)`; or, without `x`, the module `fn` itself, tiled.

    Raises:
        ValueError: `tiles` is not a positive int, `x` has no dimension `dim`, or `fn` is a module remat can tell
            is not token-wise (or holds a module sharded by FSDP2).
        TypeError: `x` is not a tensor, or `fn` returns something else than one tensor.
        RematError: a tile's output does not keep the tile's positions along `dim`.

    >>> import torch, remat
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    >>> x = torch.randn(2, 1024, 16, requires_grad=True)
    >>> y = remat.tiled(mlp, x, tiles=8)
    >>> torch.testing.assert_close(y, mlp(x))
    >>> y.sum().backward()
    >>> mlp = remat.tiled(mlp, tiles=8)   # in place: every call of `mlp` now runs in 8 tiles
    """
    count = _tile_count(tiles)
    if x is _NOTHING:
        if args or kwargs:
            raise TypeError("remat: tiled(module, tiles=...) tiles the module in place and takes no other "
                            "arguments; to call it, pass the input: `remat.tiled(module, x, tiles=...)`.")
        if not isinstance(fn, nn.Module):
            raise TypeError(f"remat: tiled without an input tiles a module in place, but got "
                            f"`{type(fn).__name__}`; pass the input to call a function in tiles.")
        return tile_module(fn, count, dim)
    if not callable(fn):
        raise TypeError(f"remat: tiled expects a module or a callable, but got `{type(fn).__name__}`.")
    module = _module_of(fn)
    site = _site_of(fn)
    _refuse(module, site)
    if isinstance(fn, nn.Module) and _gathers(fn):
        raise ValueError(
            f"remat: `{site}` is sharded ({_gathers(fn)}): called once per tile, its hooks would gather its "
            "parameters once per tile. Tile it in place instead, `remat.tiled(module, tiles=...)`: its hooks then "
            "run once per call, around the tiles."
        )
    return _tiled_call(fn, x, args, kwargs, count, dim, site, module)


# -- the in-place form ----------------------------------------------------------------------------------------


class TiledForward:
    """A tiled module instance's own `forward` (NOTE [ What is tiled ], rule 3): what the instance called before,
    over tiles of its first argument. Holds its module weakly, pickles and deep-copies with it, and answers
    `inspect.signature` as the forward it calls (as `SiteForward` does)."""

    __slots__ = ("_module", "chosen_by", "dim", "leaf", "own", "tiles")
    _remat_owned = True  # NOTE [ A model set aside ] in remat/_sites/targets.py

    def __init__(self, module: nn.Module, own: Callable[..., Any] | None, tiles: int, dim: int,
                 leaf: bool = False, chosen_by: str | None = None) -> None:
        self._module = weakref.ref(module)
        self.own, self.tiles, self.dim = own, tiles, dim
        self.leaf = leaf  # remat made the module a ZeRO-3 leaf module (NOTE [ What is tiled ], rule 4)
        self.chosen_by = chosen_by  # who tiled it where not the user: a budget (remat.plan says so)

    def module(self) -> nn.Module:
        return alive(self._module, "a tiled module's `forward`")

    def forward(self) -> Callable[..., Any]:
        """The forward this one calls, bound to the module."""
        if self.own is not None:
            return self.own
        module = self.module()
        return type(module).forward.__get__(module, type(module))  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        forward = self.forward()
        if args:
            x, rest = args[0], args[1:]
        else:
            name = _first_parameter(forward)
            if name is None or name not in kwargs:
                return forward(*args, **kwargs)
            kwargs = dict(kwargs)
            x, rest = kwargs.pop(name), ()
        return _tiled_call(forward, x, rest, kwargs, self.tiles, self.dim, _kind(module), module)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.forward()

    def __getattr__(self, name: str) -> Any:
        if name in _DELEGATED:
            return getattr(self.forward(), name)
        raise AttributeError(f"'TiledForward' object has no attribute '{name}'")

    def __reduce__(self) -> tuple[Any, ...]:
        return (TiledForward, (self.module(), self.own, self.tiles, self.dim, self.leaf, self.chosen_by))


_DELEGATED = frozenset({
    "__annotations__", "__code__", "__defaults__", "__func__", "__kwdefaults__", "__name__", "__qualname__",
    "__self__",
})


_LEAF = "_z3_leaf"


def _zero3_leaf(module: nn.Module) -> bool:
    """Make `module` a ZeRO-3 leaf module (NOTE [ What is tiled ], rule 4); whether remat set the mark."""
    if getattr(module, _LEAF, False):
        return False
    setattr(module, _LEAF, True)
    return True


def _first_parameter(forward: Callable[..., Any]) -> str | None:
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    return parameters[0].name if parameters else None


def _tiled_forward(module: nn.Module) -> tuple[Any, TiledForward] | None:
    """Where `module`'s `TiledForward` sits: `(holder, it)`, the holder being the module's `__dict__` or the
    `SiteForward` that a site put over it (NOTE [ Under torch.compile ])."""
    own = module.__dict__.get("forward")
    if isinstance(own, TiledForward):
        return module.__dict__, own
    if isinstance(own, SiteForward) and isinstance(own.own, TiledForward):
        return own, own.own
    return None


def tiled_of(module: nn.Module) -> TiledForward | None:
    """The `TiledForward` of a tiled module instance, or None."""
    found = _tiled_forward(module)
    return None if found is None else found[1]


def tile_module(module: _M, tiles: int, dim: int = -2, chosen_by: str | None = None) -> _M:
    """Tile `module` in place (a tiled one gets the new `tiles` and `dim`) and return it; see `remat.tiled`.
    `chosen_by` says who chose the tiles where the user did not (a budget: `remat.plan` shows it)."""
    count = _tile_count(tiles)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"remat: `dim` must be an int (the dimension of positions), but got `{type(dim).__name__}`.")
    _refuse(module, _kind(module))
    found = _tiled_forward(module)
    if found is not None:
        found[1].tiles, found[1].dim, found[1].chosen_by = count, dim, chosen_by
        return module
    own = module.__dict__.get("forward")
    leaf = _zero3_leaf(module)
    if isinstance(own, SiteForward):  # a site's forward stays on top: it tiles what it calls
        own.own = TiledForward(module, own.own, count, dim, leaf, chosen_by)
    else:
        module.__dict__["forward"] = TiledForward(module, own, count, dim, leaf, chosen_by)
    return module


def untile(module: nn.Module) -> None:
    """Give `module` back the forward it had before `tile_module` (nothing when it is not tiled)."""
    found = _tiled_forward(module)
    if found is None:
        return
    holder, tiled_forward = found
    if tiled_forward.leaf and not any(hasattr(param, "ds_id") for param in module.parameters()):
        module.__dict__.pop(_LEAF, None)
    if isinstance(holder, SiteForward):
        holder.own = tiled_forward.own
    elif tiled_forward.own is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = tiled_forward.own


# -- the token-wise modules of a model's blocks -------------------------------------------------------------


@dataclass(frozen=True)
class TileReport:
    """What `tile_blocks` tiled (qualified names) and what it left, with why."""

    tiled: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        lines = [f"tiled: {', '.join(self.tiled) or 'nothing'}"]
        lines += [f"not tiled: {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


Where = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool]


_NORM = re.compile(r"(RMS|Rms|Layer)Norm$")


def _default(name: str, module: nn.Module) -> bool:
    """NOTE [ What is tiled ], rule 2."""
    if name.rsplit(".", 1)[-1] in TILED_NAMES:
        return True
    return "." not in name and (isinstance(module, nn.LayerNorm) or bool(_NORM.search(_kind(module))))


def _matches(where: Where | None) -> Callable[[str, nn.Module], bool]:
    if where is None:
        return _default
    if isinstance(where, type) or (isinstance(where, tuple) and all(isinstance(k, type) for k in where)):
        kinds = where
        return lambda name, module: isinstance(module, kinds)
    if callable(where):
        return where
    raise TypeError("remat: `where` for tiles must be an nn.Module type, a tuple of types or a predicate "
                    f"(name, module) -> bool, but got `{type(where).__name__}`.")


def tile_blocks(blocks: Sequence[tuple[str, nn.Module]], tiles: int, *, dim: int = -2,
                where: Where | None = None, chosen_by: str | None = None) -> TileReport:
    """Tile the token-wise modules of each of `blocks` (`(qualified name, module)` pairs of a model) in place.

    Without `where`, a block's feed-forward modules as transformers names them (`TILED_NAMES`, the outermost in the
    block) and its own norms; a mixture of experts among them is skipped, and so is anything remat can tell is not
    token-wise (NOTE [ What is tiled ], rule 2). With `where` (a type, a tuple of types, or a predicate on `(name
    inside the block, module)`), the outermost matching modules, which must be token-wise (a ValueError otherwise).

    >>> block = nn.Module(); block.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> print(tile_blocks([("", block)], 4))
    tiled: mlp
    """
    count = _tile_count(tiles)
    select = _matches(where)
    tiled_names: list[str] = []
    skipped: list[tuple[str, str]] = []
    for block_name, block in blocks:
        chosen: list[str] = []
        for name, module in block.named_modules():
            if not name or any(name.startswith(outer + ".") for outer in chosen) or not select(name, module):
                continue
            chosen.append(name)
            full = f"{block_name}.{name}" if block_name else name
            why = not_token_wise(module) or (None if _sharded_inside(module) is None else
                                             "a module inside it is sharded by FSDP2")
            if why is not None:
                if where is not None:
                    _refuse(module, full)
                skipped.append((full, why))
                continue
            found = tiled_of(module) if chosen_by is not None else None
            if found is not None and found.chosen_by != chosen_by:
                continue  # tiled by the user: a budget's choice leaves it as it is (NOTE [ Tiles as a choice ])
            tile_module(module, count, dim, chosen_by)
            tiled_names.append(full)
    return TileReport(tuple(tiled_names), tuple(skipped))


def nothing_tiled(report: TileReport, blocks: Sequence[tuple[str, nn.Module]]) -> ValueError:
    """The error for `remat.apply(model, tiles=...)` on blocks without a token-wise module: what was looked for,
    and what was found but not tiled."""
    names = ", ".join(f"`{name}`" for name in TILED_NAMES)
    kinds = sorted({_kind(block) for _, block in blocks})
    skipped = "".join(f" Not tiled: `{name}`: {why}." for name, why in report.skipped)
    return ValueError(
        f"remat: apply with `tiles` found no token-wise module in the {len(blocks)} chosen blocks "
        f"({', '.join(kinds)}): it looks for a block's feed-forward module, named as transformers names it "
        f"({names}), and the norms that are the block's own children (LayerNorm, RMSNorm).{skipped} Tile other "
        "modules with `remat.tiled(module, tiles=...)`, or pick other blocks with `where`."
    )


claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
