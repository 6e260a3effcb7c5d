"""RNG state of every device a region touches, stashed in forward and restored inside a fork.

See NOTE [ Which generators a region draws on ]. Each device's generator is reached through
`torch.get_device_module(device.type)`: no device type is hard-coded, so CUDA, XPU, MPS, HPU and privateuse1
backends all work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .._core.torch_compat import FakeTensor, current_accelerator, torch_function_mode_on

__all__ = ["Draw", "Draws", "RngStash", "devices_of", "draws", "own_generator", "with_index"]

# NOTE [ Which generators a region draws on ]
# Rerun calls the function again in backward, so every generator forward drew from must be set back to the state
# it had when forward began, or recompute draws other dropout masks: wrong gradients, and no error.
#
# Rules: a stash holds
# 1. the CPU generator, always;
# 2. the devices of the region's inputs (positional and keyword), of its module's parameters and buffers, and the
#    default device of an active `torch.device(...)` context;
# 3. every index of the accelerator (`torch.accelerator`), once its device module says it is initialised.
# 4. Not covered under rerun: a second device type that is not the accelerator, reached only through a closure
#    (torch reports one accelerator per process). Replay needs none of this: its recorder sees every random op and
#    stashes the state of the device it runs on just before the first one (recorder.py).
#
# Implementation notes:
# 1. (rule 3) Rule 3 is what makes "touches" mean where random ops ran: a function reaches tensors on any index
#    through a closure, a global or another module's attribute, none of which its inputs show, and torch's
#    checkpoint, which looks at the inputs only, gets wrong dropout gradients for a module on device 1 called from
#    inputs on device 0.
# 2. (rule 3) Its cost: nothing where only the CPU is in use (an accelerator that is not initialised has drawn
#    nothing, and nothing is asked of it beyond `is_initialized`); where one is, one state per visible index in
#    forward, and one read and two writes per index in recompute (the fork). The states of indices forward did
#    not draw on are set back to what they already were.

# NOTE [ Random ops ]
# An op may draw random numbers inside itself: on CUDA, scaled-dot-product attention with dropout is one fused op
# (flash, memory-efficient, cuDNN) that draws its mask inside the kernel by advancing the device generator's
# Philox offset. A policy may keep such an op's outputs, and then recompute does not run it.
#
# Rules:
# 1. An op draws random numbers when it carries `torch.Tag.nondeterministic_seeded`, except an op whose `dropout_p`
#    argument is 0: torch tags the scaled-dot-product-attention kernels whatever their dropout (pytorch#187985).
# 2. It draws from the `generator=` it is given, else from the default generator of the device it runs on: its
#    first tensor argument's, else its `device=`, else the default device.
# 3. Recompute draws exactly what forward drew, whether a policy keeps a random op or not. Forward reads the state
#    of a kept random op's generator right after the op ran (`Draw`); recompute, which hands the kept outputs back
#    instead of running the op, sets that state where the op would have run. Restoring the generators once at the
#    region's start is not enough: the skipped op would leave its generator behind, and every random op after it
#    would draw another mask (torch's selective checkpoint does this; compile's partitioner saves a state per
#    recomputed random op instead, `functionalize_rng_ops`).
# 4. Only with `preserve_rng` (without it recompute draws afresh anyway), and only for the random ops a policy
#    keeps: a region that keeps nothing random reads no generator. An op on fake tensors (an estimate's step, a
#    budget's profile) draws nothing: no generator moves.
#
# Implementation notes:
# 1. (rule 1) On CPU, SDPA's dropout decomposes into ops of their own; the fused kernels it keeps there
#    (`_scaled_dot_product_flash_attention_for_cpu`) carry the tag with `dropout_p=0`, which rule 1 skips.
# 2. (rule 3) A CUDA generator's state is its seed and Philox offset, kept on the host: reading and setting it
#    does not synchronise the device. Every device type is reached through `torch.get_device_module`.
# 3. (rule 3) Setting a generator in recompute is a fork (`Draws`): the state it had before the first set is put
#    back when recompute ends. For a generator the region's stash covers, the stash's own fork puts back the
#    caller's state afterwards anyway; for any other it keeps the user's stream where it was.

_NO_RNG = frozenset({"cpu", "meta"})
_cpu = torch.default_generator


def _device_module(kind: str) -> ModuleType | None:
    try:
        module: ModuleType = torch.get_device_module(kind)
        return module
    except (RuntimeError, AttributeError, ValueError):
        return None


def with_index(device: torch.device) -> torch.device | None:
    """`cuda` -> `cuda:<current>`; None when the device has no usable generator module."""
    module = _device_module(device.type)
    if module is None or not hasattr(module, "get_rng_state"):
        return None
    if device.index is not None:
        return device
    current = getattr(module, "current_device", None)
    return torch.device(device.type, int(current()) if callable(current) else 0)


# `torch.accelerator.current_accelerator()` without its Python wrapper (on the path of every call), where torch
# has it (2.6 and later); before that, CUDA stands for any accelerator.
_get_accelerator: Callable[[], torch.device | None] | None = current_accelerator


def _built_accelerator() -> torch.device | None:
    """The accelerator this torch was built for (or registered), initialized or not; None for none."""
    if _get_accelerator is None:
        return torch.device("cuda")
    return _get_accelerator()


def _current_accelerator(built: torch.device | None) -> torch.device | None:
    if built is None:
        return None
    module = _device_module(built.type)
    initialized = getattr(module, "is_initialized", None)
    if module is None or (callable(initialized) and not initialized()):
        return None
    return built


def _every_index(accelerator: torch.device) -> tuple[torch.device, ...]:
    """Every index of an initialised accelerator type (rule 3 of NOTE [ Which generators a region draws on ])."""
    module = _device_module(accelerator.type)
    if module is None or not hasattr(module, "get_rng_state"):
        return ()
    count = getattr(module, "device_count", None)
    total = int(count()) if callable(count) else 0
    if total > 1:
        return _indices(accelerator.type, total)
    current = with_index(accelerator)
    return () if current is None else (current,)


@functools.cache
def _indices(kind: str, total: int) -> tuple[torch.device, ...]:
    return tuple(torch.device(kind, i) for i in range(total))


def _module_devices(module: nn.Module, kinds: set[torch.device]) -> None:
    """Add the devices of the parameters and buffers of `module` and its submodules to `kinds`.

    On the path of every call of a module site: a walk over the modules' own tables, far cheaper than
    `parameters()` and `buffers()`, which build every qualified name (docs/benchmarks.md).
    """
    todo = [module]
    while todo:
        current = todo.pop()
        for table in (current._parameters, current._buffers):
            for tensor in table.values():
                if tensor is not None and not tensor.is_cpu and not tensor.is_meta:
                    kinds.add(tensor.device)
        todo.extend(child for child in current._modules.values() if child is not None)


def devices_of(
    tensors: Iterable[torch.Tensor], module: nn.Module | None = None
) -> tuple[torch.device, ...]:
    """Return the non-CPU devices whose generators a region may draw from, each with its index.

    See NOTE [ Which generators a region draws on ]: the devices of `tensors` and `module`, and every index of
    the accelerator once it is initialised.

    Args:
        tensors: the region's inputs (positional and keyword, flattened).
        module: the module whose method runs in the region; its parameters and buffers count too.

    >>> torch.device("cpu") in devices_of([torch.zeros(2)])  # the CPU's generator is always stashed anyway
    False
    """
    kinds: set[torch.device] = {t.device for t in tensors if not t.is_cpu and not t.is_meta}
    built = _built_accelerator()
    # Without an accelerator no parameter can sit on a device with a generator of its own: the walk over the
    # module's parameters is skipped (it costs more than the rest of a small site's call).
    if module is not None and built is not None:
        _module_devices(module, kinds)
    accelerator = _current_accelerator(built)
    if torch_function_mode_on():
        default = torch.get_default_device()
        if default.type not in _NO_RNG:
            kinds.add(default)
    if not kinds:
        return () if accelerator is None else _every_index(accelerator)
    found = {with_index(device) for device in kinds}
    if accelerator is not None:
        found.update(_every_index(accelerator))
    return tuple(sorted((d for d in found if d is not None), key=str))


class RngStash:
    """The CPU generator state and that of each given device, taken at one moment.

    >>> stash = RngStash.capture(())
    >>> a = torch.rand(1)
    >>> with stash.restore():
    ...     b = torch.rand(1)
    >>> bool(a == b)
    True
    """

    __slots__ = ("cpu", "devices")

    def __init__(self, cpu: torch.Tensor, devices: tuple[tuple[torch.device, Any], ...]) -> None:
        self.cpu = cpu
        self.devices = devices

    @classmethod
    def capture(cls, devices: Collection[torch.device]) -> RngStash:
        """Read the generator state of the CPU and of every device in `devices`."""
        if not devices:  # the common case, on the path of every call: no generator expression
            return cls(_cpu.get_state(), ())
        states = tuple(
            (device, torch.get_device_module(device.type).get_rng_state(device)) for device in devices
        )
        return cls(_cpu.get_state(), states)

    def apply(self) -> None:
        """Set every generator to this stash's state."""
        _cpu.set_state(self.cpu)
        for device, state in self.devices:
            torch.get_device_module(device.type).set_rng_state(state, device)

    def swap_in(self) -> RngStash:
        """Set this stash's states and return the states the caller had, to `apply` afterwards."""
        if not self.devices:
            caller = RngStash(_cpu.get_state(), ())
            _cpu.set_state(self.cpu)
            return caller
        caller = RngStash.capture(tuple(device for device, _ in self.devices))
        self.apply()
        return caller

    @contextmanager
    def restore(self) -> Iterator[None]:
        """Run the block with the stashed states, then put back the states the caller had (a fork)."""
        caller = self.swap_in()
        try:
            yield
        finally:
            caller.apply()


