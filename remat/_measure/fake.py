"""Fake tensors for estimates: a model's state and a sample as `FakeTensor`s, counted like real ones.

NOTE [ Counting fake tensors ]
Under ``torch._subclasses.FakeTensorMode`` an op computes only the shape, dtype, strides and device of its
outputs. A fake tensor still has a storage (on the meta device, with the ``nbytes`` a real one would have), and
that storage's Python object lives exactly as long as its C++ ``StorageImpl``, as for a real tensor (see NOTE
[ Storage lifetime ] in track.py): the tracker's finalizers fire when autograd or the engine drops a fake
activation. So `FakeTracker` is the ordinary tracker with two changes: a storage counts on the device its fake
tensor claims (``t.device``, e.g. ``cuda:0``), not on ``meta``; and on CUDA each storage counts as the block the
caching allocator would hand out (rounded up to a multiple of `CUDA_BLOCK`), so that the peak predicts
``torch.cuda.max_memory_allocated``. A plain `remat.track` around an estimate still sees the fake storages on
``meta``, which is how the tests check that an estimate allocates nothing real.

NOTE [ CUDA without a GPU ]
1. A step predicted for CUDA on a machine without one runs on fake CPU tensors standing in for the CUDA ones
   (`stand_in`): the trackers and `storage_bytes` count their storages on the CUDA device as the allocator would
   (its 512-byte blocks); the optimizer takes the implementation torch picks on CUDA (NOTE [ The optimizer the
   device runs ] in remat/_estimate/predict.py); autocast set for CUDA runs as the CPU's.
2. What differs from a CUDA step: ops whose CPU kernels allocate other tensors than CUDA's (attention with dropout
   decomposes on the CPU, where CUDA runs one fused kernel: its probabilities are counted), and host scalars
   (AdamW's step counters) counted as 512-byte device blocks.

Implementation notes:
1. (rule 1) A CUDA build of torch makes fake CUDA tensors without a GPU and runs their forward, but its autograd
   engine asks CUDA about every tensor's device in backward (``hasPrimaryContext``, torch 2.11 on), which fails
   without a device.

NOTE [ Swapping in fake state ]
1. An estimate never touches the user's model: parameters and buffers are replaced by fake ones in each module's
   ``_parameters``/``_buffers`` for its duration and the original objects put back in ``finally``; hooks and
   attributes stay.
2. A tied weight (one object in two modules) gets one fake.
3. A parameter an engine keeps partitioned (DeepSpeed ZeRO-3: an empty tensor per rank, its full shape in its
   attributes) is faked at the shape the step computes with, which the caller names (``full``): an estimate or a
   profile plans what the step computes, not how the engine stores it (NOTE [ Budgets under DeepSpeed ZeRO ] in
   remat/_sites/integrations/deepspeed.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .._core.errors import RematError
from .._core.torch_compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    local_tensor,
    tree_leaves,
    tree_map,
)
from .track import Tracker

__all__ = [
    "CUDA_BLOCK",
    "counted_on",
    "run_on",
    "stand_in",
    "FakeTracker",
    "FullShape",
    "allocator_bytes",
    "data_dependent",
    "fake_like",
    "fake_mode",
    "fake_sample",
    "fake_state",
    "NO_DEVICE",
    "local",
    "map_sample",
    "note_fake_step",
    "resolve_device",
    "storage_bytes",
    "tensors_of",
]

CUDA_BLOCK = 512
"""The CUDA caching allocator rounds every allocation up to a multiple of this many bytes."""


def allocator_bytes(nbytes: int, device: torch.device) -> int:
    """Bytes an allocation of ``nbytes`` counts for in ``device``'s allocator statistics.

    On CUDA the caching allocator hands out blocks of a multiple of `CUDA_BLOCK` bytes (at least one; nothing for
    an empty tensor), and ``torch.cuda.max_memory_allocated`` counts those blocks. Elsewhere the bytes themselves.

    >>> import torch
    >>> allocator_bytes(1, torch.device("cuda")), allocator_bytes(513, torch.device("cuda:0"))
    (512, 1024)
    >>> allocator_bytes(0, torch.device("cuda")), allocator_bytes(513, torch.device("cpu"))
    (0, 513)
    """
    if device.type != "cuda" or nbytes <= 0:
        return nbytes
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


_standing_in: contextvars.ContextVar[tuple[torch.device, torch.device] | None] = contextvars.ContextVar(
    "remat_standing_in", default=None)


def run_on(device: torch.device) -> torch.device:
    """The device a fake step predicted for ``device`` runs its fake tensors on: ``device``, or the CPU standing in
    for CUDA where no GPU is present (NOTE [ CUDA without a GPU ])."""
    if device.type == "cuda" and torch.cuda.device_count() == 0:
        return torch.device("cpu")
    return device


@contextlib.contextmanager
def stand_in(run: torch.device, target: torch.device) -> Iterator[None]:
    """Count storages on ``run`` as on ``target`` while inside (NOTE [ CUDA without a GPU ]); nothing if the same."""
    if run == target:
        yield
        return
    token = _standing_in.set((run, target))
    try:
        yield
    finally:
        _standing_in.reset(token)


def counted_on(device: torch.device) -> torch.device:
    """The device a storage on ``device`` counts on: the one it stands in for, if any."""
    found = _standing_in.get()
    return found[1] if found is not None and device == found[0] else device


class FakeTracker(Tracker):
    """A `Tracker` that counts fake tensors on the device they claim; see NOTE [ Counting fake tensors ].

    >>> import torch
    >>> with fake_mode() as mode, FakeTracker() as t:
    ...     x = torch.empty(1000, device="cuda")   # fake: no CUDA needed, nothing allocated
    >>> t.peak("cuda"), t.devices
    (4096, (device(type='cuda', index=0),))
    """

    _claimed: torch.device | None = None

    def _place(self, t: torch.Tensor, st: torch.UntypedStorage) -> tuple[torch.device, int]:
        device = t.device
        if device.type == "cpu":
            device = torch.device("cpu")
        device = counted_on(device)
        self._claimed = device
        return device, allocator_bytes(st.nbytes(), device)

    def _storage_device(self, st: torch.UntypedStorage) -> torch.device:
        # A resized fake storage (FSDP's unsharded parameters) has no tensor at hand: it counts on the device
        # the fake tensors seen so far claim.
        if st.device.type == "meta" and self._claimed is not None:
            return self._claimed
        return super()._storage_device(st)

    def _storage_bytes(self, st: torch.UntypedStorage) -> int:
        return allocator_bytes(st.nbytes(), self._storage_device(st))


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes on this rank: a `DTensor`'s local shard, else ``t``."""
    return local_tensor(t)


