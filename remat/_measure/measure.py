"""Measure one training step of a function or module: `remat.measure`.

NOTE [ Held for backward ]
"Bytes held for backward" is what a rematerialization scheme exists to shrink: the bytes of the
storages allocated during forward that are still alive once forward has returned, minus the
storages of the output itself. With the output excluded, what remains is what autograd keeps
(saved activations, and remat's own saved inputs and handles) plus anything the function stashed
elsewhere (caches, module attributes). Tensors created before the call (inputs, parameters) are
not counted, even when autograd saves them. An output that is a view of a saved activation makes
that activation's storage count as output, so it is left out of the held bytes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._engine import stats as _stats
from .._engine.rng import RngStash, devices_of
from .._format import format_bytes
from .._switch import enabled
from .._torch_compat import tree_leaves
from .loss import default_loss
from .track import synchronize as _sync
from .track import track

__all__ = ["Measurement", "Report", "format_bytes", "format_seconds", "measure"]


def format_seconds(s: float | None) -> str:
    """Format a duration in s, ms or µs; ``None`` as a dash."""
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


@dataclass(frozen=True)
class Measurement:
    """One forward and backward, measured. Bytes are live storage bytes (see `remat.track`).

    Attributes:
        label: What was measured (``"remat on"``, ``"remat off"``, or ``"as is"``).
        peak_bytes: Highest live bytes during forward and backward, all devices together.
        held_bytes: Bytes held for backward at the end of forward (see NOTE [ Held for backward ]).
        peak_by_device: ``peak_bytes`` per device name.
        held_by_device: ``held_bytes`` per device name.
        forward_seconds: Wall time of the forward call (device work synchronised).
        backward_seconds: Wall time of the backward.
        recompute_seconds: Time remat spent rebuilding activations during backward, or ``None``
            when this remat build does not report it.
    """

    label: str
    peak_bytes: int
    held_bytes: int
    peak_by_device: Mapping[str, int]
    held_by_device: Mapping[str, int]
    forward_seconds: float
    backward_seconds: float
    recompute_seconds: float | None

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as plain JSON-ready values."""
        return {
            "label": self.label,
            "peak_bytes": self.peak_bytes,
            "held_bytes": self.held_bytes,
            "peak_by_device": dict(self.peak_by_device),
            "held_by_device": dict(self.held_by_device),
            "forward_seconds": self.forward_seconds,
            "backward_seconds": self.backward_seconds,
            "recompute_seconds": self.recompute_seconds,
        }


_ROWS: tuple[tuple[str, str], ...] = (
    ("peak_bytes", "peak memory"),
    ("held_bytes", "held for backward"),
    ("forward_seconds", "forward time"),
    ("backward_seconds", "backward time"),
    ("recompute_seconds", "recompute time"),
)


@dataclass(frozen=True)
class Report:
    """What `measure` found: one `Measurement`, or two side by side with ``compare=True``.

    The attributes of the first run (``remat on`` when comparing) are also available on the report
    itself: ``report.peak_bytes`` is ``report.runs[0].peak_bytes``.

    Attributes:
        name: The measured function's or module's name.
        runs: The measurements; with ``compare=True``, ``(remat on, remat off)``.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(1000, requires_grad=True)
        >>> report = remat.measure(lambda t: t.exp().exp(), x)
        >>> report.held_bytes, report.to_dict()["runs"][0]["held_bytes"]  # exp saves its output
        (4000, 4000)
        >>> print(str(report).splitlines()[0])  # an aligned table follows
        remat.measure: <lambda>
    """

    name: str
    runs: tuple[Measurement, ...] = field(default=())

    def _first(self) -> Measurement:
        if not self.runs:
            raise ValueError("remat: this Report holds no measurement.")
        return self.runs[0]

    @property
    def peak_bytes(self) -> int:
        """Peak live bytes of the first run, all devices together."""
        return self._first().peak_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes held for backward at the end of the first run's forward."""
        return self._first().held_bytes

    @property
    def peak_by_device(self) -> Mapping[str, int]:
        """Peak live bytes of the first run per device name."""
        return self._first().peak_by_device

    @property
    def held_by_device(self) -> Mapping[str, int]:
        """Held bytes of the first run per device name."""
        return self._first().held_by_device

    @property
    def forward_seconds(self) -> float:
        """Forward time of the first run."""
        return self._first().forward_seconds

    @property
    def backward_seconds(self) -> float:
        """Backward time of the first run."""
        return self._first().backward_seconds

    @property
    def recompute_seconds(self) -> float | None:
        """Recompute time of the first run, or None when remat does not report it."""
        return self._first().recompute_seconds

    def ratios(self) -> dict[str, float | None]:
        """Return first run / second run for each number (empty without ``compare=True``).

        Keys are the `Measurement` fields ``peak_bytes``, ``held_bytes``, ``forward_seconds``,
        ``backward_seconds`` and ``recompute_seconds``.

        A ratio is ``None`` where a number is missing or the denominator is zero.
        """
        if len(self.runs) < 2:
            return {}
        a, b = self.runs[0], self.runs[1]
        out: dict[str, float | None] = {}
        for attr, _ in _ROWS:
            x, y = getattr(a, attr), getattr(b, attr)
            out[attr] = None if x is None or not y else x / y
        return out

    def to_dict(self) -> dict[str, Any]:
        """Return the report as plain JSON-ready values: name, runs and ratios."""
        return {
            "name": self.name,
            "runs": [r.to_dict() for r in self.runs],
            "ratios": self.ratios(),
        }

    def __str__(self) -> str:
        devices = sorted({d for r in self.runs for d in r.peak_by_device})
        rows: list[tuple[str, ...]] = []
        header = ("", *(r.label for r in self.runs))
        ratios = self.ratios()
        if ratios:
            header = (*header, "ratio")
        for attr, title in _ROWS:
            fmt: Callable[[Any], str] = format_bytes if attr.endswith("bytes") else format_seconds
            row = (title, *(fmt(getattr(r, attr)) for r in self.runs))
            if ratios:
                ratio = ratios[attr]
                row = (*row, "-" if ratio is None else f"{ratio:.2f}x")
            rows.append(row)
            if attr.endswith("bytes") and len(devices) > 1:
                by = "peak_by_device" if attr == "peak_bytes" else "held_by_device"
                for d in devices:
                    sub = (f"  on {d}", *(format_bytes(getattr(r, by).get(d, 0)) for r in self.runs))
                    rows.append((*sub, "") if ratios else sub)
        table = [header, *rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        lines = [f"remat.measure: {self.name}"]
        for r in table:
            cells = [r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)


def _name(target: object) -> str:
    if isinstance(target, nn.Module):
        return type(target).__name__
    return str(getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target)))


