"""Per-rank estimates of a sharded step: `remat.estimate(model, sample, world_size=N, ...)`.

NOTE [ Estimating one rank of FSDP2 ]
An estimate of one rank of an FSDP2 (``fully_shard``) model runs on a sharded *shadow* of the model, on a fake
process group, and changes neither the user's model nor their process group.

Rules:
1. FSDP2 keeps its own references to a module's parameters (sharded ``DTensor``s, the flat shard each rank holds,
   the all-gather buffers), so swapping fake tensors into the user's sharded model, as an estimate does for a
   plain one, breaks FSDP (its lazy initialisation reads the swapped parameters) or is ignored by it (once
   initialised it uses its own). So the estimate runs on a shadow: a copy of the module tree that shares nothing
   mutable with the user's, whose parameters are meta tensors of the full (unsharded) shape.
2. Inside the estimate's fake mode the shadow is sharded again with ``fully_shard``, module by module with the
   settings the user's model had (``reshard_after_forward``, the mixed-precision policy), or, for
   ``shard="fsdp2"``, on every block that `remat.apply` would pick and on the root.
3. The mesh is one dimension of ``world_size`` ranks over torch's fake process group (``init_process_group
   ("fake")``: collectives do nothing, every rank's shapes are right). The estimate is rank 0's, the largest shard
   where parameters do not divide evenly.

Implementation notes:
1. (rule 1) Each module is shallow-copied, with its own tables of parameters, buffers, children and hooks, and
   FSDP's own class, hooks and state are taken out of the copy.
2. (rule 3) The fake group is initialised for the estimate and destroyed after it. A fake default group the user
   initialised (torchtitan's recipe, with the model ``fully_shard``-ed on it) is used as it is and left to the
   user.
3. (rule 2) FSDP's frees (``resize_(0)`` of unsharded parameters) are counted by the tracker (NOTE [ Resized
   storages ] in remat/_measure/resize.py).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._core.errors import RematError
from .._core.torch_compat import fake_store, fsdp_state_keys
from .._engine.compiled import SiteForward

__all__ = [
    "Sharding", "fake_world", "is_sharded", "is_sharded_any", "mesh_size", "shadow", "shard", "users_fake_world",
]

_HOOK_TABLES = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


@dataclass(frozen=True)
class Sharding:
    """How one module of the shadow is to be sharded: ``fully_shard``'s settings."""

    reshard_after_forward: bool | None
    mp_policy: Any


def _fsdp_module() -> type | None:
    """FSDP2's module class, or None where ``torch.distributed.fsdp`` was never imported: then no module has been
    ``fully_shard``-ed, and importing it only to ask would cost every budgeted model a slow import."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)  # None too on a torch without it


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or one of its modules."""
    return is_sharded_any(model.modules())


def is_sharded_any(modules: Iterable[nn.Module]) -> bool:
    """Whether ``fully_shard`` was applied to one of ``modules`` themselves (their children are not looked at)."""
    fsdp = _fsdp_module()
    return fsdp is not None and any(isinstance(m, fsdp) for m in modules)


def mesh_size(model: nn.Module) -> int | None:
    """The number of ranks ``model``'s outermost ``fully_shard``-ed module shards over, or None if none is."""
    fsdp = _fsdp_module()
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if fsdp is not None and isinstance(module, fsdp):
            group = getattr(fully_shard.state(module), "_fsdp_param_group", None)  # type: ignore[attr-defined]
            if group is not None:
                return int(group.mesh_info.shard_mesh_size)
    return None


def _sharding_of(module: nn.Module) -> Sharding:
    # torch-compat: FSDP2's private state (fully_shard.state(m)._fsdp_param_group.post_forward_mesh_info,
    # ._auto_reshard_after_forward, .mp_policy); without them the module is re-sharded with fully_shard's defaults.
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    group = getattr(state, "_fsdp_param_group", None)
    reshard: bool | None = None
    if group is not None and not getattr(state, "_auto_reshard_after_forward", False):
        reshard = getattr(group, "post_forward_mesh_info", None) is not None
    policy = getattr(group, "mp_policy", None) if group is not None else getattr(state, "_mp_policy", None)
    return Sharding(reshard, policy)


def _from_fsdp(hook: Any) -> bool:
    owner = getattr(hook, "__self__", hook)
    return type(owner).__module__.startswith("torch.distributed") or str(
        getattr(hook, "__module__", "")).startswith("torch.distributed")


