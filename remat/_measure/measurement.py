"""What `remat.measure` returns: `Measurement` (one run) and `Report` (one or two, side by side), and the
byte and time formats the benchmark shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._core.public import claim
from .._core.units import HELD_FOR_BACKWARD, STEP_PEAK, format_bytes

__all__ = ["Measurement", "Report", "format_bytes", "format_seconds"]


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
        peak_bytes: The step peak: the most bytes live during forward and backward above what was live before
            the call, the gradients backward allocates included, all devices together (what a budget bounds).
        held_bytes: Bytes held for backward: what forward made that is still alive when it returns, its output
            left out (see NOTE [ Held for backward ]).
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
    ("peak_bytes", "step peak"),
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
        notes: Plain sentences printed under the table (how times were taken, a model with no
            remat site).

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
    notes: tuple[str, ...] = field(default=())

    def _first(self) -> Measurement:
        if not self.runs:
            raise ValueError("remat: this Report holds no measurement.")
        return self.runs[0]

    @property
    def peak_bytes(self) -> int:
        """The step peak of the first run, all devices together."""
        return self._first().peak_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes held for backward at the end of the first run's forward."""
        return self._first().held_bytes

    @property
    def peak_by_device(self) -> Mapping[str, int]:
        """The step peak of the first run per device name."""
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
            "notes": list(self.notes),
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
        lines += [f"step peak: {STEP_PEAK}", f"held for backward: {HELD_FOR_BACKWARD}"]
        lines.extend(self.notes)
        return "\n".join(lines)

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
