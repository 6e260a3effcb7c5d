"""The public decorator object: `remat`, with `apply`, `plan`, `undo` and `region` (defined here, each also a name of
the package) and every other public name as attributes.

`import remat; @remat` and `from remat import remat; @remat` are the same object (the package module forwards
calls to it), so every spelling takes the same options, validated when decorating, never first at call time.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar, overload

from torch import nn

from ._core import errors as _errors
from ._core import policies as _policies
from ._core import switch as _switch
from ._core.options import Options, Strategy
from ._core.policies import PolicyLike
from ._core.public import DEPRECATED, claim, deprecated, names
from ._core.units import Budget
from ._engine import offload as _offload
from ._engine.region import Region
from ._sites import checkpoint as _checkpoint
from ._sites import targets as _targets
from ._sites.partial import decorate
from ._sites.table import ModelPlan

if TYPE_CHECKING:
    from . import policies as _policies_module
    from ._chain import chain as _chain
    from ._chain import schedule as _schedule
    from ._chain import simulate as _simulate
    from ._chain import solver as _solver
    from ._core.requests import Where
    from ._estimate import estimate as _estimate
    from ._estimate import report as _estimate_report
    from ._measure import measure as _measure
    from ._measure import measurement as _measure_report
    from ._measure import track as _track
    from ._sites import cross_entropy as _cross_entropy
    from ._sites import tiles as _tiles

__all__ = ["Decorator", "Remat", "apply", "plan", "region", "remat", "undo"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_M = TypeVar("_M", bound=nn.Module)


class Decorator(Protocol):
    """What `remat(...)` with options only returns: a decorator for any target."""

    @overload
    def __call__(self, target: type[_M], /) -> type[_M]: ...
    @overload
    def __call__(self, target: _M, /) -> _M: ...
    @overload
    def __call__(self, target: Callable[_P, _R], /) -> Callable[_P, _R]: ...


class _PoliciesModule(Protocol):
    """The type of `remat.policies` (a module) as an attribute of the decorator object; mypy checks the module
    against it."""

    @property
    def Policy(self) -> type[_policies.Policy]: ...
    @property
    def save_nothing(self) -> _policies.Policy: ...
    @property
    def save_all(self) -> _policies.Policy: ...
    @property
    def save_matmuls(self) -> _policies.Policy: ...
    def save_tagged(self, *names: str) -> _policies.Policy: ...


def apply(
    model: _M,
    where: Where | None = None,
    *,
    every: int = 1,
    policy: PolicyLike = None,
    preserve_rng: bool = True,
    strategy: Strategy = "rerun",
    enabled: bool | None = None,
    check: bool = True,
    name: str | None = None,
    offload: bool | _offload.Offload | None = None,
    budget: Budget | None = None,
    sample: Any = None,
    loss: Callable[[Any], Any] | None = None,
    choices: Sequence[PolicyLike] | None = None,
    replan: bool = True,
    memory: Budget | None = None,
    optimizer: Any = None,
    head: bool | None = None,
    compile: bool = False,
    headroom: float | int | str | None = None,
    tiles: int | bool | None = None,
) -> _M:
    """Rematerialize every `every`-th submodule of `model` selected by `where`, in place.

    A submodule inside one already selected is not selected again (no nested regions). Without `where`,
    the model's repeated blocks are chosen: on a Hugging Face model the layers its own gradient
    checkpointing wraps, elsewhere the children of the `nn.ModuleList`s and `nn.Sequential`s whose children
    share one class, gathered by class (all of a ResNet's stages), the class with the most blocks outside others
    (NOTE [ Picking blocks ] in remat/_sites/blocks.py); `remat.plan(model)` lists them.

    Args:
        model: the model; it is changed in place and returned.
        where: an `nn.Module` type, a tuple of types, a predicate `(name, module) -> bool`, or None.
        every: keep every `every`-th match, counting from the first (`every=2`: 1st, 3rd, ...).
        policy, preserve_rng, strategy, enabled, check, name: as for `remat`.
        offload: as for `remat`: what the blocks keep for backward goes to host memory (`True`, or
            `remat.offload(...)`), for every block a `budget`/`memory` plan rematerializes too. `None` (the
            default): no offload, except that a `budget`/`memory` plan on an accelerator offloads what its
            rematerialized blocks keep where no plan fits without it (after the head and tiles:
            `remat.plan(model)` says so); `False`: never.
        budget: instead of one `policy` for all, fit a memory budget: bytes (an int, or a string
            such as "1.5GiB"), or a float in (0, 1], that fraction of the activation peak of a training step
            without remat. One training step on `sample` is profiled and each block gets the choice — kept,
            `save_matmuls`, full remat, or one of `choices` — that makes the predicted peak fit at the least
            predicted time; `remat.plan(model)` shows the plan. The model's first training step is tracked and
            checks the plan, which is corrected before the next step if that step went over the budget (or,
            where the prediction does not fit, one step of `sample` is measured before `apply` returns).
        sample: with `budget`, the model's inputs for one step: a tensor, a tuple, or a dict of keywords.
        loss: with `budget`, a callable from the model's output to the scalar loss (default: the output's
            `.loss` if it has one, else the sum of its floating tensors).
        choices: with `budget`, more policies a block may get besides kept, save_matmuls and full remat.
        replan: with `budget`, profile and plan again when the model is called with a new input shape.
        memory: instead of `budget`, the device memory a whole training step must fit in (bytes, or a string
            such as "80GiB"), as the device counts it (what its allocator reserves): what the parameters,
            buffers, `sample` and the optimizer's state take is counted exactly (as `remat.estimate` does) and
            the rest, less `headroom`, is for the activations and gradients (the plan's checked step starts
            without gradients, so both count).
        optimizer: with `memory`, the optimizer the step runs: an optimizer object, its class, "sgd",
            "adam" or "adamw" (None: no optimizer step).
        headroom: with `memory`, what of it to leave to the device's allocator, which reserves more than its
            tensors take (rounding, cached blocks, fragmentation): a fraction of `memory` or bytes. Default:
            0.1 where the allocator caches (CUDA; the plan's real step is then also checked against what the
            allocator reserved, and planned again for less where it went over), 0 on the CPU.
        compile: with `budget` or `memory`, plan for the model compiled as one graph (not block by block):
            compiled costs, checked on compiled steps `apply` runs; a fraction is of compiled no-remat's peak.
        head: `True` also computes the loss of a Hugging Face causal LM (GPT-2, Llama, Mistral, Qwen, Gemma,
            ...; tied embeddings and PEFT-wrapped ones too) through `remat.linear_cross_entropy`: in training, a
            forward given `labels` computes its loss over chunks of tokens (labels shifted and ignored as the
            model's own loss does; Gemma 2's soft-capping and logit scales kept), never holding all the
            logits, and its output's `logits` is None; a forward without labels, or in eval, is unchanged.
            Combines with every other option (a fractional budget stays a fraction of the step with the
            model's own head, turned into bytes on `sample`). `None` (the default): only a `budget`/`memory`
            plan routes the head, and only where no plan fits without it (`remat.plan(model)` says so);
            `False`: never. `remat.undo` removes it.
        tiles: run the token-wise modules of the blocks `where` selects over the sequence in this many tiles
            (`remat.tiled`): on a Hugging Face model each decoder layer's MLP (as transformers names it:
            `mlp`, `feed_forward`, ...) and the layer's own norms; a mixture of experts is skipped. Their
            intermediates, which full remat holds while a block's backward runs, shrink by the count; the
            gradients are those of the untiled modules. An int of at least 1, or `True` for 8. `None` (the
            default): only a `budget`/`memory` plan tiles, with 8 tiles and only where no plan fits without
            them (after the head: `remat.plan(model)` says so); `False`: never. Combines with `head=True` and
            `offload=True`; `remat.undo` takes the tiles off.

    Raises:
        ValueError: when `where` matches no submodule (or, without `where`, no repeated blocks are found),
            or `every` is not a positive int; with `head=True`, when the model has no head it can route, and
            with `tiles`, when the blocks hold no token-wise module (each message says what it looked for) or
            the count is below 1.
        TypeError: `tiles` is not an int, a bool or None.
        BudgetError: with `budget`, no choice per block fits; the message names the smallest budget that does.
            With `memory`, the step does not fit even with full remat; `least_bytes` is the least total.

    >>> import torch, remat
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    >>> model = remat.apply(model, torch.nn.Linear)
    >>> model = remat.apply(remat.undo(model), torch.nn.Linear, budget=1.0, sample=torch.randn(8, 4))
    """
    keywords = dict(locals())  # every keyword once: remat/_core/requests.py sorts them into one request
    del keywords["model"]
    from ._apply.drive import drive  # with the requests, loaded by the first call: `import remat` stays cheap
    from ._core.requests import request_for

    return drive(model, request_for(**keywords))


def plan(model: nn.Module) -> ModelPlan:
    """List the rematerialized sites of `model` (block, class, choice); `str()` is a table.

    >>> import torch, remat
    >>> model = remat.apply(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    >>> print(remat.plan(model))
    remat plan for Sequential: 2 rematerialized sites
    block  class   choice
    0      Linear  full
    1      Linear  full
    """
    return _targets.model_plan(model)


def undo(module: _M) -> _M:
    """Remove what `remat(module)` and `remat.apply` added to `module` and its submodules.

    Their hooks go, and each gets back the `forward` it had: none of its own (its class's), or the one it had
    of its own before `remat`. Classes were never changed.

    >>> import torch, remat
    >>> layer = remat.undo(remat(torch.nn.Linear(2, 2)))
    """
    return _targets.undo_sites(module)


def region(
    *,
    policy: PolicyLike = None,
    preserve_rng: bool = True,
    enabled: bool | None = None,
    check: bool = True,
    name: str | None = None,
    offload: bool | _offload.Offload = False,
) -> Region:
    """Rematerialize a block of code: `with remat.region(): ...`.

    Every activation made inside the block and saved by autograd is dropped at the end of forward and
    rebuilt in backward by replaying the aten ops recorded while the block ran. Tensors created before
    the block are kept by reference. Also a decorator: `@remat.region()`.

    Args:
        policy, preserve_rng, enabled, check, name: as for `remat`.
        offload: keep the tensors from before the block that it reads in host memory (`True`, or
            `remat.offload(...)`).

    Returns:
        A `Region`; after the block, `r.ops` is the number of ops recorded and `r.freed_bytes` the
        bytes of activations not kept.

    >>> import torch, remat
    >>> x = torch.randn(8, 8, requires_grad=True)
    >>> with remat.region() as r:
    ...     y = x.sin().cos()
    >>> y.sum().backward()
    """
    options = Options(
        policy=policy, preserve_rng=preserve_rng, strategy="replay", enabled=enabled,
        check=check, name=name, offload=offload,
    )
    return Region(options)


class Remat:
    """Rematerialize a function, a method, an `nn.Module` class or instance.

    The activations autograd saves inside are freed after forward and rebuilt in backward by calling the
    function again (`strategy="rerun"`) or by replaying the aten ops recorded in forward (`"replay"`).

    Args:
        target: what to rematerialize; leave it out to get a decorator with the options.
        policy: which activations inside are still saved (`remat.policies`); `None` saves none.
        preserve_rng: recompute sees the RNG state forward saw, on every device.
        strategy: `"rerun"` calls the function again; `"replay"` replays the recorded ops.
        enabled: `True`/`False` force this site on or off; `None` follows the `REMAT` switch.
        check: compare what recompute saves with what forward saved and raise on a mismatch.
        name: label used in errors and reports (default: the qualified name).
        offload: keep what the site keeps for backward (its inputs, what the policy saves) in host memory
            (`True`, or `remat.offload(...)` for its settings); what it recomputes is never copied.

    Returns:
        The same kind of thing it was given: a function, the same class, the same module object.

    Raises:
        TypeError, ValueError: for a target or an option of the wrong kind, when decorating.

    >>> import torch, remat
    >>> @remat
    ... def mlp(x, w):
    ...     return (x @ w).relu() @ w
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> mlp(x, torch.randn(8, 8)).sum().backward()
    >>> layer = remat(torch.nn.Linear(8, 8))   # same object, rematerialized in place
    """

    @overload
    def __call__(self, target: type[_M], /) -> type[_M]: ...
    @overload
    def __call__(self, target: _M, /) -> _M: ...
    @overload
    def __call__(self, target: Callable[_P, _R], /) -> Callable[_P, _R]: ...
    @overload
    def __call__(
        self,
        /,
        *,
        policy: PolicyLike = None,
        preserve_rng: bool = True,
        strategy: Strategy = "rerun",
        enabled: bool | None = None,
        check: bool = True,
        name: str | None = None,
        offload: bool | _offload.Offload = False,
    ) -> Decorator: ...

    def __call__(self, target: Any = None, /, **options: Any) -> Any:
        return decorate(target, options)

    # The decorator's own names (defined below the class, each also a module-level name of the package).
    apply = staticmethod(apply)
    plan = staticmethod(plan)
    undo = staticmethod(undo)
    region = staticmethod(region)

    # The rest of the package, so that `from remat import remat` carries every name of `remat.__all__` (NOTE [ The
    # public surface ], rule 4 in remat/_core/public.py): looked up on the package at first use (`__getattr__`);
    # declared here for the type checker, which runs no code (tests/test_public.py says which line is missing).
    if TYPE_CHECKING:
        offload = staticmethod(_offload.offload)
        checkpoint = staticmethod(_checkpoint.checkpoint)
        checkpoint_sequential = staticmethod(_checkpoint.checkpoint_sequential)
        linear_cross_entropy = staticmethod(_cross_entropy.linear_cross_entropy)
        tiled = staticmethod(_tiles.tiled)
        is_enabled = staticmethod(_switch.is_enabled)
        set_enabled = staticmethod(_switch.set_enabled)
        enabled = staticmethod(_switch.enabled)
        policies: _PoliciesModule = _policies_module
        tag = staticmethod(_policies.tag)
        Offload = _offload.Offload
        ModelPlan = ModelPlan
        Region = Region
        RematError = _errors.RematError
        RecomputeMismatchError = _errors.RecomputeMismatchError
        BudgetError = _errors.BudgetError
        estimate = staticmethod(_estimate.estimate)
        EstimateReport = _estimate_report.EstimateReport
        ConfigEstimate = _estimate_report.ConfigEstimate
        chain = staticmethod(_chain.chain)
        solve = staticmethod(_solver.solve)
        measure = staticmethod(_measure.measure)
        track = staticmethod(_track.track)
        Chain = _chain.Chain
        Schedule = _schedule.Schedule
        StageCost = _simulate.StageCost
        Measurement = _measure_report.Measurement
        Report = _measure_report.Report
        Tracker = _track.Tracker
    else:

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):  # copy, pickle and inspect ask for dunders the class does not have
                raise AttributeError(name)
            if name in DEPRECATED:  # warned on every access: never cached (NOTE [ The public surface ], rule 5)
                return deprecated(name, stacklevel=3)
            value = getattr(sys.modules["remat"], name)
            setattr(Remat, name, staticmethod(value) if inspect.isfunction(value) else value)  # later lookups are plain
            return value

        def __dir__(self) -> list[str]:
            return sorted({*super().__dir__(), *names()})

    @property
    def remat(self) -> Remat:
        """The decorator itself (`remat.remat`), as the package has it."""
        return self

    @property
    def Remat(self) -> type[Remat]:
        """The decorator's class."""
        return type(self)

    def __repr__(self) -> str:
        return "<remat decorator>"


# A TypeError from Python names a function by its qualified name: show `remat.apply()`, not `Remat.apply()`.
for _name in ("apply", "plan", "undo", "region"):
    _function = globals()[_name]
    _function.__qualname__ = f"remat.{_name}"
    if hasattr(_function.__code__, "co_qualname"):  # Python 3.11+
        _function.__code__ = _function.__code__.replace(co_qualname=f"remat.{_name}")


remat = Remat()
claim(__name__)
