"""DeepSpeed ZeRO: what a budget needs to know of a model whose parameters and gradients DeepSpeed's engine owns.

Imported only where deepspeed is loaded and a model carries its marks (`engine_of` in this package's __init__.py);
it reads DeepSpeed's attributes, hooks and module names by name and never imports deepspeed.

NOTE [ Budgets under DeepSpeed ZeRO ]
DeepSpeed's ZeRO engine owns a model's parameters and gradients: ZeRO-3 partitions every parameter to an empty
tensor on each rank (its full shape kept in ``ds_shape``), gathers a module's parameters in a forward pre-hook and
before its backward (an autograd function its forward hook puts on the outputs), in recompute too, and releases
them after; ZeRO-2 and ZeRO-3 take each gradient as backward accumulates it (a post-accumulate-grad hook on the
parameter copies it into a bucket, reduces and partitions it, and frees it). `deepspeed.zero.Init` partitions a
model as it is built (the Trainer builds models inside it under ZeRO-3). So a budget cannot plan, re-plan or check
such a model as a plain one: its parameters are empty, a step of its own fires the engine's gathers and
reductions, and the engine's buffers are not the step's activations.

Rules:
1. A budget plans what the step computes, not how the engine stores it: its profile runs on a fake twin whose
   parameters have their full shapes and dtypes, and whose modules carry none of DeepSpeed's hooks (they are taken
   out of the user's modules while the profile runs, and put back). Nothing is gathered, no collective runs, and
   the engine sees no step.
2. Per-rank bytes follow the stage: where the engine takes each gradient as backward makes it (ZeRO-2, ZeRO-3), a
   step holds a gradient only until its hook takes it, so the plan counts gradients only while backward makes
   them, not to the step's end (NOTE [ Gradients in the budget ] in remat/_budget/costs.py counts a default loop's).
   ZeRO-3's gathered parameters are the engine's (rule 3); the profile's full-size fakes live before the step.
3. What the engine allocates for itself in a step (its gradient buckets and partitions, the parameters it gathers
   or prefetches) is its state, as the optimizer's is: the first step's check sets it apart from the activations
   and gradients the budget bounds (NOTE [ Set apart ] in remat/_measure/step_tracker.py), and says once, in a log
   line, how much it set apart.
4. remat never runs a training step of its own that the engine sees: a plan is verified on the model's first
   training step (its corrections on the next ones), also where the prediction does not fit; a real step of
   remat's would be reduced into the engine's gradients (ZeRO-2: "already been reduced"), and one with the
   engine's hooks taken out cannot run on ZeRO-3's empty parameters.
5. A plan made before the engine owned the model (`remat.apply` before `deepspeed.initialize`) is made again, on
   the fake twin, at the model's first training forward under the engine (one log line); a plan made on a model
   built inside `zero.Init` or after `deepspeed.initialize` is kept by the engine's later steps.

Implementation notes:
1. (rule 1) DeepSpeed's hooks are those whose function is defined in a ``deepspeed`` module (ZeRO-3's per-module
   hooks, the engine's forward prologue and epilogue on the root); each module's hook tables are replaced by
   copies without them for the profile, and the original tables put back after (its parameters are fakes, so the
   parameters' own hooks never fire). The choices the profile puts on the blocks go into the copies; the plan is
   put on the blocks after the profile, into the original tables. `zero.Init` also replaces
   ``torch.nn.functional.linear`` with its own autograd function for good: it computes the same on fake tensors.
2. (rule 3) A storage is the engine's when the Python code that allocated it, read from the innermost frame
   outwards past torch's and remat's own frames, is DeepSpeed's ZeRO runtime or engine; its ``linear`` and
   ``tiling`` modules compute the model's own matmuls and count as the model's. An allocation whose frames reach
   autograd's engine first (``torch.autograd.graph._engine_run_backward``) is backward's own: a gradient or a
   backward temporary, the step's, even when DeepSpeed's ``engine.backward`` called it.
3. (rule 2) With the gradients taken as they are made, the profile adds none by position (`GradientSteps` of
   zeros) and counts none to a window's end: what backward allocates for a gradient and frees once it is added
   into the profile's zero gradient is the gradient the engine's hook takes.

NOTE [ One rank's state under DeepSpeed ZeRO ]
`remat.estimate` and `remat.apply(memory=...)` count, for a model DeepSpeed owns, what one rank holds, as
DeepSpeed 0.19 lays it out (`RankState`), around the step the fake twin runs (rule 1, the gradients taken as
backward makes them):
1. Parameters: ZeRO-3's partition of each (its ``ds_tensor``, or ``ds_numel`` over the ranks), whole below
   ZeRO-3. The optimizer's state and an fp32 copy of the trainable parameters (its "master" weights, kept even in
   fp32 training) are partitioned over the ranks from ZeRO-1 on: the optimizer's state is the one the fake optimizer
   makes, times the rank's share of the trainable elements.
2. Gradients: the rank's partition of the reduced gradients; ZeRO-3 keeps their flat buffer and its reduction
   bucket (``reduce_bucket_size`` elements) from `deepspeed.initialize` on, ZeRO-2 makes its bucket in each
   backward and the partitions as the bucket is reduced (done by backward's end, after the activations' peak: the
   `grads_bytes` row, not the peak); ZeRO-3 also gathers parameters in the step (the largest module's own, at once).
3. What the engine holds besides parameters, gradients and optimizer state (its buckets, the gathered
   parameters) is the estimate's `engine_bytes`, in every phase's peak and in `memory=`'s state, since a budget's
   first step sets it apart (rule 3). The bucket's size is the engine's (``zero_reduce_bucket_size()``, found
   through its forward prologue on the model) once `deepspeed.initialize` ran, DeepSpeed's default before.
Not modelled: parameters ZeRO-3 keeps whole (``stage3_param_persistence_threshold``, ``ds_persist``), more than one
module's parameters gathered at once (``stage3_max_live_parameters``, prefetching), offload to the CPU or NVMe,
and bf16/fp16 optimizers' extra copies; a budget's own first step still sets the engine's buffers apart and checks
the plan whatever they are.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..._measure.fake import fake_state
from . import comes_from

__all__ = ["DEFAULT_BUCKET", "ENGINE_ITSELF", "DeepSpeed", "RankState", "carries_marks", "gradients_taken", "owner",
           "rank_state"]

_LIBRARY = "deepspeed"
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_KWARG_TABLES = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
# Where DeepSpeed's own memory is allocated (implementation note 2), and its modules that compute the model's ops.
_OWN = ("deepspeed.runtime.zero.", "deepspeed.runtime.engine", "deepspeed.runtime.bf16_optimizer",
        "deepspeed.runtime.fp16.", "deepspeed.runtime.utils", "deepspeed.runtime.comm.")
_COMPUTE = ("deepspeed.runtime.zero.linear", "deepspeed.runtime.zero.tiling")
_TRANSPARENT = ("torch.", "remat.", "contextlib", "functools", "threading", "typing", "abc")

DEFAULT_BUCKET = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` (elements), for a model no engine has taken yet."""


