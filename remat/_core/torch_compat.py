"""Every private torch name remat uses, bound in one place, each with what happens on a torch without it.

remat declares `torch>=2.4` (the oldest torch with the public APIs it needs: `torch.get_autocast_dtype(device_type)`
and `torch.is_autocast_enabled(device_type)` came in 2.4; `torch.get_device_module`, `torch.get_default_device`,
`torch.compiler.is_compiling` in 2.3; `always_call=` on forward hooks in 2.1). Private names change between
versions, so each one is bound here once. "Present in 2.4" marks a name torch has had since that version or
earlier, used by torch's own public APIs of that time (its absence would be a broken torch, not an old one):
those are bound directly. Every other name is looked up with `getattr` and has a fallback that keeps remat
correct and says in a comment what degrades; `import remat` and a rematerialized forward and backward work
without any of them (tests/core/test_torch_compat.py deletes each one before `import remat`).

Nothing else in the package reads `torch._C`, `torch._dynamo`, `torch._subclasses`, `torch.utils._python_dispatch`
or torch's private module-hook tables; `torch.utils._pytree` (stable in practice, used by every tree walker) is
re-exported from here as well, as are the fake-tensor names the estimator uses (`torch._subclasses.fake_tensor`,
present in 2.4; torch imports it itself) and `torch._ops.OpOverload` (an aten overload's type, present in 2.4).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.nn.modules import module as _module
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
)
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "GlobalModuleHooks",
    "OpOverload",
    "TorchDispatchMode",
    "after_update",
    "any_autocast",
    "can_record_host",
    "can_run_eager",
    "compiling_allowed",
    "current_accelerator",
    "disable_current_modes",
    "dispatch_mode_stack",
    "dispatch_modes_on",
    "dynamo_guarded",
    "eager_for_now",
    "eval_frame_callback",
    "fake_device",
    "fake_store",
    "flop_formula",
    "foreach_by_default",
    "fsdp_group",
    "fsdp_state_keys",
    "local_tensor",
    "UNSAFE_VIEW",
    "graph_exec_group",
    "graph_task_id",
    "graph_task_keeps_graph",
    "host_bytes",
    "in_optimizer_step",
    "pop_saved_hooks",
    "push_saved_hooks",
    "rerun_changed",
    "selective_policy",
    "set_grad_enabled",
    "shared_detach",
    "storage_id",
    "tensor_hooks_held",
    "top_saved_hooks",
    "when_traced",
    "top_dispatch_mode",
    "version_of",
    "version_probe",
    "torch_function_mode_on",
    "tree_leaves",
    "tree_map",
    "undo_after_update",
]

_C: Any = torch._C
_autograd: Any = torch._C._autograd

# -- the saved-tensor default-hook stack ----------------------------------------------------------------------
# push/pop: present in 2.4 (torch.autograd.graph.saved_tensors_hooks is built on them, since 1.10).
push_saved_hooks: Callable[[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]], None] = (
    _autograd._push_saved_tensors_default_hooks
)
pop_saved_hooks: Callable[[], None] = _autograd._pop_saved_tensors_default_hooks


def _no_top_hooks(ignore_is_tracing: bool) -> None:
    return None


# torch-compat: `_top_saved_tensors_default_hooks(ignore_is_tracing)`, added after 2.7 (torch 2.6 and 2.7 lack
# it; an early form took no argument). Without it remat sees no enclosing saved-tensor hooks: a nested site keeps
# its inputs itself instead of handing them to the enclosing site or offload block (more memory held, same
# gradients), and `with remat.offload():` inside a rerun function is not refused.
top_saved_hooks: Callable[[bool], tuple[Any, Any] | None] = getattr(
    _autograd, "_top_saved_tensors_default_hooks", _no_top_hooks
)
try:
    top_saved_hooks(False)  # no hooks are pushed while remat imports: None, or a TypeError for the early form
except TypeError:
    _top_without_argument: Callable[[], tuple[Any, Any] | None] = top_saved_hooks  # type: ignore[assignment]

    def top_saved_hooks(ignore_is_tracing: bool) -> tuple[Any, Any] | None:
        return _top_without_argument()

# -- autograd graph tasks -------------------------------------------------------------------------------------
# Present in 2.4 (torch.utils.checkpoint keys its recomputed tensors by it since 2.0).
graph_task_id: Callable[[], int] = _C._current_graph_task_id


def _no_exec_group() -> None:
    return None


# torch-compat: `_get_graph_exec_group` (torch.utils.checkpoint.GraphExecGroup), newer than 2.4. Without it
# each backward is its own group (the graph task id keys the store): what `GraphExecGroup` would share between
# the backwards of one group is recomputed per backward instead.
graph_exec_group: Callable[[], Any] = getattr(_C, "_get_graph_exec_group", _no_exec_group)


def _keeps_graph_unknown() -> None:
    return None


# torch-compat: `_autograd._get_current_graph_task_keep_graph` (whether the running backward keeps the graph:
# `retain_graph`, `create_graph`), newer than 2.4. Without it (None: not known) a tiled call holds what its backward
# needed until that backward ends, not only until its node ran (remat/_engine/tiles.py, NOTE [ Tiles ]).
graph_task_keeps_graph: Callable[[], bool | None] = getattr(
    _autograd, "_get_current_graph_task_keep_graph", _keeps_graph_unknown
)

# Present in 2.4: `torch.set_grad_enabled` calls it; the raw form skips the context manager object.
set_grad_enabled: Callable[[bool], None] = _C._set_grad_enabled

# -- autocast -------------------------------------------------------------------------------------------------


def _autocast_maybe_on() -> bool:
    return True


# torch-compat: `_is_any_autocast_enabled`, not relied on at 2.4. Without it every call captures the
# autocast state of its devices (more work on every call), as if autocast might be on.
any_autocast: Callable[[], bool] = getattr(_C, "_is_any_autocast_enabled", _autocast_maybe_on)

# -- the optimizer's implementation ---------------------------------------------------------------------------
# Present in 2.4: `torch.optim.optimizer._default_to_fused_or_foreach` reads both (torch.distributed.tensor appends
# DTensor to the types when imported, so they are read at each call).


def foreach_by_default(types: Iterable[type], device_type: str) -> bool:
    """Whether torch's optimizers, left to choose (``foreach=None``, ``fused=None``), take their ``foreach`` path
    for parameters of these Python types on this device type: torch's own rule (``_default_to_fused_or_foreach``):
    every parameter's type exactly a plain tensor, a ``Parameter`` or a ``DTensor``, on a device with foreach
    kernels (CUDA, XPU, MTIA, the PrivateUse1 backend)."""
    from torch.optim import optimizer as _optimizer
    from torch.utils import _foreach_utils

    supported = tuple(_optimizer._foreach_supported_types)
    return device_type in _foreach_utils._get_foreach_kernels_supported_devices() and all(
        kind in supported for kind in types
    )


# -- storages -------------------------------------------------------------------------------------------------


def _storage_cdata(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


# torch-compat: `_storage_id`, not relied on at 2.4. Without it the identity of a storage is read from
# `untyped_storage()._cdata` (the same storage pointer, through a Python storage object: slower per call).
storage_id: Callable[[torch.Tensor], int] = getattr(_C, "_storage_id", _storage_cdata)

# -- version counters -----------------------------------------------------------------------------------------
# Present in 2.4: `_SetExcludeDispatchKeyGuard` and `DispatchKey.ADInplaceOrView` (torch.utils.checkpoint's selective
# checkpointing detaches what it caches under them since 2.4, for the same reason).
_exclude_keys: Any = _C._SetExcludeDispatchKeyGuard
_in_place_or_view: Any = _C.DispatchKey.ADInplaceOrView


def shared_detach(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor.detach()` sharing `tensor`'s version counter, also inside a dispatch mode's handler.

    There a plain `detach` runs below autograd's view tracking (the ADInplaceOrView key is excluded) and gets a version
    counter of its own, blind to every later in-place change of `tensor`; this one sees them (NOTE [ A kept output
    changed in place ] in _engine/kept.py).
    """
    with _exclude_keys(_in_place_or_view, False):
        return tensor.detach()


