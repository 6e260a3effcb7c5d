"""A device type written in Python, for the tests: `remat_test`, two indices, each with its own random stream.

No GPU is lent to CI, but torch lets a device type be written in Python on its PrivateUse1 dispatch key. This module
registers one (docs/design.md, 'RNG, autocast and grad mode': RNG on every device is proven on a second device type,
not only on CPU), so that the paths remat takes for a tensor that is not on the CPU run in every test run:

* `torch.get_device_module("remat_test")` is `DEVICE`, with the functions remat and torch read there
  (`get_rng_state`, `set_rng_state`, `manual_seed`, `manual_seed_all`, `device_count`, `current_device`,
  `is_available`, `is_initialized`, `device`, `synchronize`); `torch.accelerator.current_accelerator()` reports
  the device once it is registered.
* A tensor on `remat_test:i` owns host memory: its storage is the memory of a CPU tensor handed over through
  DLPack with the device field rewritten, so storages, views, byte counts and `untyped_storage()` behave as on a
  real device, and a CPU alias of the same memory is made the same way.
* The device module reports what CUDA's caching allocator would have allocated and reserved for the index's
  storages (`memory_allocated`, `memory_reserved`, their peaks, `empty_cache`, and a size: `set_memory_limit`),
  from a model of it (`Allocator`), so that what a device's allocator reserves beyond the tensors is tested too.
* One boxed fallback runs every aten op that has no composite kernel: device tensors are replaced by their CPU
  aliases, the op runs on the CPU, and new outputs are handed back to the device of the inputs. View ops run
  the CPU kernel on the device tensor itself (the view shares the device tensor's storage). Random ops
  (`torch.Tag.nondeterministic_seeded`) draw from the index's own generator, never from the CPU's: a dropout on
  `remat_test:1` moves that index's stream only.

What the device lacks: streams and events (offload copies synchronously, as on MPS), pinned host memory, and a
device guard that knows more than index 0 — so backward must run on the calling thread
(`torch.autograd.set_multithreading_enabled(False)`, per thread: the `test_device` fixture in tests/conftest.py),
or autograd's engine asserts on a node of index 1. An exception raised in backward on this device aborts the
process (torch 2.13: the engine's stream guard calls the Python guard, from a `noexcept` destructor, while the
Python error is still pending), so a test that expects an error in backward keeps to the CPU. Registration is
process-wide and cannot be undone: `register()` does it once, lazily, from a fixture; importing this module
registers nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["COUNT", "DEVICE", "NAME", "fused_attention", "register", "stream_states"]

NAME = "remat_test"
COUNT = 2

_DLPACK_CPU, _DLPACK_EXT_DEV = 1, 12  # DLDeviceType: kDLCPU, kDLExtDev (torch reads it as PrivateUse1)
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _moved(tensor: torch.Tensor, kind: int, index: int) -> torch.Tensor:
    """A tensor on the same memory as `tensor`, whose DLPack device says (`kind`, `index`)."""
    capsule = torch.utils.dlpack.to_dlpack(tensor)
    # DLManagedTensor starts with DLTensor: `void* data`, then `DLDevice {int32 device_type, int32 device_id}`.
    device = (ctypes.c_int32 * 2).from_address(_capsule_pointer(capsule, b"dltensor") + 8)
    device[0], device[1] = kind, index
    return torch.utils.dlpack.from_dlpack(capsule)


def to_device(cpu: torch.Tensor, index: int) -> torch.Tensor:
    """Hand a CPU tensor's memory to `remat_test:<index>` (the device tensor keeps it alive); the index's allocator
    model counts it until its storage dies."""
    DEVICE.initialized = True
    moved = _moved(cpu.detach(), _DLPACK_EXT_DEV, index)
    DEVICE.allocators[index].hand_out(moved.untyped_storage())
    return moved


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor on the memory of a device tensor (it keeps the device tensor's memory alive)."""
    return _moved(tensor.detach(), _DLPACK_CPU, 0)


# -- a model of CUDA's caching allocator ------------------------------------------------------------------------

_BLOCK, _SMALL, _SMALL_SEGMENT, _LARGE_SEGMENT, _MID = 512, 1 << 20, 2 << 20, 20 << 20, 10 << 20