# -- random ops: NOTE [ Random ops ] ---------------------------------------------------------------------------

_DROPOUT: dict[int, tuple[Any, int | None, bool]] = {}  # id(op) -> (op, position of `dropout_p`, seeded)


def _random_info(func: Any) -> tuple[int | None, bool]:
    found = _DROPOUT.get(id(func))
    if found is None or found[0] is not func:
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        names = [argument.name for argument in func._schema.arguments] if seeded else []
        position = names.index("dropout_p") if "dropout_p" in names else None
        found = _DROPOUT[id(func)] = (func, position, seeded)
    return found[1], found[2]


def draws(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> bool:
    """Whether the aten op `func`, called with these arguments, draws random numbers (rule 1 of NOTE
    [ Random ops ]).

    >>> aten = torch.ops.aten
    >>> draws(aten.native_dropout.default, (torch.ones(2), 0.5, True), None)
    True
    >>> q = torch.ones(1, 1, 2, 2)
    >>> draws(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {"dropout_p": 0.0})
    False
    """
    position, seeded = _random_info(func)
    if not seeded or (args and isinstance(args[0], FakeTensor)):
        return False
    if position is None:
        return True
    if kwargs and "dropout_p" in kwargs:
        p = kwargs["dropout_p"]
    elif position < len(args):
        p = args[position]
    else:
        return False  # the schema's default: no dropout
    return bool(p != 0)


def _source(args: Sequence[Any], kwargs: dict[str, Any] | None) -> torch.Generator | torch.device:
    """The generator a random op draws from, or the device whose default generator it is (rule 2)."""
    if kwargs:
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator):
            return generator
    device: torch.device | None = None
    for value in args:
        if isinstance(value, torch.Tensor):
            device = value.device
            break
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            device = value[0].device
            break
    if device is None and kwargs:
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                device = value.device
                break
        else:
            if kwargs.get("device") is not None:
                device = torch.device(kwargs["device"])
    if device is None:
        device = torch.get_default_device()
    if device.type in _NO_RNG:
        return _cpu
    return with_index(device) or device