def _loss(out: object) -> torch.Tensor:
    """The scalar to back-propagate: `default_loss` (the output's `.loss`, else the sum of its floating tensors)."""
    try:
        value: torch.Tensor | None = default_loss(out)
    except TypeError:
        value = None
    if value is None or not value.requires_grad:
        raise ValueError(
            "remat: measure needs an output with a floating-point tensor that requires grad, "
            f"but got `{type(out).__name__}` with none; pass inputs or parameters that require grad."
        )
    return value


def _leaves(obj: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _fresh_grads(leaves: list[torch.Tensor]) -> Iterator[None]:
    """Run with ``.grad`` of ``leaves`` set to None, and put back what was there."""
    saved = [t.grad for t in leaves]
    try:
        for t in leaves:
            t.grad = None
        yield
    finally:
        for t, g in zip(leaves, saved, strict=True):
            t.grad = g


def _run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    label: str,
    devices: set[torch.device],
) -> Measurement:
    _sync(devices)
    with track() as t:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync(devices)
        forward = time.perf_counter() - start
        own = t._bytes_of(_leaves(out))
        held = {d: t.current(d) - own.get(d, 0) for d in t.devices}
        loss = _loss(out)
        recompute_before = _stats.recompute_seconds
        start = time.perf_counter()
        torch.autograd.backward(loss)
        _sync(devices)
        backward = time.perf_counter() - start
        recompute_after = _stats.recompute_seconds
        del out, loss
    recompute = recompute_after - recompute_before
    return Measurement(
        label=label,
        peak_bytes=t.peak_bytes,
        held_bytes=sum(held.values()),
        peak_by_device={str(d): t.peak(d) for d in t.devices},
        held_by_device={str(d): n for d, n in held.items()},
        forward_seconds=forward,
        backward_seconds=backward,
        recompute_seconds=recompute,
    )


def measure(fn_or_module: Callable[..., Any], *args: Any, compare: bool = False, **kwargs: Any) -> Report:
    """Run one forward and backward of ``fn_or_module(*args, **kwargs)`` and measure it.

    Backward starts from the output if it is a scalar, else from the sum of ``t.sum()`` over its
    floating-point tensors that require grad. Memory is counted with `remat.track` (live storage
    bytes per device, exact on CPU); tensors that exist before the call, such as inputs and
    parameters, are not counted, gradients made by the backward are. The ``.grad`` of parameters
    and of inputs is set aside during the measurement and put back afterwards, so the gradients
    of the measured step are not kept. Times include the tracker's cost of a few microseconds per
    aten op; for precise step times use ``python -m remat``.

    Args:
        fn_or_module: A function or module to call.
        *args: Positional arguments for the call.
        compare: Also run with remat switched off (``remat.enabled(False)``) and show both, with
            their ratios. The first run's RNG state is restored for the second, so dropout masks
            match, and a module's buffers (BatchNorm statistics) are restored after the first run,
            so they end up updated once.
        **kwargs: Keyword arguments for the call.

    Returns:
        A `Report`; ``print(report)`` shows a table, ``report.to_dict()`` the numbers.

    Raises:
        ValueError: The output has no floating-point tensor that requires grad.

    Example:
        >>> import torch, remat
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
        ...                           torch.nn.Linear(256, 64))
        >>> report = remat.measure(mlp, torch.randn(32, 64))
        >>> report.held_bytes  # ReLU's output, saved by ReLU and by the second Linear
        32768
    """
    if not callable(fn_or_module):
        raise TypeError(f"remat: measure expects a function or module, but got `{type(fn_or_module).__name__}`.")
    inputs = _leaves((args, kwargs))
    params = list(fn_or_module.parameters()) if isinstance(fn_or_module, nn.Module) else []
    grad_leaves = [t for t in (*inputs, *params) if t.requires_grad and t.is_leaf]
    module = fn_or_module if isinstance(fn_or_module, nn.Module) else None
    devices = set(devices_of(inputs, module))
    name = _name(fn_or_module)
    with _fresh_grads(grad_leaves):
        if not compare:
            return Report(name, (_run(fn_or_module, args, kwargs, "as is", devices),))
        buffers = [b.detach().clone() for b in fn_or_module.buffers()] if isinstance(fn_or_module, nn.Module) else []
        with RngStash.capture(devices).restore():  # the second run starts from the same RNG state
            with enabled(True):
                on = _run(fn_or_module, args, kwargs, "remat on", devices)
            for t in grad_leaves:
                t.grad = None
        if isinstance(fn_or_module, nn.Module):
            with torch.no_grad():
                for b, old in zip(fn_or_module.buffers(), buffers, strict=True):
                    b.copy_(old)
        with enabled(False):
            off = _run(fn_or_module, args, kwargs, "remat off", devices)
        return Report(name, (on, off))