class Allocator:
    """What CUDA's caching allocator would have allocated and reserved for one index's storages: its statistics
    (`memory_allocated`, `memory_reserved` and their peaks), a model for the tests.

    CUDA's allocator (c10/cuda/CUDACachingAllocator.cpp) rounds a request up to 512 bytes and carves it from a
    segment it reserved with cudaMalloc: 2 MiB segments for blocks of up to 1 MiB, 20 MiB segments for up to 10 MiB,
    its own segment (rounded up to 2 MiB) above that. A freed block stays reserved, cached for the next request that
    fits it (the smallest such), split where what is left is worth a block (512 bytes in the small pool, more than
    1 MiB in the large), merged with free neighbours. So reserved runs above allocated by the rounding, the cache
    and fragmentation, as on a GPU; `empty_cache` gives back the segments with nothing in use, and so does a new
    segment that would take the reserve over the device's size (`limit`, as `set_per_process_memory_fraction` sets
    one), before it is reserved. Nothing here ever refuses an allocation (an exception raised in backward on this
    device aborts the process): a test reads the peak of what was reserved against the device size it stands for.
    """

    def __init__(self) -> None:
        self.segments: list[tuple[bool, list[list[int]]]] = []  # (small pool, blocks: [size, in use])
        self.live: dict[int, tuple[list[int], weakref.ref[torch.UntypedStorage]]] = {}
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.limit: int | None = None
        # A storage may die (its finalizer frees its block) while this allocator is busy: collected in the middle
        # of `hand_out`, on the same thread. That free waits in `_pending` until the allocator is done.
        self._lock = threading.RLock()
        self._busy = False
        self._pending: list[int] = []

    def hand_out(self, storage: torch.UntypedStorage) -> None:
        """Count a new storage until it dies."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        size = -(-nbytes // _BLOCK) * _BLOCK
        key = storage._cdata
        with self._lock:
            self._busy = True
            try:
                block = self._block(size)
                self.live[key] = (block, weakref.ref(storage, lambda _, key=key: self._free(key)))
                self.allocated += block[0]  # the whole block where the rest was too small to split off, as CUDA's
                self.peak_allocated = max(self.peak_allocated, self.allocated)
                self.peak_reserved = max(self.peak_reserved, self.reserved)
            finally:
                self._busy = False
            while self._pending:
                self._free(self._pending.pop())

    def _block(self, size: int) -> list[int]:
        small = size <= _SMALL
        fits = [(block[0], n, i) for n, (pool, blocks) in enumerate(self.segments) if pool == small
                for i, block in enumerate(blocks) if not block[1] and block[0] >= size]
        if fits:
            _, n, i = min(fits)
        else:
            segment = _SMALL_SEGMENT if small else _LARGE_SEGMENT if size <= _MID else -(-size // _SMALL_SEGMENT) * (
                _SMALL_SEGMENT)
            if self.limit is not None and self.reserved + segment > self.limit:
                self._release()  # the cached segments first, as the allocator does before it runs out
            self.segments.append((small, [[segment, 0]]))
            self.reserved += segment
            n, i = len(self.segments) - 1, 0
        blocks = self.segments[n][1]
        rest = blocks[i][0] - size
        if rest >= _BLOCK if small else rest > _SMALL:
            blocks[i][0] = size
            blocks.insert(i + 1, [rest, 0])
        blocks[i][1] = 1
        return blocks[i]

    def _free(self, key: int) -> None:
        with self._lock:
            if self._busy:  # a finalizer run in the middle of `hand_out`
                self._pending.append(key)
                return
            found = self.live.pop(key, None)
            if found is None:
                return
            block = found[0]
            block[1] = 0
            self.allocated -= block[0]
            for _, blocks in self.segments:
                if any(b is block for b in blocks):
                    merged: list[list[int]] = []
                    for b in blocks:  # free neighbours become one block
                        if merged and not b[1] and not merged[-1][1]:
                            merged[-1][0] += b[0]
                        else:
                            merged.append(b)
                    blocks[:] = merged
                    return

    def empty_cache(self) -> None:
        """Give back the segments with no block in use."""
        with self._lock:
            self._busy = True
            try:
                self._release()
            finally:
                self._busy = False
            while self._pending:
                self._free(self._pending.pop())

    def _release(self) -> None:
        kept = [(pool, blocks) for pool, blocks in self.segments if any(b[1] for b in blocks)]
        self.reserved -= sum(b[0] for _, blocks in self.segments for b in blocks) - sum(
            b[0] for _, blocks in kept for b in blocks)
        self.segments = kept

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


class _Device:
    """The device module, `torch.get_device_module("remat_test")`: generators, device indices, and the allocator
    statistics of a model of CUDA's caching allocator (`Allocator`)."""

    def __init__(self) -> None:
        self.allocators = [Allocator() for _ in range(COUNT)]
        self.generators = [torch.Generator() for _ in range(COUNT)]
        self.current = 0
        self.initialized = False
        self.manual_seed_all(torch.initial_seed())

    @property
    def _initialized(self) -> bool:  # what torch.utils.checkpoint reads
        return self.initialized

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return COUNT

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: Any) -> None:
        self.current = self._index(device)

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        """`with torch.remat_test.device(1):`, as torch.utils.checkpoint uses it."""
        before, self.current = self.current, self._index(device)
        try:
            yield
        finally:
            self.current = before

    def get_amp_supported_dtype(self) -> list[torch.dtype]:  # torch.autocast asks every device type
        return [torch.bfloat16, torch.float16]

    def synchronize(self, device: Any = None) -> None:
        """Nothing is ever queued: every op has run when it returns."""

    def _index(self, device: Any) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.current if device.index is None else device.index

    def memory_allocated(self, device: Any = None) -> int:
        return self.allocators[self._index(device)].allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.allocators[self._index(device)].peak_allocated

    def memory_reserved(self, device: Any = None) -> int:
        return self.allocators[self._index(device)].reserved

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.allocators[self._index(device)].peak_reserved

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.allocators[self._index(device)].reset_peaks()

    def empty_cache(self) -> None:
        for allocator in self.allocators:
            allocator.empty_cache()

    def set_memory_limit(self, nbytes: int | None, device: Any = None) -> None:
        """The device's size, for its allocator model (`Allocator`); None: unlimited."""
        self.allocators[self._index(device)].limit = nbytes

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return self.generators[self._index(device)].get_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        self.generators[self._index(device)].set_state(state)

    def manual_seed(self, seed: int) -> None:
        self.generators[self.current].manual_seed(_stream_seed(seed, self.current))

    def manual_seed_all(self, seed: int) -> None:
        for index, generator in enumerate(self.generators):
            generator.manual_seed(_stream_seed(seed, index))

    def seed(self) -> None:
        self.manual_seed(torch.seed())

    def initial_seed(self) -> int:
        return self.generators[self.current].initial_seed()


