"""Selective rematerialization: which activations inside a region are still saved.

See NOTE [ Policies ].
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch

from .public import claim

__all__ = ["Policy", "PolicyLike", "as_policy", "offload", "save_all", "save_matmuls", "save_nothing",
           "save_tagged", "tag"]

# NOTE [ Policies ]
# 1. A policy says which op outputs a region keeps from forward instead of rebuilding: a set of ops (decided per aten
#    overload, once: `save_matmuls`, or any callable `op -> bool`) and a set of tag names (`save_tagged`, with
#    `remat.tag(t, name)` naming a tensor, like JAX's `checkpoint_name`); `|` takes the union.
# 2. A kept op is never run again in recompute; the ops between kept ones are (the matmuls are not recomputed, the
#    cheap pointwise ops between them are).
# 3. A tagged tensor is kept when `tag` is called on it inside a region whose policy saves that name, and `tag`
#    returns the kept tensor in recompute.
#
# Implementation notes:
# 1. (rule 2) Forward runs under `SaveOps` (_engine/selective.py), which keeps the outputs of every chosen op in
#    order; recompute runs under `ReuseOps`, which hands them back instead of running the op.
# 2. (rules 2, 3) The pack hook keeps every kept tensor by reference.

# NOTE [ Some calls ]
# 1. A policy with `calls` keeps only some calls of its ops: the k-th call of a chosen op in a site's forward
#    (counted from 0) is kept when k is in `calls`; recompute, which makes the same calls in the same order, runs
#    the others again.
# 2. A policy may instead decide per call once the op ran (`chooses`).
# 3. Both work in eager code under the rerun strategy only, so they are not public and do not combine with `|`.
#
# Implementation notes:
# 1. (rule 1) `remat.apply(model, budget=...)` builds such policies for a block from its profiled run (the matmuls
#    worth the most recompute time per byte: NOTE [ Deriving choices ] in remat/_budget/costs_derived.py).
# 2. (rule 2) That is how `remat.checkpoint` carries out torch's selective-checkpoint policy functions
#    (`context_fn`), which see each call's arguments and outputs.

_Op = Callable[[Any], bool]
# (op, args, kwargs, outputs) -> whether this call's outputs are kept
_Call = Callable[[Any, Any, Any, Any], bool]
#: What `policy=` takes: a `Policy`, a callable choosing aten overloads, or None (save nothing).
PolicyLike = Union["Policy", _Op, None]


class Policy:
    """Which activations a region keeps; combine with `|`.

    >>> import remat
    >>> policy = remat.policies.save_matmuls | remat.policies.save_tagged("attn")
    >>> policy.saves_name("attn")
    True
    """

    __slots__ = ("_cache", "calls", "chooses", "everything", "names", "offloads", "ops")

    def __init__(
        self, ops: Iterable[_Op] = (), names: Iterable[str] = (), everything: bool = False,
        offloads: bool = False, calls: frozenset[int] | None = None, chooses: _Call | None = None,
    ) -> None:
        self.ops = tuple(ops)
        self.names = frozenset(names)
        self.everything = everything
        self.offloads = offloads  # what it keeps goes to host memory: see `offload`
        # only these calls of the chosen ops, numbered in the order a site's forward makes them (NOTE [ Some
        # calls ]); None: every call
        self.calls = calls
        # decides per call of a chosen op, once it ran, whether its outputs are kept (NOTE [ Some calls ]); None:
        # every call
        self.chooses = chooses
        self._cache: dict[int, tuple[Any, bool]] = {}

    def saves_op(self, op: Any) -> bool:
        """Whether outputs of the aten overload `op` are kept (decided once per overload)."""
        # Keyed by id (an `OpOverload` hashes in Python, a large part of the lookup's cost); the entry holds the op,
        # so its id is never reused for another while the entry lives.
        found = self._cache.get(id(op))
        if found is None or found[0] is not op:
            found = self._cache[id(op)] = (op, any(choose(op) for choose in self.ops))
        return found[1]

    def saves_name(self, name: str) -> bool:
        """Whether tensors tagged `name` are kept."""
        return name in self.names

    @property
    def saves_nothing(self) -> bool:
        """True for the default policy: every activation is rebuilt."""
        return not (self.ops or self.names or self.everything)

    def __or__(self, other: Policy | _Op) -> Policy:
        other = as_policy(other)
        if self.calls is not None or other.calls is not None or self.chooses is not None or other.chooses is not None:
            raise ValueError("remat: a policy that keeps some calls of its ops does not combine with `|`.")
        if self.offloads != other.offloads:
            raise ValueError(
                f"remat: cannot combine `{self!r}` and `{other!r}`: one keeps on the device, the other offloads; "
                "combine the inner policies and offload the result: offload(a | b)."
            )
        return Policy(
            self.ops + other.ops, self.names | other.names, self.everything or other.everything, self.offloads
        )

    __ror__ = __or__

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its per-op cache: aten overloads do not pickle, and the cache fills again on use."""
        return {name: getattr(self, name) for name in self.__slots__ if name != "_cache"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._cache = {}

    def __repr__(self) -> str:
        if self.everything:
            return "save_all"
        parts = [getattr(op, "__name__", repr(op)) for op in self.ops]
        if self.names:
            parts.append(f"save_tagged{tuple(sorted(self.names))}")
        text = " | ".join(parts) or "save_nothing"
        if self.calls is not None:
            text += f"[calls {','.join(map(str, sorted(self.calls)))}]"
        return f"offload({text})" if self.offloads else text


def as_policy(policy: PolicyLike) -> Policy:
    """`None` is `save_nothing`; a callable `op -> bool` chooses ops; a `Policy` is itself."""
    if policy is None:
        return save_nothing
    if isinstance(policy, Policy):
        return policy
    if callable(policy):
        return Policy(ops=(policy,))
    if isinstance(policy, str):  # NOTE [ A policy is an object, not its name ]
        ready = ("save_nothing", "save_all", "save_matmuls")
        hint = (f"pass remat.policies.{policy} itself" if policy in ready else
                f"the ready ones are {', '.join(f'remat.policies.{name}' for name in ready)}, and "
                "remat.policies.save_tagged(*names) keeps tensors tagged with remat.tag")
        raise TypeError(f"remat: `policy` takes a policy, not its name: got the string {policy!r}; {hint}.")
    raise TypeError(
        f"remat: `policy` must be a callable or one of remat.policies, but got `{type(policy).__name__}`."
    )


# NOTE [ A policy is an object, not its name ]
# 1. `policy=` (and `choices=`, `policies.offload(...)`, `|`) takes a policy object or a callable, never its name as a
#    string: `policy="save_matmuls"` is a TypeError that names `remat.policies.save_matmuls`.
# 2. `remat.estimate(configs=...)` and `python -m remat estimate` take names ("none", "full", "save_matmuls",
#    "full+head", 0.3): a configuration is not a policy (it may be no remat, a budget or the head), and a command
#    line can only give names.
# Implementation notes:
# 1. (rule 1) A policy spelled as an object is checked by mypy and found by an editor; a string would be one more
#    spelling of each policy, checked only at run time, and `save_tagged(*names)` has no string form anyway.


@functools.cache
def _matmul_packets() -> frozenset[Any]:
    aten = torch.ops.aten
    names = (
        "mm", "bmm", "addmm", "baddbmm", "convolution", "_convolution", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    )
    return frozenset(getattr(aten, name) for name in names if hasattr(aten, name))


def matmuls(op: Any) -> bool:
    """Matmul-class ops: mm, bmm, addmm, baddbmm, convolution, scaled-dot-product attention kernels."""
    return getattr(op, "overloadpacket", None) in _matmul_packets()


save_nothing = Policy()
save_all = Policy(everything=True)
save_matmuls = Policy(ops=(matmuls,))


def save_tagged(*names: str) -> Policy:
    """Keep the tensors named with `remat.tag(t, name)` for any of `names`.

    >>> import remat
    >>> remat.policies.save_tagged("attn", "mlp").names == {"attn", "mlp"}
    True
    """
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"remat: save_tagged takes tag names (str), but got `{type(name).__name__}`.")
    return Policy(names=names)


