"""What `remat.estimate` returns: the bytes of one training step per remat configuration, as a table."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._measure.measure import format_bytes

__all__ = ["ConfigEstimate", "EstimateReport"]


@dataclass(frozen=True)
class ConfigEstimate:
    """The predicted bytes of one training step under one configuration.

    Attributes:
        config: The configuration as it was given (``"full"``, a policy, a budget).
        label: The configuration in words, as the table shows it.
        params_bytes: Bytes of the parameters (exact).
        buffers_bytes: Bytes of the buffers (exact).
        input_bytes: Bytes of the sample's tensors (exact).
        grads_bytes: Bytes of the parameters' gradients after backward (exact).
        optimizer_bytes: Bytes of the optimizer's state (exact; 0 without an optimizer).
        activation_bytes: Bytes that forward allocated and that are still alive when the loss is computed,
            the loss itself left out: what is held for backward.
        peak_bytes: The highest live bytes of the whole step (forward, backward, optimizer step), the state
            above included; on CUDA, what ``torch.cuda.max_memory_allocated`` would show.
    """

    config: Any
    label: str
    params_bytes: int
    buffers_bytes: int
    input_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    peak_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """Return the numbers as plain JSON-ready values (the configuration as its label)."""
        return {
            "config": self.label,
            "params_bytes": self.params_bytes,
            "buffers_bytes": self.buffers_bytes,
            "input_bytes": self.input_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes,
            "peak_bytes": self.peak_bytes,
        }


_COLUMNS = (
    ("params_bytes", "params"),
    ("grads_bytes", "grads"),
    ("optimizer_bytes", "optimizer"),
    ("activation_bytes", "activations"),
    ("peak_bytes", "peak"),
)


@dataclass(frozen=True)
class EstimateReport:
    """Predicted memory of one training step per configuration: ``report[config]``, ``str(report)``, ``to_dict()``.

    Attributes:
        model: The model's class name.
        device: The device predicted for (``"cpu"``, ``"cuda:0"``).
        optimizer: The optimizer's class name, or ``None`` when the step has no optimizer step.
        rows: One `ConfigEstimate` per configuration, in the order given.

    Example:
        >>> import torch, remat
        >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        >>> model = torch.nn.Sequential(*[block() for _ in range(4)])
        >>> report = remat.estimate(model, torch.randn(8, 64), optimizer="adam", configs=("none", "full"))
        >>> report["none"].params_bytes, report["none"].optimizer_bytes   # Adam: two moments and a step each
        (529408, 1058880)
        >>> report["full"].activation_bytes < report["none"].activation_bytes
        True
    """

    model: str
    device: str
    optimizer: str | None
    rows: tuple[ConfigEstimate, ...]

    def __getitem__(self, config: Any) -> ConfigEstimate:
        for row in self.rows:
            if row.config is config or _same(row.config, config):
                return row
        for row in self.rows:  # a label as printed in the table ("budget 0.3", a policy's name)
            if isinstance(config, str) and row.label == config:
                return row
        raise KeyError(f"remat: this estimate has no configuration {config!r}; it has {[r.label for r in self.rows]}.")

    def __iter__(self) -> Iterator[ConfigEstimate]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as plain JSON-ready values."""
        return {
            "model": self.model,
            "device": self.device,
            "optimizer": self.optimizer,
            "configs": [row.to_dict() for row in self.rows],
        }

    def __str__(self) -> str:
        step = f"optimizer step {self.optimizer}" if self.optimizer else "no optimizer step"
        lines = [f"remat.estimate: {self.model}, one training step ({step}), predicted for {self.device}"]
        if self.device.startswith("cuda"):
            lines.append("peak = torch.cuda.max_memory_allocated (every tensor rounded up to a 512-byte block)")
        header = ("config", *(title for _, title in _COLUMNS))
        rows = [header, *((r.label, *(format_bytes(getattr(r, attr)) for attr, _ in _COLUMNS)) for r in self.rows)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            cells = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == does not give a bool
        return False