_GROUPED_MM = torch.ops.aten._grouped_mm.default


class _FakeMode(FakeTensorMode):  # type: ignore[no-untyped-call]
    """torch's fake tensor mode, but for the grouped matmul of a mixture of experts on the CPU (implementation note
    of `fake_mode`)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _GROUPED_MM and _cpu_grouped_mm(args, kwargs or {}):
            wide = args[0].dtype
            narrow = tuple(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                           for a in args)
            out = super().__torch_dispatch__(func, types, narrow, kwargs)
            assert isinstance(out, torch.Tensor)
            return out.to(wide)
        return super().__torch_dispatch__(func, types, args, kwargs)



def _cpu_grouped_mm(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a `_grouped_mm` call is one the CPU's kernel runs and torch's fake kernel refuses: fake operands on
    the CPU in float32 or float16, no output dtype asked."""
    operands = args[:2]
    return (len(operands) == 2 and all(isinstance(a, FakeTensor) and a.device.type == "cpu" for a in operands)
            and {a.dtype for a in operands} <= {torch.float32, torch.float16} and kwargs.get("out_dtype") is None
            and (len(args) < 5 or args[4] is None))


def fake_mode() -> FakeTensorMode:
    """A fake tensor mode that turns real tensors it meets (constants, closures) into fake ones.

    Implementation note: torch's fake kernel of `aten._grouped_mm` (a mixture of experts' matmul, transformers'
    default) takes bfloat16 alone, as CUDA's kernel does, while the CPU's takes float32 and float16 too; on fake CPU
    operands of those it computes in bfloat16 and hands back the operands' dtype, so that a float32 model of such a
    family estimates on the CPU as it trains there. Only the output is allocated in the step: the casts are the fake
    mode's own, which no tracker above it sees.
    """
    return _FakeMode(allow_non_fake_inputs=True)


def fake_like(t: torch.Tensor, device: torch.device, shape: torch.Size | None = None) -> torch.Tensor:
    """A fake tensor of ``t``'s shape, strides, dtype and ``requires_grad`` on ``device`` (inside a fake mode); with
    ``shape``, contiguous of that shape instead (a parameter an engine keeps partitioned: NOTE [ Swapping in fake
    state ])."""
    if shape is not None and tuple(shape) != tuple(t.shape):
        out = torch.empty(shape, dtype=t.dtype, device=device)
    else:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    if t.requires_grad and t.is_floating_point():
        out.requires_grad_(True)
    return out


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages of ``tensors``.

    With ``device``, only the storages on that device, each as its allocator counts it (`allocator_bytes`);
    without, the storages' exact bytes on every device.
    """
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if device is not None and counted_on(torch.device("cpu") if t.device.type == "cpu" else t.device) != device:
            continue
        t = local(t)
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += st.nbytes() if device is None else allocator_bytes(st.nbytes(), device)
    return total


FullShape = Callable[[torch.Tensor], "torch.Size | None"]
"""The shape a tensor of the model stands for where it is not its own (an engine's partitioned parameter), or None."""


@contextlib.contextmanager
def fake_state(model: nn.Module, device: torch.device, full: FullShape | None = None) -> Iterator[list[torch.Tensor]]:
    """Swap fake parameters and buffers into ``model`` (inside a fake mode); yield the fake parameters.

    See NOTE [ Swapping in fake state ]. The fake parameters are yielded in ``model.parameters()`` order. With
    ``full``, a tensor for which it gives a shape is faked at that shape (DeepSpeed ZeRO-3's partitioned
    parameters, empty on the rank, at the shape the step computes with).
    """
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, Any]] = []  # (module's table, name, the original)
    try:
        for module in model.modules():
            tables: tuple[tuple[dict[str, Any], bool], ...] = ((module._parameters, True), (module._buffers, False))
            for table, parameter in tables:
                for name, value in list(table.items()):
                    if value is None:
                        continue
                    fake = fakes.get(id(value))
                    if fake is None:
                        fake = fake_like(value.detach(), device, None if full is None else full(value))  # a leaf
                        if parameter:
                            fake = nn.Parameter(fake, requires_grad=value.requires_grad)
                        fakes[id(value)] = fake
                    swapped.append((table, name, value))
                    table[name] = fake
        yield list(model.parameters())  # the fakes, tied ones once
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value