@dataclass(frozen=True)
class RankState:
    """Bytes one rank holds under the engine (NOTE [ One rank's state under DeepSpeed ZeRO ]).

    Attributes:
        params: the rank's parameters (ZeRO-3: their partitions).
        gradients: the rank's partition of the trainable parameters' reduced gradients.
        master: the fp32 copy of the rank's partition of the trainable parameters.
        share: the rank's share of the trainable elements: its part of the optimizer's state.
        kept: what the engine keeps for itself between steps besides the above (ZeRO-3: gradient partitions and
            the bucket).
        step: what the engine allocates for itself within a step (ZeRO-2: its bucket; ZeRO-3: gathered
            parameters).
    """

    params: int
    gradients: int
    master: int
    share: float
    kept: int
    step: int


def _from_deepspeed(hook: Any) -> bool:
    """Whether a hook's function is defined in a deepspeed module (through `functools.wraps` wrappers too)."""
    seen = 0
    while hook is not None and seen < 8:
        module = getattr(hook, "__module__", None) or ""
        if module == _LIBRARY or module.startswith(_LIBRARY + "."):
            return True
        hook = getattr(hook, "__wrapped__", None) or getattr(hook, "__func__", None)
        seen += 1
    return False


def carries_marks(model: nn.Module) -> bool:
    """Whether `model` carries DeepSpeed's marks, read by name: a parameter partitioned by ZeRO-3 (``ds_id``), or a
    hook of DeepSpeed's on the model's root (the engine's forward prologue) or on its parameters (ZeRO's gradient
    reduction). Cheap: the root's hook tables and the parameters' attributes."""
    for table in ("_forward_pre_hooks", "_forward_hooks"):
        if any(_from_deepspeed(hook) for hook in getattr(model, table, {}).values()):
            return True
    for p in model.parameters():
        if hasattr(p, "ds_id"):
            return True
        if p.requires_grad:
            hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
            return any(_from_deepspeed(hook) for hook in hooks.values())
    return False


