"""What `remat.estimate` returns: the bytes of one training step per remat configuration, as a table."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._core.public import claim
from .._core.units import DEVICE_PEAK, HELD_FOR_BACKWARD, STEP_PEAK, format_bytes
from .phases import peak_lines

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
        activation_bytes: The bytes held for backward: what forward allocated that is still alive once the loss
            is computed and the model's output let go of, the loss itself left out (the table's "held for
            backward").
        peak_bytes: The device peak: the highest live bytes of the whole step (forward, backward, optimizer step),
            the state above included; on CUDA, what ``torch.cuda.max_memory_allocated`` would show. The step lets go
            of the model's output once the loss is made, as ``loss = model(batch).loss`` does. What ``memory=``
            bounds.
        output_bytes: Bytes of the model's output that die when the step lets go of it (what backward does not
            need of it: a language model's logits): a loop that holds on to the output (``out = model(batch)``
            alive through backward) peaks up to this much higher.
        peak_phase: Where the step peaks: ``"forward"``, ``"backward"`` or ``"optimizer step"``.
        phase_bytes: The peak of each phase, the state above included (``peak_bytes`` is the largest).
        holders: The largest holders at the peak, ``(module, bytes)``: in forward or backward what the step
            made (activations, gradients), at the optimizer step each module's parameters, gradients and
            state; repeated blocks folded into one line (``layers.*.mlp (32x)``).
        largest_batch, largest_seq: With ``memory=``: the largest batch size (and sequence length, with
            ``seq_dim=``) whose step fits in it; 0 when none does; None without ``memory=``.
        refused: Why the configuration cannot be met on this sample (a budget below the least one remat can
            meet: the `BudgetError`'s message), else None. A refused row has the state's exact bytes (params,
            buffers, input, grads, optimizer) and no step: its activation and peak bytes are 0, and
            ``least_bytes`` is the smallest budget that is met.
        least_bytes: With ``refused``: the smallest budget remat can meet (the `BudgetError`'s ``least_bytes``).
        constant_bytes: What the device allocates once at the first step and keeps, counted in ``peak_bytes``
            and every phase's peak: on CUDA the cuBLAS workspaces of the forward's and autograd's threads (NOTE
            [ A first step's constants ] in remat/_estimate/constants.py); 0 elsewhere.
        engine_bytes: Under an engine that owns the model (DeepSpeed ZeRO), what it holds for itself besides the
            rows above, counted in ``peak_bytes`` and every phase's peak: its gradient buckets and partitions,
            the parameters it gathers (NOTE [ One rank's state under DeepSpeed ZeRO ] in
            remat/_sites/integrations/deepspeed.py); 0 elsewhere.
        step_peak_bytes: The step peak: the highest live bytes of forward and backward above what was live when
            the step began (the state, the batch and ``constant_bytes`` left out), the gradients backward allocates
            included. What ``budget=`` bounds and ``remat.plan(model)`` and ``remat.measure`` show.
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
    output_bytes: int = 0
    peak_phase: str = ""
    phase_bytes: Mapping[str, int] = field(default_factory=dict)
    holders: tuple[tuple[str, int], ...] = ()
    largest_batch: int | None = None
    largest_seq: int | None = None
    refused: str | None = None
    least_bytes: int | None = None
    constant_bytes: int = 0
    engine_bytes: int = 0
    step_peak_bytes: int = 0
    _parts: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)
    """The peaks of backward's parts split at the model's identical layers, the state included: the largest batch's
    search draws its lines through them (NOTE [ Searching the largest batch ], rule 6); empty elsewhere."""

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
            "output_bytes": self.output_bytes,
            "peak_phase": self.peak_phase,
            "phase_bytes": dict(self.phase_bytes),
            "holders": [list(holder) for holder in self.holders],
            "largest_batch": self.largest_batch,
            "largest_seq": self.largest_seq,
            "refused": self.refused,
            "least_bytes": self.least_bytes,
            "constant_bytes": self.constant_bytes,
            "engine_bytes": self.engine_bytes,
            "step_peak_bytes": self.step_peak_bytes,
        }


_COLUMNS = (
    ("params_bytes", "params"),
    ("grads_bytes", "grads"),
    ("optimizer_bytes", "optimizer"),
    ("activation_bytes", "held for backward"),
    ("step_peak_bytes", "step peak"),
    ("peak_bytes", "device peak"),
)


@dataclass(frozen=True)
class EstimateReport:
    """Predicted memory of one training step per configuration: ``report[config]``, ``str(report)``, ``to_dict()``.

    Attributes:
        model: The model's class name.
        device: The device predicted for (``"cpu"``, ``"cuda:0"``).
        optimizer: The optimizer's class name, or ``None`` when the step has no optimizer step.
        rows: One `ConfigEstimate` per configuration, in the order given.
        memory: The memory the largest batch sizes were searched for, in bytes (None without ``memory=``).
        headroom: Bytes of ``memory`` left to the device's allocator: each largest size's step peaks within
            ``memory - headroom`` (NOTE [ The allocator's reserve ] in reserve.py).
        positions: With ``seq_dim=``, the model's table of learned positions and how many it holds, ``(name,
            count)``, where it has one (GPT-2's ``transformer.wpe``): a `largest_seq` above the count is what the
            memory allows, not a sequence the model can take, and the table says so.

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
    memory: int | None = None
    headroom: int = 0
    positions: tuple[str, int] | None = None

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
            "memory": self.memory,
            "headroom": self.headroom,
            "positions": None if self.positions is None else list(self.positions),
        }

    def __str__(self) -> str:
        step = f"optimizer step {self.optimizer}" if self.optimizer else "no optimizer step"
        lines = [f"remat.estimate: {self.model}, one training step ({step}), predicted for {self.device}"]
        if self.device.startswith("cuda"):
            constants = format_bytes(self.rows[0].constant_bytes) if self.rows else "0 B"
            lines.append("peak = torch.cuda.max_memory_allocated (every tensor rounded up to a 512-byte block; "
                         f"{constants} of cuBLAS workspaces included)")
        header = ("config", *(title for _, title in _COLUMNS), "peaks in")
        rows = [header, *((r.label, *(_cell(r, attr) for attr, _ in _COLUMNS), r.peak_phase or
                           ("refused" if r.refused else "")) for r in self.rows)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            cells = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1], strict=True)),
                     row[-1]]
            lines.append("  ".join(cells).rstrip())
        legend = [f"held for backward: {HELD_FOR_BACKWARD}", f"step peak: {STEP_PEAK}", f"device peak: {DEVICE_PEAK}"]
        return "\n".join([*lines, *legend, *peak_lines(self.rows, self.memory, self.headroom, self.positions)])


def _cell(row: ConfigEstimate, attr: str) -> str:
    """A table cell: the bytes, or "-" for what a refused configuration has no step for."""
    if row.refused is not None and attr in _STEP:
        return "-"
    return format_bytes(getattr(row, attr))


_STEP = frozenset({"activation_bytes", "step_peak_bytes", "peak_bytes"})


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == does not give a bool
        return False

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