def offload(policy: PolicyLike) -> Policy:
    """Keep what `policy` keeps in host memory instead of on the device (JAX's save-and-offload).

    A site with this policy saves the same op outputs and tags as with `policy`, and does not recompute
    them, but copies them to host memory in forward and back in backward (see `remat.offload`); its inputs
    stay where they are unless the site also has `offload=True`. On CPU it is the same as `policy`.

    Raises:
        ValueError: for `save_all`, which would offload everything: use `with remat.offload():` instead.

    >>> import remat
    >>> remat.policies.offload(remat.policies.save_matmuls)
    offload(matmuls)
    """
    inner = as_policy(policy)
    if inner.everything:
        raise ValueError(
            "remat: offload(save_all) would keep every activation on the host without rematerializing "
            "anything; use `with remat.offload():` around the code instead."
        )
    return Policy(inner.ops, inner.names, offloads=True)


class _Tags(threading.local):
    """The innermost region whose policy keeps tags, for `tag` to report to."""

    def __init__(self) -> None:
        self.sinks: list[Callable[[torch.Tensor, str], torch.Tensor]] = []


tags = _Tags()


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Name `tensor` for `save_tagged`; returns it (in recompute, the kept tensor from forward).

    Outside a region whose policy saves `name`, this is the identity and costs one list check.

    >>> import torch, remat
    >>> @remat(policy=remat.policies.save_tagged("h"))
    ... def f(x):
    ...     return remat.tag(x.sin(), "h").cos()
    >>> f(torch.ones(2, requires_grad=True)).sum().backward()
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"remat: tag expects a tensor, but got `{type(tensor).__name__}`.")
    sinks = tags.sinks
    return sinks[-1](tensor, name) if sinks else tensor

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