def version_of(tensor: torch.Tensor) -> int:
    """`tensor._version`; -1 for an inference tensor, which has none (and cannot be changed in place outside
    inference mode).

    >>> with torch.inference_mode():
    ...     made = torch.ones(2)
    >>> version_of(made), version_of(torch.ones(2).add_(1))
    (-1, 1)
    """
    try:
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return -1


@contextlib.contextmanager
def tensor_hooks_held(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """The hooks `Tensor.register_hook` put on `tensors` do not run inside (a tiled call's per-tile gradients: NOTE
    [ Tiles ] in _engine/tiles.py, rule 2); they are back, in their order, after.

    Present in 2.4: `Tensor._backward_hooks`, the dict the tensor's autograd hook calls them from (emptied here and
    refilled); without it they would run inside too.
    """
    held = [(hooks, list(hooks.items())) for t in tensors if (hooks := getattr(t, "_backward_hooks", None))]
    for hooks, _ in held:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.update(items)


def version_probe(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that shares `tensor`'s version counter and holds none of its memory (NOTE [ A kept output changed in
    place ] in _engine/kept.py, implementation note 1).

    >>> h = torch.ones(1024)
    >>> probe = version_probe(h)
    >>> h.mul_(2)[0].add_(1)  # changed in place, also through a view
    tensor(3.)
    >>> probe._version == h._version, probe.untyped_storage().nbytes()
    (True, 0)
    """
    probe = shared_detach(tensor)
    probe.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)  # the same kind of tensor
    return probe


# Present in 2.4: the op torch's composite `matmul` returns its `mm`/`bmm` output through, with a version counter of
# its own (rule 7 of NOTE [ A kept output changed in place ] in _engine/kept.py).
UNSAFE_VIEW: OpOverload = torch.ops.aten._unsafe_view.default

# -- dispatch and function modes ------------------------------------------------------------------------------
# Present in 2.4: the length of the dispatch-mode stack (`torch.utils._python_dispatch` reads it since 2.0).
dispatch_modes_on: Callable[[], int] = _C._len_torch_dispatch_stack
# Present in 2.4 (since 2.0): the dispatch mode on top of the stack (None when none is on).
top_dispatch_mode: Callable[[], Any] = _get_current_dispatch_mode
# Present in 2.4 (since 2.0): set every dispatch mode aside for a block.
disable_current_modes: Callable[[], Any] = _disable_current_modes
# Present in 2.4 (since 2.0): the dispatch modes on, the fake mode first, then the others from the bottom up.
dispatch_mode_stack: Callable[[], list[Any]] = _get_current_dispatch_mode_stack
_META = torch.device("meta")


def fake_device(t: object) -> torch.device | None:
    """The device a `FakeTensor` claims, as torch's fake tensors answer ``prim.device`` for it (its ``fake_device``,
    ``meta`` while its mode runs a kernel: both present in 2.4); None for any other object (NOTE [ A fake
    tensor's device ] in remat/_measure/track.py)."""
    if type(t) is not FakeTensor:
        return None
    return _META if t.fake_mode.in_kernel_invocation else t.fake_device
# Present in 2.4 (since 2.0): whether a torch function mode (such as `torch.device(...)` as a context) is on.
torch_function_mode_on: Callable[[], bool] = _C._is_torch_function_mode_enabled


# -- the optimizer's step --------------------------------------------------------------------------------------
# Every optimizer's `step` runs inside `Optimizer.profile_hook_step`'s wrapper (present in 2.4: `Optimizer.__init__`
# wraps the class's `step` with it), which iterates over torch's global step pre-hooks, runs the update, calls the
# instance's `_optimizer_step_code()` (the profiler's entry point, present in 2.4) and iterates over the post-hooks.


def _noop() -> None:
    return None


@functools.cache
def _step_wrapper_code() -> Any:
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    return getattr(wrap(_noop), "__code__", None) if callable(wrap) else None


def in_optimizer_step() -> tuple[bool, Any]:
    """Whether an `optimizer.step()` runs on this thread, so that torch may be iterating over its step hooks, and
    the optimizer (None where it cannot be read); `(True, None)` where this torch's step cannot be recognised (the
    caller then leaves the hooks as they are)."""
    code = _step_wrapper_code()
    if code is None:
        return True, None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True, frame.f_locals.get("self")
        frame = frame.f_back
    return False, None


def after_update(optimizer: Any, fn: Callable[[], None]) -> bool:
    """Call `fn` once in the `optimizer.step()` now running, after its update and before its post-hooks (where
    torch is iterating over no table of step hooks), through the instance's `_optimizer_step_code`, taken off the
    instance again as it runs. False where this torch's optimizer has no such entry point (`fn` is not called)."""
    original = getattr(type(optimizer), "_optimizer_step_code", None)
    own = getattr(optimizer, "__dict__", None)
    if not callable(original) or own is None or "_optimizer_step_code" in own:
        return False
    ref = weakref.ref(optimizer)

    def once() -> None:
        opt = ref()
        if opt is not None:
            vars(opt).pop("_optimizer_step_code", None)
            original(opt)
        fn()

    optimizer._optimizer_step_code = once
    return True


def undo_after_update(optimizer: Any) -> None:
    """Take back an `after_update` that has not run (the step raised before it)."""
    getattr(optimizer, "__dict__", {}).pop("_optimizer_step_code", None)


def can_run_eager() -> bool:
    """Whether `eager_for_now` can keep compiled code from being compiled: dynamo is not in use, or this torch has
    stances (2.6)."""
    return "torch._dynamo" not in sys.modules or hasattr(torch.compiler, "set_stance")


_eager_lock = threading.Lock()
_eager_users = 0  # open `eager_for_now`s, all threads: the stance is dynamo's, for the whole process
_eager_prior: Any = None  # the stance the first of them found


def eager_for_now() -> Callable[[], None] | None:
    """Make `torch.compile`d code run in eager code until the returned function is called (dynamo's "force_eager"
    stance: no frame is compiled, and none is marked to be skipped for good), or None where dynamo is not imported
    (nothing is compiled) or this torch has no stances (`torch.compiler.set_stance`, 2.6: the caller must then not
    run compiled code under a dispatch mode, which dynamo answers by running that code in eager code for good).

    The stance is process-wide, and calls from several threads overlap: the first sets it and the last puts back
    the stance the first found, whatever the order they end in."""
    global _eager_users, _eager_prior
    if "torch._dynamo" not in sys.modules:
        return None
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return None
    with _eager_lock:
        if _eager_users == 0:
            _eager_prior = getattr(set_stance("force_eager"), "prev", None)
        _eager_users += 1
    done: list[bool] = []

    def restore() -> None:
        global _eager_users
        with _eager_lock:
            if done:
                return
            done.append(True)
            _eager_users -= 1
            if _eager_users:
                return
            prior = _eager_prior
            if prior is None:
                set_stance("default")
            else:
                set_stance(prior.stance, skip_guard_eval_unsafe=prior.skip_guard_eval_unsafe,
                           force_backend=prior.backend)

    return restore


@contextlib.contextmanager
def compiling_allowed() -> Iterator[None]:
    """Inside: `torch.compile`d code compiles and runs compiled, under an `eager_for_now` (dynamo's "default"
    stance, put back as it was after); where this torch has no stances, nothing is kept from compiling anyway."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if "torch._dynamo" not in sys.modules or set_stance is None:
        yield
        return
    with set_stance("default"):
        yield


# The legacy autograd profiler with memory records (`torch._C._autograd._enable_profiler_legacy` and its config
# types in `torch._C._profiler`, present in 2.4 though `ProfilerConfig`'s arguments have changed) sees every
# allocation of the CPU allocator, the buffers of inductor's compiled code included, which no dispatch mode
# (remat's tracker) sees. Kineto's `torch.profiler.profile(profile_memory=True)` sees the same but prints to
# stderr. Without it, `host_bytes` says None: a compiled step's peak is then estimated from an eager one, and a
# plan for one compiled graph is priced on eager bytes.
def _host_recorder() -> tuple[Callable[[], None], Callable[[], Any]] | None:
    """Start and stop of the legacy profiler with memory records, or None where this torch lacks them."""
    try:
        from torch._C._profiler import ProfilerConfig, ProfilerState, _ExperimentalConfig

        config = ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())
        enable, disable = _autograd._enable_profiler_legacy, _autograd._disable_profiler_legacy
        options = _autograd._ProfilerDisableOptions(True, True)
    except (ImportError, AttributeError, TypeError):
        return None
    return lambda: enable(config), lambda: disable(options)


def can_record_host() -> bool:
    """Whether `host_bytes` can read the CPU allocator on this torch."""
    return _host_recorder() is not None


def host_bytes(fn: Callable[[], object]) -> tuple[int, int] | None:
    """The peak of bytes held by the CPU allocator while `fn()` runs and what it holds after, both above what it
    held before; None where this torch cannot record allocations."""
    recorder = _host_recorder()
    if recorder is None:
        return None
    start, stop = recorder
    start()
    try:
        fn()
    finally:
        records = stop()
    events = sorted((e for thread in records for e in thread if e.kind() == "memory_alloc"), key=_start_us)
    level = peak = 0
    for event in events:  # in the order they happened (stable: one thread's events keep theirs)
        level += event.cpu_memory_usage()
        peak = max(peak, level)
    return peak, level


def _start_us(event: Any) -> int:
    return int(event.start_us())


# torch-compat: `_accelerator_getAccelerator` (`torch.accelerator`), 2.6. Without it the accelerator this torch was
# built for is found by asking CUDA (CUDA stands for any accelerator).
current_accelerator: Callable[[], torch.device | None] | None = getattr(_C, "_accelerator_getAccelerator", None)


_Guarded = tuple[Callable[..., Any], Callable[[], Any], Callable[[Any], None]]


def dynamo_guarded(raw: Callable[..., Any]) -> _Guarded | None:
    """`(guarded, eval_frame_callback, skip_code)` for a dispatch handler `raw`, or None where torch lacks them.

    `guarded` is `raw` behind `torch._disable_dynamo` (2.1), `eval_frame_callback()` is dynamo's callback on this
    thread (None when dynamo evaluates no frame) and `skip_code(code)` tells dynamo never to trace `code`. Without
    them remat's modes keep torch's own guard on every op (slower under a dispatch mode, same results).
    """
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return None
    disable = getattr(torch, "_disable_dynamo", None)
    if disable is None:
        return None
    return disable(raw, recursive=True), get_eval_frame_callback, skip_code


# -- torch's global module-hook tables ------------------------------------------------------------------------


class GlobalModuleHooks:
    """A forward pre-hook and an always-called forward hook on every module, installed and removed often.

    Through torch's private tables (present in 2.4; `_global_forward_hooks_always_called` since 2.1) under a key
    of remat's own: an install and removal costs a dict write and a delete, where the public
    `register_module_forward_pre_hook` and `register_module_forward_hook(always_call=True)` make and remove
    handles, several times dearer (docs/benchmarks.md). Where the tables are missing it falls back to the public
    registration.
    """

    def __init__(self, key: int, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self.key, self.pre, self.post = key, pre, post
        self._handles: tuple[Any, Any] | None = None
        tables: list[Any] = [getattr(_module, name, None) for name in _TABLES]
        self._tables: list[dict[int, Any]] | None = tables if all(isinstance(t, dict) for t in tables) else None

    def install(self) -> None:
        """Put both hooks in (called under the caller's lock)."""
        tables = self._tables
        if tables is not None:
            tables[0][self.key] = self.pre
            tables[1][self.key] = self.post
            tables[2][self.key] = True
        else:
            self._handles = (
                _module.register_module_forward_pre_hook(self.pre),
                _module.register_module_forward_hook(self.post, always_call=True),
            )

    def remove(self) -> None:
        """Take both hooks out; the tables are as before `install`."""
        tables = self._tables
        if tables is not None:
            for table in tables:
                table.pop(self.key, None)
        elif self._handles is not None:
            for handle in self._handles:
                handle.remove()
            self._handles = None


_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called")


# -- torch.compile, storages, DTensor and FSDP2 -------------------------------------------------------------------
# get_eval_frame_callback: dynamo's callback on this thread (torch 2.1). Without it a region that a compiled call
# runs in eager code is not warned about.
eval_frame_callback: Callable[[], Any] | None
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as eval_frame_callback
except ImportError:  # pragma: no cover - a torch without dynamo
    eval_frame_callback = None


def when_traced(fn: Callable[[Any], None]) -> None:
    """Run `fn(ctx)` while dynamo traces the calling frame, with no graph break; at run time do nothing.

    Through `torch._dynamo.comptime.comptime` (present in 2.4, since 2.0), looked up where dynamo has already
    imported it (it has whenever it traces), so that `import remat` does not import dynamo. `fn` must be a
    module-level function: dynamo calls it with its own context object. Called outside dynamo, nothing runs.
    """
    comptime = getattr(sys.modules.get("torch._dynamo.comptime"), "comptime", None)
    if comptime is not None:
        comptime(fn)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its private `_local_tensor`, present in 2.4), or the tensor itself."""
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def fsdp_state_keys() -> set[str]:
    """The module attributes where `fully_shard` keeps its state (`torch.distributed._composable.contract`'s
    STATE_KEY and REGISTRY_KEY, present in 2.4); an estimate removes them from its copy of a sharded model."""
    contract = importlib.import_module("torch.distributed._composable.contract")
    return {contract.STATE_KEY, contract.REGISTRY_KEY}


def fsdp_group(module: Any) -> tuple[Any, ...]:
    """The modules that one `fully_shard` call sharded together with `module`, itself included (its FSDP state's
    private `_modules`, present since 2.6, when `fully_shard` took a list); () where `module` is no FSDPModule."""
    state = getattr(module, "_get_fsdp_state", None)
    modules = getattr(state(), "_modules", None) if callable(state) else None
    return tuple(modules) if modules is not None else ()


def fake_store() -> Any:
    """A `FakeStore` for torch's fake process group (`torch.testing._internal.distributed.fake_pg`, which also
    registers the "fake" backend; present in 2.4)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


# -- torch's selective-checkpoint contexts -----------------------------------------------------------------------
# torch-compat: `torch.utils.checkpoint._CachingTorchDispatchMode` (the forward context that
# `create_selective_checkpoint_contexts` makes; its `policy_fn`, 2.4) and `SAC_IGNORED_OPS` (2.5; before it the
# `detach` that checkpointing itself inserts). `SelectiveCheckpointContext` takes `op_output=` since 2.12 or so:
# `_sac_context` asks its signature once. Without the mode class, remat's drop-in enters a user's selective
# contexts as given: torch's modes keep what the policy keeps, under remat's hooks (torch 2.14 warns there, and a
# random op they keep shifts the random stream of recompute: NOTE [ Random ops ] in _engine/rng.py).
@functools.cache
def _sac_context() -> Callable[[Any], Any]:
    """Makes the context a policy function is called with in forward, from the op's output (where torch takes it)."""
    from torch.utils.checkpoint import SelectiveCheckpointContext

    if "op_output" in inspect.signature(SelectiveCheckpointContext).parameters:
        return lambda out: SelectiveCheckpointContext(is_recompute=False, op_output=out)
    return lambda out: SelectiveCheckpointContext(is_recompute=False)


def selective_policy(
    forward_context: Any, recompute_context: Any
) -> tuple[Callable[[Any], bool], Callable[[Any, Any, Any, Any], bool]] | None:
    """torch's selective-checkpoint contexts as remat carries them out, or None for other contexts.

    Returns `(counts, keeps)`: whether an op's calls are counted at all (torch's own checkpointing ops are not),
    and, per call once the op ran, whether the user's `policy_fn` keeps its outputs (MUST_SAVE or PREFER_SAVE, or
    True), called as torch calls it in forward.
    """
    checkpoint = importlib.import_module("torch.utils.checkpoint")
    caching = getattr(checkpoint, "_CachingTorchDispatchMode", None)
    cached = getattr(checkpoint, "_CachedTorchDispatchMode", None)
    if caching is None or cached is None or type(forward_context) is not caching or (
        type(recompute_context) is not cached
    ):
        return None
    policy_fn = getattr(forward_context, "policy_fn", None)
    if not callable(policy_fn):
        return None
    ignored = frozenset(getattr(checkpoint, "SAC_IGNORED_OPS", (torch.ops.aten.detach.default,)))
    kept = frozenset((checkpoint.CheckpointPolicy.MUST_SAVE, checkpoint.CheckpointPolicy.PREFER_SAVE, True))

    def counts(op: Any) -> bool:
        return op not in ignored

    context = _sac_context()

    def keeps(op: Any, args: Any, kwargs: Any, out: Any) -> bool:
        return policy_fn(context(out), op, *args, **(kwargs or {})) in kept

    return counts, keeps


@functools.cache
def _rerun_changed_mode() -> type | None:
    """torch's recompute mode of selective checkpointing, made to run again the ops whose cached output was changed in
    place (`rerun_changed`); None where torch's names are not there."""
    checkpoint = importlib.import_module("torch.utils.checkpoint")
    cached = getattr(checkpoint, "_CachedTorchDispatchMode", None)
    wrapper = getattr(checkpoint, "_VersionWrapper", None)
    again = getattr(checkpoint, "_RECOMPUTE", None)
    if cached is None or wrapper is None or again is None:
        return None

    def changed(entry: Any) -> bool:
        return any(
            isinstance(leaf, wrapper) and leaf.version is not None and (
                leaf.val._version != leaf.version
                or any(alias._version != version for alias, version in getattr(leaf, _ALIASES, ()))
            )
            for leaf in tree_leaves(entry)
        )

    class RerunChanged(cached):  # type: ignore[misc, valid-type]
        def __enter__(self) -> Any:
            for entries in self.storage.values():
                for index, entry in list(entries.items()):
                    if changed(entry):
                        entries[index] = again  # torch's own mark for "run this call again"
            return super().__enter__()

    return RerunChanged


_ALIASES = "_remat_aliases"  # on a cached `_VersionWrapper`: (version probe, version) of its `_unsafe_view`s


@functools.cache
def _watching_mode() -> type | None:
    """torch's forward mode of selective checkpointing, made to watch the `_unsafe_view`s of what it caches (their
    version counters are their own: rule 7 of NOTE [ A kept output changed in place ] in _engine/kept.py); None where
    torch's names are not there."""
    checkpoint = importlib.import_module("torch.utils.checkpoint")
    caching = getattr(checkpoint, "_CachingTorchDispatchMode", None)
    wrapper = getattr(checkpoint, "_VersionWrapper", None)
    if caching is None or wrapper is None:
        return None
    versioned: type = wrapper

    class WatchAliases(caching):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func is UNSAFE_VIEW and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
                source = args[0].untyped_storage()._cdata
                for entries in self.storage.values():
                    for entry in entries.values():
                        for leaf in tree_leaves(entry):
                            value = getattr(leaf, "val", None) if isinstance(leaf, versioned) else None
                            if isinstance(value, torch.Tensor) and value.untyped_storage()._cdata == source:
                                aliases = (*getattr(leaf, _ALIASES, ()), (version_probe(out), out._version))
                                setattr(leaf, _ALIASES, aliases)
            return out

    return WatchAliases


def rerun_changed(contexts: tuple[Any, Any]) -> tuple[Any, Any]:
    """torch's selective-checkpoint contexts (`create_selective_checkpoint_contexts`), with the recompute one made to
    run again every op whose cached output was changed in place since it was cached, instead of raising "Tensor cached
    during selective activation checkpoint has been mutated" or handing the changed tensor back (NOTE [ A kept output
    changed in place ] in _engine/kept.py); the forward one made to watch changes through `_unsafe_view`s of what it
    caches too (rule 7 there).

    Where torch runs its checkpoint operator eagerly (`backend="eager"`) these modes run; compiled code functionalises
    in-place ops and saves each op's own value. Other contexts, or a torch without these names
    (`_CachedTorchDispatchMode`, `_VersionWrapper`, `_RECOMPUTE`), are returned as they are: torch's own error then.
    """
    forward, recompute = contexts
    kind = _rerun_changed_mode()
    if kind is None or type(recompute) is not kind.__base__ or not hasattr(recompute, "storage"):
        return contexts
    mode = copy.copy(recompute)
    mode.__class__ = kind
    watching = _watching_mode()
    if watching is not None and type(forward) is watching.__base__ and hasattr(forward, "storage"):
        forward = copy.copy(forward)
        forward.__class__ = watching
    return forward, mode


# -- FLOP formulas ---------------------------------------------------------------------------------------------
# `torch.utils.flop_counter.flop_registry`, `sdpa_flop_count` and `sdpa_backward_flop_count` (not documented API,
# looked up by name): an op's FLOPs from its arguments' shapes. Without them every op is priced by its elements
# and bytes (NOTE [ Priced time ] in _measure/clock.py), so matmuls cost less against the ops around them.
@functools.cache
def _flop_formulas() -> dict[Any, Callable[..., Any]]:
    counter = importlib.import_module("torch.utils.flop_counter")
    table: dict[Any, Callable[..., Any]] = dict(getattr(counter, "flop_registry", {}))
    forward = getattr(counter, "sdpa_flop_count", None)
    backward = getattr(counter, "sdpa_backward_flop_count", None)
    aten = torch.ops.aten
    # CPU attention (what `scaled_dot_product_attention` runs there) has no entry in torch's table
    if forward is not None and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        table[aten._scaled_dot_product_flash_attention_for_cpu] = (
            lambda q, k, v, *_, out_val=None, **__: forward(q.shape, k.shape, v.shape)
        )
    if backward is not None and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        table[aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
            lambda g, q, k, v, *_, out_val=None, **__: backward(g.shape, q.shape, k.shape, v.shape)
        )
    return table


def flop_formula(func: Any) -> Callable[..., Any] | None:
    """torch's FLOP formula for an aten op (called as ``formula(*args, **kwargs, out_val=out)``), or None."""
    return _flop_formulas().get(getattr(func, "overloadpacket", func))