def _read(source: torch.Generator | torch.device) -> Any:
    if isinstance(source, torch.Generator):
        return source.get_state()
    return torch.get_device_module(source.type).get_rng_state(source)


def _write(source: torch.Generator | torch.device, state: Any) -> None:
    if isinstance(source, torch.Generator):
        source.set_state(state)
    else:
        torch.get_device_module(source.type).set_rng_state(state, source)


class Draw:
    """The state of the generator a random op drew from, read right after the op ran (NOTE [ Random ops ]); for an op
    given its own `generator=`, which no stash covers, also the state right before it (`before`), so that recompute
    can run the op again drawing what it drew (NOTE [ A kept output changed in place ] in kept.py).

    >>> x = torch.ones(1000)
    >>> start = torch.get_rng_state()
    >>> mask = torch.empty_like(x).bernoulli_(0.5)  # forward: a random op that a policy keeps
    >>> draw = Draw.after((x,), None)
    >>> after = torch.rand(3)  # the next random op
    >>> with RngStash(start, ()).restore():  # recompute skips the kept op and sets its draw in its place
    ...     draw.set(None)
    ...     again = torch.rand(3)
    >>> bool(torch.equal(after, again))
    True
    """

    __slots__ = ("before", "source", "state")

    def __init__(self, source: torch.Generator | torch.device, state: Any, before: Any = None) -> None:
        self.source = source
        self.state = state
        self.before = before

    @classmethod
    def after(cls, args: Sequence[Any], kwargs: dict[str, Any] | None, before: Any = None) -> Draw:
        """Read the state of the generator an op with these arguments drew from (rule 2), now; `before`: its state
        read before the op ran, if any (`own_generator`)."""
        source = _source(args, kwargs)
        return cls(source, _read(source), before)

    def set(self, forked: Draws | None) -> None:
        """Set the generator to this state, in place of running the op; `forked` remembers what it had first."""
        if forked is not None:
            forked.fork(self.source)
        _write(self.source, self.state)

    def rewind(self, forked: Draws | None) -> None:
        """Before the op runs again: set its own generator to the state it had before the op in forward (nothing for
        a default generator, which recompute's stash and the draws before it already put there)."""
        if self.before is not None:
            if forked is not None:
                forked.fork(self.source)
            _write(self.source, self.before)


def own_generator(kwargs: dict[str, Any] | None) -> torch.Generator | None:
    """The `generator=` an op is given, which no stash covers (rule 2), or None.

    >>> own_generator({"generator": torch.Generator()}) is not None, own_generator(None)
    (True, None)
    """
    if kwargs:
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator):
            return generator
    return None


class Draws:
    """The generators a recompute set (`Draw.set`), with the states they had before: `restore` puts them back."""

    __slots__ = ("before",)

    def __init__(self) -> None:
        self.before: dict[Any, tuple[torch.Generator | torch.device, Any]] = {}

    def fork(self, source: torch.Generator | torch.device) -> None:
        """Remember `source`'s state, once, before it is first set."""
        if source not in self.before:
            self.before[source] = (source, _read(source))

    def restore(self) -> None:
        """Put back every generator's state from before its first set."""
        for source, state in self.before.values():
            _write(source, state)
        self.before.clear()