@dataclass(frozen=True)
class DeepSpeed:
    """What remat reads of a model that DeepSpeed's ZeRO engine owns, or will own (built inside `zero.Init`).

    Attributes:
        partitioned: ZeRO-3: each parameter is partitioned over the ranks (empty here, full shape in ``ds_shape``).
        hands_over: the engine takes each gradient as backward makes it (ZeRO-2 and ZeRO-3), so a step's
            gradients are transient (NOTE [ Budgets under DeepSpeed ZeRO ], rule 2).
    """

    partitioned: bool
    hands_over: bool

    @property
    def name(self) -> str:
        """The set-up in words, for log lines."""
        if self.partitioned:
            return "DeepSpeed ZeRO-3"
        return "DeepSpeed ZeRO-2" if self.hands_over else "DeepSpeed"

    @staticmethod
    def full_shape(t: torch.Tensor) -> torch.Size | None:
        """The shape the step computes with, for a parameter ZeRO-3 partitioned (``ds_shape``); None for others."""
        shape = getattr(t, "ds_shape", None)
        return None if shape is None else torch.Size(shape)

    @contextlib.contextmanager
    def twin(self, model: nn.Module, device: torch.device) -> Iterator[list[torch.Tensor]]:
        """`fake_state` with full shapes, on modules without DeepSpeed's hooks (rule 1); yields the fake
        parameters."""
        with hooks_hidden(model), fake_state(model, device, self.full_shape) as params:
            yield params

    @staticmethod
    def allocating() -> bool:
        """Whether the op running now allocates for the engine itself (implementation note 2): the `set_apart` of
        a first step's tracker (NOTE [ Set apart ] in remat/_measure/step_tracker.py)."""
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_globals.get("__name__", "") or ""
            if name == "torch.autograd.graph" and frame.f_code.co_name == "_engine_run_backward":
                return False  # autograd's own work: a gradient or a backward temporary
            if name.startswith(_LIBRARY + "."):
                if name.startswith(_COMPUTE):
                    return False
                if name.startswith(_OWN):
                    return True
            elif not (name == "torch" or name.startswith(_TRANSPARENT)):
                return False  # the model's code (or the user's loop)
            frame = frame.f_back  # type: ignore[assignment]
        return False


def _engine_config(model: nn.Module) -> Any:
    """The `DeepSpeedEngine` whose forward prologue is on `model`'s root (a closure's cell), or None."""
    for hook in getattr(model, "_forward_pre_hooks", {}).values():
        if not _from_deepspeed(hook):
            continue
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                found = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(getattr(found, "zero_reduce_bucket_size", None)):
                return found
    return None