def _meta(value: torch.Tensor, parameter: bool) -> torch.Tensor:
    full = torch.empty(value.shape, dtype=value.dtype, device="meta")  # a DTensor's shape is the global one
    return nn.Parameter(full, requires_grad=value.requires_grad) if parameter else full


def shadow(model: nn.Module) -> tuple[nn.Module, dict[nn.Module, Sharding]]:
    """A copy of ``model``'s module tree with meta parameters of full size and no FSDP; see the NOTE above.

    Returns the shadow root and, for each shadow module the user had ``fully_shard``-ed, its settings.
    """
    fsdp = _fsdp_module()
    private = fsdp_state_keys()  # where fully_shard keeps its state: taken out of the copy
    copies: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}
    settings: dict[nn.Module, Sharding] = {}

    def copy_module(module: nn.Module) -> nn.Module:
        if id(module) in copies:  # a module used twice stays one module
            return copies[id(module)]
        cls = type(module)
        if fsdp is not None and isinstance(module, fsdp):
            cls = next(base for base in cls.__bases__ if base is not fsdp)
        new = cls.__new__(cls)
        copies[id(module)] = new
        state = {k: v for k, v in vars(module).items() if k not in private}
        for name in _HOOK_TABLES:
            if name in state:
                state[name] = type(state[name])((k, v) for k, v in state[name].items() if not _from_fsdp(v))
        for name in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            if name in state:
                live = set(state["_forward_pre_hooks"]) | set(state["_forward_hooks"])
                state[name] = type(state[name])((k, v) for k, v in state[name].items() if k in live)
        for table, parameter in (("_parameters", True), ("_buffers", False)):
            state[table] = {
                k: None if v is None else tensors.setdefault(id(v), _meta(v, parameter))
                for k, v in state[table].items()
            }
        state["_modules"] = {k: None if v is None else copy_module(v) for k, v in state["_modules"].items()}
        state = {k: copy.copy(v) if isinstance(v, (dict, list, set)) and not k.startswith("_") else v
                 for k, v in state.items()}
        forward = state.get("forward")
        if isinstance(forward, SiteForward):  # a site's own forward, bound to the copy (NOTE [ Under torch.compile ])
            state["forward"] = SiteForward(new, forward.own, forward.site)
        new.__dict__.update(state)
        if fsdp is not None and isinstance(module, fsdp):
            settings[new] = _sharding_of(module)
        return new

    return copy_module(model), settings


def shard(root: nn.Module, settings: dict[nn.Module, Sharding], mesh: Any) -> None:
    """``fully_shard`` the shadow's modules, children first, with their settings (inside the fake mode)."""
    from torch.distributed.fsdp import fully_shard

    order = [m for m in root.modules() if m in settings]
    for module in reversed(order):  # children before their parents, as FSDP asks
        s = settings[module]
        kwargs: dict[str, Any] = {"mesh": mesh}
        if s.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = s.reshard_after_forward
        if s.mp_policy is not None:
            kwargs["mp_policy"] = s.mp_policy
        fully_shard(module, **kwargs)


def users_fake_world() -> int | None:
    """The number of ranks of the user's own fake default process group, or None where there is none."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "fake":
        return None
    return int(dist.get_world_size())


@contextlib.contextmanager
def fake_world(world_size: int, device: torch.device) -> Iterator[Any]:
    """A fake default process group of ``world_size`` ranks for the block; yield its 1-D device mesh.

    A fake default group the user initialised (torchtitan's recipe: ``init_process_group("fake", ...)``) is used
    as it is, and left initialised; otherwise one is made for the block and destroyed after it.
    """
    from torch.distributed.device_mesh import init_device_mesh

    users = users_fake_world()
    if users is not None:
        if users != world_size:
            raise ValueError(
                f"remat: estimate got world_size={world_size}, but the fake process group initialised here has "
                f"{users} ranks. Pass world_size={users} (or none), or estimate outside that process group."
            )
        yield init_device_mesh(device.type, (world_size,))  # the default group itself: nothing new to destroy
        return
    if dist.is_initialized():
        raise RematError(
            "remat: estimate with `world_size` runs one rank on torch's fake process group, but a default process "
            f"group ({dist.get_backend()!r}) is already initialised here. Estimate before `init_process_group`, in a "
            "separate process, or in a fake process group of your own (init_process_group('fake', ...)); the "
            "estimate needs no other rank."
        )
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh(device.type, (world_size,))  # outside any fake mode: the mesh reads real ranks
    finally:
        dist.destroy_process_group()