def _stream_seed(seed: int, index: int) -> int:
    """Each index's stream differs from the CPU's and from the other index's under the same `torch.manual_seed`."""
    return (int(seed) + 0x9E3779B97F4A7C15 * (index + 1)) % (1 << 63)


DEVICE = _Device()


def stream_states() -> tuple[torch.Tensor, ...]:
    """The CPU generator's state and that of each index, to compare runs."""
    return (torch.get_rng_state(), *(generator.get_state() for generator in DEVICE.generators))


# -- the fallback ---------------------------------------------------------------------------------------------

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_SEEDED = torch.Tag.nondeterministic_seeded


def _device_index(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> int:
    """The index an op runs on; tensors on another index, or on the CPU (but 0-dim ones), are refused as
    torch refuses them on a real device."""
    found: set[int] = set()
    host: list[torch.Tensor] = []

    def see(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type == NAME:
                found.add(value.device.index or 0)
            elif value.dim() > 0:
                host.append(value)
        elif isinstance(value, torch.device) and value.type == NAME:
            found.add(DEVICE.current if value.index is None else value.index)
        return value

    tree_map(see, (args, kwargs))
    if len(found) > 1 or (found and host):
        where = sorted({f"{NAME}:{index}" for index in found} | {str(t.device) for t in host})
        raise RuntimeError(f"Expected all tensors to be on the same device, but found {where} in {op}")
    return found.pop() if found else DEVICE.current


def _down(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == NAME:
        return _to_cpu(value)
    if isinstance(value, torch.device) and value.type == NAME:
        return torch.device("cpu")
    return value


def _fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    index = _device_index(op, args, kwargs)
    if op.is_view:  # the CPU kernel makes a view that shares the device tensor's storage and dispatch keys
        return op.redispatch(_CPU_KEYS, *args, **kwargs)
    cpu_args, cpu_kwargs = tree_map(_down, (args, kwargs))
    # An empty `out=` tensor that the op will resize runs on a fresh CPU tensor, copied back after.
    grown = {
        name: (value, cpu_kwargs[name].new_empty(0)) for name, value in kwargs.items()
        if isinstance(value, torch.Tensor) and value.device.type == NAME and value.numel() == 0
    }
    cpu_kwargs.update((name, fresh) for name, (_, fresh) in grown.items())
    with contextlib.ExitStack() as stack:
        if torch._C._len_torch_dispatch_stack():  # the op's own CPU work is no op a mode should see
            stack.enter_context(torch.utils._python_dispatch._disable_current_modes())
        if _SEEDED in op.tags:
            out = _on_stream(index, op, cpu_args, cpu_kwargs)
        else:
            out = op(*cpu_args, **cpu_kwargs)
    for target, fresh in grown.values():
        _resize_(target, list(fresh.shape))
        _to_cpu(target).copy_(fresh)
    return _up(op, out, args, kwargs, index)


def _on_stream(index: int, op: torch._ops.OpOverload, args: Any, kwargs: Any) -> Any:
    """Run a random op with the CPU generator set to index `index`'s stream, then put both back."""
    cpu, stream = torch.default_generator, DEVICE.generators[index]
    caller = cpu.get_state()
    cpu.set_state(stream.get_state())
    try:
        return op(*args, **kwargs)
    finally:
        stream.set_state(cpu.get_state())
        cpu.set_state(caller)


def _up(op: torch._ops.OpOverload, out: Any, args: Any, kwargs: Any, index: int) -> Any:
    """The op's outputs on the device: an output the schema says aliases an argument is that argument."""
    schema = op._schema
    aliased: dict[int, Any] = {}
    for position, returned in enumerate(schema.returns):
        if returned.alias_info is None:
            continue
        for slot, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.before_set == returned.alias_info.before_set:
                aliased[position] = kwargs[argument.name] if argument.name in kwargs else args[slot]
    single = len(schema.returns) == 1
    outs = (out,) if single else tuple(out)
    done = tuple(
        aliased[position] if position in aliased else tree_map(lambda t: _lift(t, index), value)
        for position, value in enumerate(outs)
    )
    return done[0] if single else done


def _lift(value: Any, index: int) -> Any:
    return to_device(value, index) if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value


def _resize_(tensor: torch.Tensor, size: list[int], memory_format: Any = None) -> torch.Tensor:
    """`aten::resize_` (an `out=` tensor that must grow): a larger storage first, then torch's CPU kernel."""
    numel = 1
    for extent in size:
        numel *= extent
    needed = (tensor.storage_offset() + numel) * tensor.element_size()
    storage = tensor.untyped_storage()
    if needed > storage.nbytes():  # the memory DLPack handed over cannot grow: move to a larger block
        larger = to_device(torch.zeros(needed, dtype=torch.uint8), tensor.device.index or 0).untyped_storage()
        ctypes.memmove(larger.data_ptr(), storage.data_ptr(), storage.nbytes())
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _CPU_KEYS, tensor, larger, tensor.storage_offset(), tensor.shape, tensor.stride()
        )
    return torch.ops.aten.resize_.default.redispatch(_CPU_KEYS, tensor, size, memory_format=memory_format)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`aten::_copy_from` between the device and the CPU (or two device tensors): a copy between aliases."""
    _down(dst).copy_(_down(src))
    return dst


# -- registration ---------------------------------------------------------------------------------------------


class _Hooks(torch._C._acc.PrivateUse1Hooks):  # type: ignore[misc]
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):  # type: ignore[misc]
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


_lock = threading.Lock()
_libraries: list[torch.library.Library] = []  # kept alive: dropping a Library removes its kernels


def register() -> None:
    """Register `remat_test` on the PrivateUse1 key, once per process (it cannot be undone)."""
    with _lock:
        if _libraries:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME, DEVICE, _Hooks(), _Guard())
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(_fallback, "PrivateUse1")
        kernels = torch.library.Library("aten", "IMPL")
        kernels.impl("_copy_from", _copy_from, "PrivateUse1")
        kernels.impl("resize_", _resize_, "PrivateUse1")
        _libraries.extend((fallback, kernels))


# -- attention in one kernel, for transformers models -----------------------------------------------------------

FUSED_ATTENTION = "remat_test_fused"


def fused_attention() -> str:
    """Register, for transformers models, an attention that runs the CPU's fused kernel on this device, and return
    its name (a config's `attn_implementation`).

    `F.scaled_dot_product_attention` picks its kernel through a dispatch stub that a device written in Python cannot
    fill, so on this device it takes torch's math path, whose attention weights grow with the square of the
    sequence; a GPU runs a fused kernel, which keeps per token only its output and log-sum-exp. This attention calls
    the kernel the CPU's SDPA picks (`_scaled_dot_product_flash_attention_for_cpu`, causal, keys and values with
    fewer heads as they come), which the fallback runs on the device's memory, and the mask transformers gives SDPA.
    """
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError("the fused attention of tests/pydevice.py takes causal batches without padding")
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout, True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register(FUSED_ATTENTION, attention)
    AttentionMaskInterface.register(FUSED_ATTENTION, sdpa_mask)
    return FUSED_ATTENTION