def _world(model: nn.Module) -> int:
    for p in model.parameters():
        size = getattr(p, "ds_zero_partition_world_size", None)
        if isinstance(size, int) and size > 0:
            return size
    dist = torch.distributed
    return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1


def rank_state(engine: DeepSpeed, model: nn.Module) -> RankState:
    """What one rank of `model` holds under `engine` (NOTE [ One rank's state under DeepSpeed ZeRO ]); read from the
    real model, before a fake twin stands in."""
    world = _world(model)
    params = gradients = master = trainable = rank_trainable = 0
    largest = 0
    seen: set[int] = set()
    for module in model.modules():
        own = 0
        for p in module.parameters(recurse=False):
            full = int(getattr(p, "ds_numel", p.numel()))
            own += full * p.element_size()
            if id(p) in seen:
                continue
            seen.add(id(p))
            shard = getattr(p, "ds_tensor", None)
            mine = int(shard.numel()) if shard is not None else -(-full // world)
            params += (mine if engine.partitioned else full) * p.element_size()
            if p.requires_grad:
                trainable += full
                rank_trainable += mine
                gradients += mine * p.element_size()
                master += mine * 4
        largest = max(largest, own)
    found = _engine_config(model)
    elements = int(found.zero_reduce_bucket_size()) if found is not None else DEFAULT_BUCKET
    size = next((p.element_size() for p in model.parameters() if p.requires_grad), 4)
    bucket = elements * size if engine.hands_over else 0
    share = rank_trainable / trainable if trainable else 0.0
    if engine.partitioned:
        return RankState(params, gradients, master, share, kept=gradients + bucket, step=largest)
    return RankState(params, gradients, master, share, kept=0, step=bucket)


@contextlib.contextmanager
def gradients_taken(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside: each of `params` gives its gradient up as soon as backward accumulates it, as the engine's hook
    takes it (rule 2), on a fake twin's parameters."""

    def take(param: torch.Tensor) -> None:
        param.grad = None

    handles = [p.register_post_accumulate_grad_hook(take)  # type: ignore[no-untyped-call]
               for p in params if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


ENGINE_ITSELF = (
    "remat: `{kind}` is DeepSpeed's engine; a budget or an estimate is for the model it runs: pass `engine.module` "
    "(the model you gave deepspeed.initialize), e.g. remat.apply(engine.module, budget=..., sample=batch)."
)


def owner(model: nn.Module) -> DeepSpeed:
    """The `DeepSpeed` view of a model that carries DeepSpeed's marks (`carries_marks`).

    Raises:
        ValueError: `model` is DeepSpeed's engine itself, not the model it runs.
    """
    if comes_from(type(model), _LIBRARY):
        raise ValueError(ENGINE_ITSELF.format(kind=type(model).__name__))
    partitioned = False
    hands_over = False
    for p in model.parameters():
        if hasattr(p, "ds_id") and hasattr(p, "ds_shape"):
            partitioned = True
        if p.requires_grad:
            hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
            hands_over = hands_over or any(_from_deepspeed(hook) for hook in hooks.values())
    return DeepSpeed(partitioned, hands_over or partitioned)


@contextlib.contextmanager
def hooks_hidden(model: nn.Module) -> Iterator[None]:
    """Inside: `model`'s modules carry none of DeepSpeed's hooks (each module's hook tables are copies without
    them); after: the original tables, as they are then, are back (implementation note 1)."""
    swapped: list[tuple[nn.Module, str, Any]] = []
    try:
        for module in model.modules():
            state = vars(module)
            hidden = {key for name in _HOOK_TABLES for key, hook in (state.get(name) or {}).items()
                      if _from_deepspeed(hook)}
            if not hidden:
                continue
            for name in (*_HOOK_TABLES, *_KWARG_TABLES):
                table = state.get(name)
                if table is None:
                    continue
                swapped.append((module, name, table))
                state[name] = type(table)((k, v) for k, v in table.items() if k not in hidden)
        yield
    finally:
        for module, name, table in reversed(swapped):
            vars(module)[name] = table