def map_sample(sample: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``sample`` (a tensor, a tuple/list, or a mapping of keyword arguments, made a dict) with ``fn`` applied to
    each tensor, once per tensor object: one tensor passed twice (``input_ids`` that is also ``labels``) stays one.
    (`remat._engine.tree.map_tensors` maps a site's arguments, one call per occurrence, through dataclasses too.)
    """
    if isinstance(sample, Mapping) and not isinstance(sample, dict):
        sample = dict(sample)  # a BatchEncoding and the like
    made: dict[int, Any] = {}

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in made:
            made[id(x)] = fn(x)
        return made[id(x)]

    return tree_map(one, sample)


def fake_sample(sample: Any, device: torch.device) -> Any:
    """``sample`` (a tensor, a tuple/list, or a dict of keyword arguments) with every tensor made fake on ``device``.

    Floating-point tensors keep ``requires_grad``; nothing else of their values survives (fake tensors have none).
    One tensor object met twice becomes one fake tensor, so its bytes count once.
    """
    return map_sample(sample, lambda x: fake_like(x, device))


DATA_DEPENDENT = (
    "remat: estimate cannot run {site} on fake tensors: the op `{op}` {what}, and fake tensors carry no "
    "values. Make that step independent of tensor values for the estimate (for example: no `.item()`, "
    "`.tolist()` or `if tensor:` in forward, a mask multiplied in instead of `nonzero` or boolean indexing, "
    "an `attention_mask` left out when it is all ones), or measure a real run with `remat.measure`."
)


_FAKE_STEP = (
    "remat: raised while {what} ran {site} on fake tensors. A fake tensor's op runs torch's fake (meta) kernel, "
    "which may refuse what the device's own kernel runs (a dtype, a layout); where the model runs for real, "
    "`remat.measure` measures a real step instead."
)


def note_fake_step(error: BaseException, what: str, site: str) -> None:
    """Say on `error` (a note, where Python has them) that it was raised on fake tensors, and what that can mean."""
    if hasattr(error, "add_note"):
        error.add_note(_FAKE_STEP.format(what=what, site=site))


def data_dependent(error: Exception, site: str) -> RematError | None:
    """The `RematError` for a data-dependent op met under fake tensors, or None for another error."""
    if isinstance(error, DynamicOutputShapeException):
        what = "returns a tensor whose shape depends on the values of its input"
    elif isinstance(error, DataDependentOutputException):
        what = "reads a value out of a tensor (`.item()`, `bool(tensor)`, `.tolist()`)"
    else:
        return None
    op = getattr(error, "func", None) or "?"
    return RematError(DATA_DEPENDENT.format(site=site, op=op, what=what))


def resolve_device(model: nn.Module, sample: Any, device: str | torch.device | None) -> torch.device:
    """The device to predict for: ``device``, else the model's, else the sample's, else the CPU (meta is not one)."""
    if device is None:
        found = [t.device for t in (*model.parameters(), *model.buffers(), *tensors_of(sample))]
        device = next((d for d in found if d.type != "meta"), torch.device("cpu"))
    dev = torch.device(device)
    if dev.type == "meta":
        raise ValueError("remat: estimate predicts for a real device; `device` must not be 'meta' (use 'cpu', 'cuda').")
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, 0)
    if dev.type != "cpu" and not _supported(dev):
        raise RematError(NO_DEVICE.format(device=dev, kind=dev.type.upper()))
    return dev


NO_DEVICE = (
    "remat: estimate cannot predict for `{device}` with this build of torch, which has no {kind} support: "
    "autograd needs the device's support even for fake tensors. Run the estimate with a {kind} build of torch "
    "(no device is needed: nothing is allocated on it), or predict for 'cpu'."
)


def _supported(device: torch.device) -> bool:
    """Whether this torch build can run autograd on fake tensors of ``device`` (a GPU need not be present)."""
    if device.type == "cuda":
        return bool(torch.backends.cuda.is_built())  # type: ignore[no-untyped-call]
    module = getattr(torch, device.type, None)
    return bool(getattr(module, "is_available", lambda: False)())


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors among ``obj``'s leaves (a mapping's values included)."""
    if isinstance(obj, Mapping):
        obj = dict(obj)
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
