"""What `remat.apply` is asked: one request per way of choosing the blocks' policies, built and checked here.

`remat.apply(model, ...)`'s keywords become one of three requests (`request_for`), each a frozen dataclass whose
construction raises the argument errors, before anything touches the model:

* `BlocksRequest`: one policy for the blocks `where` picks (`every`, `policy`, `enabled`, `name`);
* `BudgetRequest`: `budget=`, the bytes a training step may allocate (profiled on `sample`);
* `MemoryRequest`: `memory=`, a device's whole memory for the step (with `optimizer=`, `headroom=`).

NOTE [ The requests of remat.apply ]
1. Every keyword of `remat.apply` is a field of the requests, declared once, on the class whose requests take it:
   `Request` holds what every request takes (`where`, the head, the tiles, offload, the blocks' `preserve_rng`,
   `strategy`, `check`),
   `FitRequest` what budget and memory requests take (`sample`, `loss`, `choices`, `replan`, `compile`).
2. Which request the keywords make is read from the keywords given (a value other than its default): `memory` or
   `optimizer` make a memory request, `budget` a budget request, anything else a blocks request; a keyword given
   that the request does not take is a `ValueError` that says where it belongs.
3. A request is checked whole when it is made: a value of the wrong kind is a `TypeError`, one out of range a
   `ValueError`, with the words `remat.apply`'s users know (`budget=`, `sample=`). Its fields hold the values read
   (a budget given as a string with a unit, as its bytes).
4. One dispatch on the request's type picks the driver (remat/_apply/drive.py). A new option is one field here, on
   the class whose requests take it, and one keyword in `remat.apply`'s signature.

Implementation notes:
1. (rule 4) Users write keywords; requests are not public (docs/design.md, "The requests of remat.apply", says why).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, TypeVar

from torch import nn

from .options import Offloader, Options, Strategy
from .policies import PolicyLike, as_policy
from .units import parse_budget, parse_memory

__all__ = ["TILES", "BlocksRequest", "BudgetRequest", "FitRequest", "MemoryRequest", "Request", "Where", "request_for"]

#: What `remat.apply` (and `remat.estimate`) take as `where`: a module type, a tuple of them, or a predicate on
#: `(qualified name, module)`; None picks the model's repeated blocks (NOTE [ Picking blocks ] in
#: remat/_sites/blocks.py).
Where = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool]

_F = TypeVar("_F", bound="FitRequest")

TILES = 8
"""How many tiles `tiles=True` (and an estimate's "+tiles", and a budget that takes tiles) runs a token-wise module
in: NOTE [ Tiles as a choice ] in remat/_budget/tiles_choice.py says why this count."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """What every `remat.apply` takes (NOTE [ The requests of remat.apply ]).

    Attributes:
        where: which submodules are the blocks (None: the model's repeated blocks).
        head: `True` routes a causal LM's loss through `remat.linear_cross_entropy`; `None` lets a budget or
            memory plan route it where only that fits; `False` never.
        tiles: how many tiles the chosen blocks' token-wise modules run in (`remat.tiled`, NOTE [ What is tiled ]
            in remat/_sites/tiles.py): a count of at least 1, or `True` for `TILES`; `None` lets a budget or memory
            plan take `TILES` where only that fits (NOTE [ Tiles as a choice ]); `False` never.
        offload: what the rematerialized blocks keep goes to host memory: `True` or a `remat.offload(...)`;
            `None` lets a budget or memory plan on an accelerator offload where only that fits (NOTE [ Offload as a
            choice ] in remat/_budget/offload_choice.py), and is `False` for the blocks of one policy; `False`
            never.
        preserve_rng, strategy, check: the blocks' options besides their policy, as for `remat`.
    """

    where: Where | None = None
    head: bool | None = None
    tiles: int | bool | None = None
    offload: bool | Offloader | None = None
    preserve_rng: bool = True
    strategy: Strategy = "rerun"
    check: bool = True

    def __post_init__(self) -> None:
        if self.head is not None and not isinstance(self.head, bool):
            raise TypeError(f"remat: `head` must be a bool or None, but got `{type(self.head).__name__}`.")
        if self.tiles is not None and not isinstance(self.tiles, (bool, int)):
            raise TypeError(f"remat: `tiles` must be a count of tiles (an int of at least 1), True (for {TILES}), "
                            f"False or None, but got `{type(self.tiles).__name__}`.")
        if not isinstance(self.tiles, bool) and isinstance(self.tiles, int) and self.tiles < 1:
            raise ValueError(f"remat: `tiles` must be a count of at least 1 (how many tiles each token-wise module "
                             f"runs in), but got {self.tiles}.")
        self.options(None)  # the blocks' options, checked before any hook is placed

    @property
    def tile_count(self) -> int | None:
        """How many tiles the request asks for (`True` is `TILES`); None where it asks for none."""
        if self.tiles is True:
            return TILES
        return None if self.tiles is None or self.tiles is False else int(self.tiles)

    def options(self, policy: PolicyLike, offload: bool | Offloader | None = None) -> Options:
        """The options of a block under `policy`, what it keeps on the host where `offload` says (None: where the
        request's `offload` does)."""
        return Options(policy=policy, preserve_rng=self.preserve_rng, strategy=self.strategy, check=self.check,
                       offload=self._offload(offload))

    def _offload(self, offload: bool | Offloader | None) -> bool | Offloader:
        chosen = self.offload if offload is None else offload
        return False if chosen is None else chosen


@dataclass(frozen=True, kw_only=True)
class BlocksRequest(Request):
    """`remat.apply(model, where, every=..., policy=...)`: every `every`-th block under one policy.

    Attributes:
        every: keep every `every`-th block, counting from the first.
        policy, enabled, name: as for `remat`.
    """

    every: int = 1
    policy: PolicyLike = None
    enabled: bool | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"remat: `every` must be a positive int, but got {self.every!r}.")
        self.options(self.policy)

    def options(self, policy: PolicyLike, offload: bool | Offloader | None = None) -> Options:
        return Options(policy=policy, preserve_rng=self.preserve_rng, strategy=self.strategy, enabled=self.enabled,
                       check=self.check, name=self.name, offload=self._offload(offload))


@dataclass(frozen=True, kw_only=True)
class FitRequest(Request):
    """What budget and memory requests take: how the blocks' choices are fitted on training steps of `sample`.

    Attributes:
        sample: the model's inputs for one training step: a tensor, a tuple, or a dict of keywords.
        loss: from the model's output to the scalar loss (None: its `.loss`, else the sum of its floating tensors).
        choices: more policies a block may get besides kept, `save_matmuls` and full remat.
        replan: plan again when the model is called in training with a new input signature.
        compile: plan for the model compiled as one graph.
        first_step: where the prediction fits, leave the verification to the model's first training step (NOTE
            [ The first step ] in remat/_budget/first_step.py); False verifies every plan on the sample before it is
            kept, as `remat.estimate` does, whose model trains no step. Not a keyword of `remat.apply`.
    """

    sample: Any = None
    loss: Callable[[Any], Any] | None = None
    choices: Sequence[PolicyLike] | None = None
    replan: bool = True
    compile: bool = False
    first_step: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss is not None and not callable(self.loss):
            raise TypeError(f"remat: `loss` must be a callable from the output to a scalar, but got {self.loss!r}.")
        for flag in ("replan", "compile"):
            given = getattr(self, flag)
            if not isinstance(given, bool):
                raise TypeError(f"remat: `{flag}` must be a bool, but got `{type(given).__name__}`.")
        for extra in self.choices or ():
            as_policy(extra)  # a TypeError for anything else
            if self.strategy != "rerun":
                raise ValueError("remat: `choices` (policies) work with strategy='rerun' only; leave out `strategy`.")

    def for_replans(self: _F) -> _F:
        """The request as a model's budget keeps it for its later plans: without what belongs to this call alone (the
        sample, `where`, an optimizer object), which must not live as long as the model."""
        lasting = copy.copy(self)
        for name in ("sample", "where", "optimizer"):
            if hasattr(lasting, name):
                object.__setattr__(lasting, name, None)
        return lasting

    def _needs_sample(self, keyword: str) -> None:
        if self.sample is None:
            raise ValueError(
                f"remat: apply with {keyword} needs `sample=`: the model's inputs for one training step (a tensor, "
                "a tuple of positional arguments, or a dict of keyword arguments), to profile the blocks on."
            )


@dataclass(frozen=True, kw_only=True)
class BudgetRequest(FitRequest):
    """`remat.apply(model, budget=..., sample=...)`: the blocks' choices that fit a training step in `budget`.

    Attributes:
        budget: bytes, or a float in (0, 1]: that fraction of the step's peak without remat (held as read:
            `parse_budget`).
    """

    budget: int | float

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", parse_budget(self.budget))
        self._needs_sample("a `budget`")
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class MemoryRequest(FitRequest):
    """`remat.apply(model, memory=..., sample=..., optimizer=...)`: the blocks' choices that fit the whole step in
    a device's memory.

    Attributes:
        memory: the device's memory in bytes (held as read: `parse_memory`).
        optimizer: the optimizer the step runs: an optimizer object, its class, "sgd", "adam" or "adamw" (None: no
            optimizer step).
        headroom: what of `memory` to leave to the device's allocator: a fraction or bytes (None: the device's
            default, NOTE [ The allocator's reserve ] in remat/_estimate/reserve.py).
    """

    memory: int
    optimizer: Any = None
    headroom: float | int | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory", parse_memory(self.memory, "apply's `memory`"))
        self._needs_sample("`memory`")
        super().__post_init__()


_KINDS = (BlocksRequest, BudgetRequest, MemoryRequest)
_DEFAULTS = {f.name: f.default for kind in _KINDS for f in fields(kind) if f.default is not MISSING}
_DEFAULTS.update(budget=None, memory=None)  # required by their requests: given is not None
_NOT_PLANNED = ("every", "policy", "enabled", "name")
_FITTED = ("sample", "loss", "choices", "replan", "compile")


def request_for(**keywords: Any) -> Request:
    """The request `remat.apply`'s keywords make (NOTE [ The requests of remat.apply ]), checked.

    >>> request_for(budget="1KiB", sample=1).budget, type(request_for(every=2)).__name__
    (1024, 'BlocksRequest')
    """
    given = {key for key, value in keywords.items() if not _is_default(key, value)}
    kind: type[Request]
    if given & {"memory", "optimizer"}:
        if "budget" in given or "memory" not in given:
            raise ValueError("remat: apply takes either `budget` (activations) or `memory` (the whole step, with "
                             "`optimizer`), not both; `optimizer` goes with `memory`.")
        kind = MemoryRequest
    elif "budget" in given:
        if "headroom" in given:
            raise ValueError("remat: `headroom` goes with `memory=` (what of the device to leave to its allocator); "
                             "a `budget` bounds the tensors' bytes alone.")
        kind = BudgetRequest
    else:
        if given & set(_FITTED):
            raise ValueError(f"remat: {_listed(_FITTED)} go with `budget=`; give a budget too.")
        if "headroom" in given:
            raise ValueError("remat: `headroom` goes with `memory=` (what of the device to leave to its allocator).")
        kind = BlocksRequest
    if kind is not BlocksRequest and given & set(_NOT_PLANNED):
        raise ValueError(f"remat: apply with a `budget` chooses the policy of every block itself; leave out "
                         f"{_listed(_NOT_PLANNED)} (add policies to choose from with `choices=`).")
    taken = {f.name for f in fields(kind)}
    return kind(**{key: value for key, value in keywords.items() if key in taken})


def _is_default(key: str, value: Any) -> bool:
    default = _DEFAULTS.get(key, MISSING)
    return value is default or (type(value) is type(default) and value == default)


def _listed(names: Sequence[str]) -> str:
    quoted = [f"`{name}`" for name in names]
    return f"{', '.join(quoted[:-1])} and {quoted[-1]}"
