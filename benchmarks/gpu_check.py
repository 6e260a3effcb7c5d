"""`python -m benchmarks --model gpu --device cuda`: the memory promises at real sizes, in one table.

Run on one GPU: GPT-2 124M (batch 16, seq 1024) and a TinyLlama-shaped 1.1B (22 layers, d=2048, GQA 32/4, vocabulary
32,000; batch 4, seq 2048), built from transformers configs with random weights, float32 weights under bf16 autocast.
Without `--device cuda` (and in CI) the same rows run on the CPU at tiny sizes (`TINY`), counted with `remat.track`.

NOTE [ What the GPU check measures ]
1. A step is the AMP recipe's: forward and loss inside `torch.autocast(device, torch.bfloat16)`, backward outside,
   gradients set to None first (as `zero_grad()` leaves them). Its peak is `torch.cuda.max_memory_allocated()` above
   what was allocated when it began (on the CPU: `remat.track`), after one warm-up step; its time is the median of
   `STEPS` steps.
2. Configurations, each on its own copy of the same weights: no remat; transformers' own checkpointing
   (`activation_checkpointing_enable`, non-reentrant); torch's selective checkpoint of each layer, matmuls and
   attention kept (`create_selective_checkpoint_contexts`); remat full, `save_matmuls`, replay, per-layer offload,
   and full remat with the head and the loss in chunks (`head=True`). Each row says its peak against no remat's,
   its step time and how far its gradients are from no remat's; the step-time and head targets are checked on a
   GPU.
2b. Gradients: every configuration's measured step starts from the same seed, so with dropout on (the models'
   default configs) each draws the same masks as no remat's exactly when recompute draws what forward drew. The
   largest relative difference of any parameter's gradient from no remat's (|g - g0|max / |g0|max) is shown; a
   remat row is checked against `GRADIENT_BOUND`, bf16 autocast's own noise being well below it and a shifted
   dropout mask well above (torch's selective checkpoint is shown, not checked: it keeps the fused attention with
   dropout and shifts the stream).
3. The estimate: `remat.estimate` under the same autocast, for no remat, full and `save_matmuls`, against the
   measured step (the whole device's `max_memory_allocated`, parameters and the batch included; within 5%).
4. Budgets 0.3, 0.5 and 0.7 of no remat's peak: `remat.apply(model, budget=f, sample=batch)` under autocast; what
   `apply` itself allocated above its start, and the first three steps' peaks, each against the budget (at most
   1.05; or a `BudgetError`, shown with its least budget).
4b. Each plan's time: its step (the median of `STEPS`, after the three above) against the step of every uniform
   choice of rule 2 whose measured peak fits the same budget (`UNIFORM`: no remat, full remat, full remat of every
   other layer, `save_matmuls`), at most `PLAN_STEP` times the fastest of them on a GPU; and the step time the plan
   predicted against the one measured, both as multiples of no remat's step (a plan made on fake tensors prices a
   nominal device, NOTE [ Priced time ] in remat/_measure/clock.py: only that ratio can be compared).
5. `memory=` with AdamW under a real cap: the device capped at M (`torch.cuda.set_per_process_memory_fraction`;
   on the CPU `remat.track(limit=M)`), `remat.apply(model, memory=M, optimizer=opt)` and three AdamW steps: the
   most reserved (allocated on the CPU) against M, or the step that ran out of memory, or `apply`'s refusal.
6. Long sequences (issue 54), on a Llama-3.2-1B-shaped model (d=2048, MLP 8,192, 16 layers, 32/8 heads, vocabulary
   128,256; batch 1; on the CPU a tiny one): transformers' own checkpointing against remat's line for long
   sequences (`remat.apply(model, head=True, offload=True)` with each layer's MLP and norms in `TILES` tiles).
   Per row: activation bytes per token, the slope of the step's peak between `LONG_SEQS`; the longest sequence the
   device fits, derived from it and the whole device's peak of an AdamW step at the longer length (on the CPU, in a
   device of `LONG_CPU_MEMORY` times transformers' whole step); one AdamW step of remat's line at 4x transformers'
   longest, under the device's cap; the step time at the longer length against transformers'. Targets (on a GPU:
   at the CPU's tiny sizes the figures only): remat's bytes per token at most 1/16 of transformers', its step at
   most 1.15x, and the step at 4x transformers' longest runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import torch
from torch import nn

import remat
from remat._core.units import format_bytes

__all__ = ["REAL", "STEPS", "TINY", "Row", "Shape", "hf_checkpointing", "main", "run"]

STEPS = 3
"""Timed steps per configuration (the median is shown)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model of the check: its transformers config, batch and sequence, and the memory sizes to cap at (bytes;
    fractions of no remat's whole AdamW loop where below 1)."""

    name: str
    kind: str  # "gpt2" or "llama"
    config: dict[str, Any]
    batch: int
    seq: int
    memory: tuple[float, ...]


REAL = (
    Shape("GPT-2 124M", "gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
                                 "vocab_size": 50257}, 16, 1024, (12 * 2**30, 16 * 2**30)),
    Shape("TinyLlama 1.1B", "llama", {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                                      "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
                                      "max_position_embeddings": 2048}, 4, 2048, (24 * 2**30, 28 * 2**30)),
)
TINY = (
    Shape("GPT-2 tiny", "gpt2", {"n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 32, "vocab_size": 128},
          2, 32, (0.75, 0.9)),
    Shape("Llama tiny", "llama", {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                                  "max_position_embeddings": 32}, 2, 32, (0.75, 0.9)),
)
BUDGETS = (0.3, 0.5, 0.7)
LONG_REAL = Shape("Llama-3.2-1B shape", "llama", {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 1 << 20}, 1, 16384, ())
LONG_TINY = Shape("Llama tiny, long", "llama", {
    "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1 << 14}, 1, 256, ())
LONG_SEQS = {"Llama-3.2-1B shape": (8192, 16384), "Llama tiny, long": (128, 256)}
LONG_CPU_MEMORY = 2.0
"""On the CPU, the device of the long rows holds this many times transformers' whole AdamW step at the longer
length (NOTE [ What the GPU check measures ], rule 6)."""
TILES = 8
GRADIENT_BOUND = 0.05
"""The largest relative gradient difference from no remat's a remat configuration may show (NOTE [ What the GPU
check measures ], rule 2b)."""
UNIFORM = ("no remat", "remat full", "remat full, every other layer", "remat save_matmuls")
"""The uniform choices a budget's plan is timed against (NOTE [ What the GPU check measures ], rule 4b)."""
PLAN_STEP = 1.03
"""A plan's step at most this multiple of the fastest uniform choice that fits its budget (rule 4b, on a GPU)."""
HEAD_PEAK = {"GPT-2 124M": 0.25, "TinyLlama 1.1B": 0.2}
"""Full remat with the chunked head: its step's peak as a fraction of no remat's, at most (spec'd on a GPU)."""


@dataclasses.dataclass
class Row:
    """One line of the table: what ran, its figures, and the target it checks (None: none)."""

    model: str
    what: str
    figures: str
    ok: bool | None = None
    target: str = ""


# -- building and stepping --------------------------------------------------------------------------------------


def build(shape: Shape) -> nn.Module:
    """The model, random weights from seed 0, on the CPU (copied to the device per configuration)."""
    hf: Any = importlib.import_module("transformers")
    torch.manual_seed(0)
    if shape.kind == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config(**shape.config, bos_token_id=0, eos_token_id=0))
    else:
        model = hf.LlamaForCausalLM(hf.LlamaConfig(**shape.config))
    model.config.use_cache = False
    return model.train()  # type: ignore[no-any-return]


def sample(shape: Shape, device: torch.device) -> dict[str, torch.Tensor]:
    vocab = int(shape.config["vocab_size"])
    ids = torch.randint(0, vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(0)).to(device)
    return {"input_ids": ids, "labels": ids}


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def step(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> None:
    """One training step as NOTE [ What the GPU check measures ] (rule 1) writes it, no optimizer."""
    for p in model.parameters():
        p.grad = None
    with _autocast(device):
        loss = model(**batch).loss
    loss.backward()


class Device:
    """Peaks and times on the device: the allocator's statistics on CUDA, `remat.track` elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def peak(self) -> Iterator[list[int]]:
        """Yield a list that holds, after the block, the most bytes allocated in it above its start."""
        found: list[int] = []
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            yield found
            self.sync()
            found.append(torch.cuda.max_memory_allocated(self.device) - before)
        else:
            with remat.track() as tracked:
                yield found
            found.append(tracked.peak_bytes)

    def allocated(self) -> int:
        """Bytes allocated now (on the CPU: not known; callers count their tensors instead)."""
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def timed(self, fn: Callable[[], None]) -> float:
        times = []
        for _ in range(STEPS if self.cuda else 1):  # the CPU's times are not checked
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


# -- configurations -------------------------------------------------------------------------------------------


def _layers(model: nn.Module) -> list[nn.Module]:
    hf: Any = model
    inner: Any = hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers
    return list(inner)


def _torch_selective(model: nn.Module) -> nn.Module:
    """torch's selective checkpoint on each layer, matmuls and attention kept (the usual SAC policy)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    keep = {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    contexts = functools.partial(create_selective_checkpoint_contexts, policy)
    for layer in _layers(model):
        forward = layer.forward

        def checkpointed(*args: Any, forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        layer.forward = checkpointed  # the instance's: transformers reads the class's own forward
    return model


def hf_checkpointing(model: nn.Module) -> nn.Module:
    """transformers' own checkpointing of every layer, non-reentrant."""
    enable: Any = getattr(model, "activation_checkpointing_enable", None)  # transformers 5; earlier: its old name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


CONFIGS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "no remat": lambda model: model,
    "transformers' checkpointing": hf_checkpointing,
    "torch selective (matmuls, attention)": _torch_selective,
    "remat full": lambda model: remat.apply(model),
    "remat full, every other layer": lambda model: remat.apply(model, every=2),
    "remat save_matmuls": lambda model: remat.apply(model, policy=remat.policies.save_matmuls),
    "remat replay": lambda model: remat.apply(model, strategy="replay"),
    "remat offload (per layer)": lambda model: remat.apply(model, offload=True),
    "remat full + head": lambda model: remat.apply(model, head=True),
}


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


# -- the rows -----------------------------------------------------------------------------------------------------


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().float().cpu() for name, p in model.named_parameters() if p.grad is not None}


def _gradient_gap(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """The largest relative difference of one parameter's gradient (rule 2b); inf where the sets differ."""
    if ours.keys() != theirs.keys():
        return float("inf")
    return max(
        ((ours[name] - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() for name, want in theirs.items()
    )


def configurations(shape: Shape, base: nn.Module, dev: Device, out: list[Row]) -> dict[str, tuple[int, int, float]]:
    """Each configuration's (step peak, whole device's peak, step seconds): NOTE [ What the GPU check measures ],
    rules 2 and 2b."""
    batch = sample(shape, dev.device)
    found: dict[str, tuple[int, int, float]] = {}
    gaps: dict[str, float] = {}
    reference: dict[str, torch.Tensor] = {}
    for label, configure in CONFIGS.items():
        model = configure(copy.deepcopy(base).to(dev.device))
        one: Callable[[], None] | None = None
        try:
            step(model, batch, dev.device)  # warm-up: cuBLAS workspaces, offload's pinned blocks
            for p in model.parameters():
                p.grad = None
            resident = dev.allocated() or _storage_bytes([*model.parameters(), *model.buffers(), *batch.values()])
            one = functools.partial(step, model, batch, dev.device)
            with remat.enabled(label != "no remat"):
                torch.manual_seed(1)  # every configuration's measured step draws from the same state (rule 2b)
                with dev.peak() as peak:
                    one()
                grads = _gradients(model)
                if label == "no remat":
                    reference = grads
                gaps[label] = _gradient_gap(grads, reference) if reference else float("nan")
                del grads
                seconds = dev.timed(one)
            found[label] = (peak[0], resident + peak[0], seconds)
        except Exception as error:  # a row that fails says so; the others still run
            out.append(Row(shape.name, label, f"failed: {type(error).__name__}: {str(error)[:120]}", False))
        finally:
            del model, one  # `one` holds the model: kept, the next configuration's resident bytes would count it
            dev.free()
    none = found.get("no remat")
    for label, (nbytes, _, seconds) in found.items():
        ratio = f" ({nbytes / none[0]:.2f} of no remat's)" if none else ""
        gap = "" if label == "no remat" else f", gradients {gaps[label]:.2g} from no remat's"
        checked = label.startswith("remat") and label != "no remat"
        out.append(Row(shape.name, label, f"peak {format_bytes(nbytes)}{ratio}, step {seconds * 1e3:.0f} ms{gap}",
                       gaps[label] <= GRADIENT_BOUND if checked else None,
                       f"gradients within {GRADIENT_BOUND} of no remat's (dropout on)"))
    targets = (("remat full", "transformers' checkpointing", 1.0, "full remat's step <= transformers' own"),
               ("remat save_matmuls", "torch selective (matmuls, attention)", 1.0,
                "save_matmuls' step <= torch's selective checkpoint's"),
               ("remat offload (per layer)", "remat full", 1.03, "per-layer offload's step <= 1.03x per-layer remat's"),
               ("remat full + head", "remat full", 1.05, "full remat + head's step <= 1.05x full remat's"))
    for ours, theirs, bound, target in targets:
        if ours in found and theirs in found:
            slower = found[ours][2] / found[theirs][2]
            timed = slower <= bound if dev.cuda else None  # a GPU's targets: on the CPU, the figures only
            out.append(Row(shape.name, f"target: {ours}", f"step {slower:.3f}x {theirs}'s", timed, target))
    head, most = found.get("remat full + head"), HEAD_PEAK.get(shape.name)
    if head is not None and none is not None and most is not None:
        share = head[0] / none[0]
        out.append(Row(shape.name, "target: remat full + head", f"peak {share:.3f} of no remat's",
                       share <= most if dev.cuda else None, f"full remat + head peaks <= {most} of no remat's"))
    return found


def estimates(shape: Shape, base: nn.Module, dev: Device, found: dict[str, tuple[int, int, float]],
              out: list[Row]) -> None:
    """NOTE [ What the GPU check measures ], rule 3."""
    batch = sample(shape, dev.device)
    names = {"none": "no remat", "full": "remat full", "save_matmuls": "remat save_matmuls"}
    model = copy.deepcopy(base).to(dev.device)
    try:
        with _autocast(dev.device):
            report = remat.estimate(model, batch, configs=tuple(names))
    finally:
        del model
        dev.free()
    for config, label in names.items():
        if label in found:
            ratio = report[config].peak_bytes / found[label][1]
            out.append(Row(shape.name, f"estimate {config}", f"predicted {format_bytes(report[config].peak_bytes)}, "
                           f"{ratio:.3f}x measured", abs(ratio - 1) <= 0.05, "estimate within 5% of the step"))


def budgets(shape: Shape, base: nn.Module, dev: Device, out: list[Row],
            found: dict[str, tuple[int, int, float]] | None = None) -> None:
    """NOTE [ What the GPU check measures ], rule 4: `apply`'s own peak against the larger of the budget and full
    remat's peak, predicted or (`found`, from `configurations`) measured: a plan that routes the head verifies full
    remat without it first (NOTE [ The head as a choice ])."""
    batch = sample(shape, dev.device)
    for fraction in BUDGETS:
        model = copy.deepcopy(base).to(dev.device)
        label = f"budget {fraction}"
        try:
            with dev.peak() as planning, _autocast(dev.device):
                remat.apply(model, budget=fraction, sample=batch)
            plan = remat.plan(model).budget
            assert plan is not None
            steps = []
            for _ in range(3):
                with dev.peak() as peak:
                    step(model, batch, dev.device)
                steps.append(peak[0] / plan.budget)
            floor = plan.full_remat[0] if plan.full_remat is not None else 0
            floor = max(floor, (found or {}).get("remat full", (0,))[0])
            ok = max(steps) <= 1.05 and planning[0] <= max(plan.budget, floor) * 1.05
            out.append(Row(shape.name, label, f"budget {format_bytes(plan.budget)}: apply's own peak "
                           f"{planning[0] / plan.budget:.2f}, steps " + " ".join(f"{s:.3f}" for s in steps),
                           ok, "steps <= 1.05x budget; apply <= budget or full remat's peak"))
            seconds = dev.timed(functools.partial(step, model, batch, dev.device))
            out.extend(plan_times(shape, label, plan, seconds, found or {}, dev.cuda))
        except remat.BudgetError as error:
            least = format_bytes(error.least_bytes) if error.least_bytes else "?"
            out.append(Row(shape.name, label, f"refused (least budget {least})", None))
        except Exception as error:
            out.append(Row(shape.name, label, f"failed: {type(error).__name__}: {str(error)[:120]}", False))
        finally:
            del model
            dev.free()


def plan_times(shape: Shape, label: str, plan: Any, seconds: float, found: dict[str, tuple[int, int, float]],
               checked: bool) -> list[Row]:
    """NOTE [ What the GPU check measures ], rule 4b: a plan's step (`seconds`) against each uniform choice of
    `found` whose peak fits its budget, and its predicted step against the measured one; `checked` on a GPU."""
    rows = []
    fits = {name: found[name] for name in UNIFORM if name in found and found[name][0] <= plan.budget}
    target = f"a plan's step <= {PLAN_STEP}x the fastest uniform choice that fits its budget"
    for name, (peak, _, theirs) in fits.items():
        rows.append(Row(shape.name, f"{label} against {name}",
                        f"step {seconds / theirs:.3f}x its (its peak {peak / plan.budget:.2f} of the budget)"))
    if fits:
        fastest, (_, _, theirs) = min(fits.items(), key=lambda item: item[1][2])
        rows.append(Row(shape.name, f"target: {label}", f"step {seconds / theirs:.3f}x the fastest uniform "
                        f"that fits ({fastest})", seconds <= PLAN_STEP * theirs if checked else None, target))
    else:
        rows.append(Row(shape.name, f"target: {label}", "no uniform choice fits its budget"))
    none = found.get("no remat")
    if none is not None and plan.no_remat is not None and plan.no_remat[1] > 0:
        predicted, measured = plan.step_time / plan.no_remat[1], seconds / none[2]
        rows.append(Row(shape.name, f"{label} time", f"predicted {predicted:.2f}x no remat's step, measured "
                        f"{measured:.2f}x: predicted/measured {predicted / measured:.2f}"))
    return rows


@contextlib.contextmanager
def _capped(dev: Device, memory: int) -> Iterator[None]:
    """The device as one of ``memory`` bytes: a real cap on CUDA, `remat.track(limit=)` on the CPU."""
    if dev.cuda:
        dev.free()
        index = dev.device.index if dev.device.index is not None else torch.cuda.current_device()  # it needs one
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory / total), index)
        torch.cuda.reset_peak_memory_stats(index)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, index)
    else:
        with remat.track(limit=memory):
            yield


def memories(shape: Shape, base: nn.Module, dev: Device, out: list[Row]) -> None:
    """NOTE [ What the GPU check measures ], rule 5."""
    batch = sample(shape, dev.device)
    whole = 0
    if any(size < 1 for size in shape.memory):  # fractions: of no remat's whole AdamW loop
        with dev.peak() as peak:
            model = copy.deepcopy(base).to(dev.device)
            adamw = torch.optim.AdamW(model.parameters())
            for _ in range(2):
                step(model, batch, dev.device)
                adamw.step()
            del model, adamw
        whole = peak[0] + _storage_bytes(list(batch.values()))
        dev.free()
    for size in shape.memory:
        memory = int(size * whole) if size < 1 else int(size)
        label = f"memory={format_bytes(memory)}, AdamW"
        reached = 0
        try:
            with _capped(dev, memory):
                model = copy.deepcopy(base).to(dev.device)
                adamw = torch.optim.AdamW(model.parameters())
                with _autocast(dev.device):  # planned as the loop runs
                    remat.apply(model, memory=memory, sample=batch, optimizer=adamw)
                for _ in range(3):
                    reached += 1
                    step(model, batch, dev.device)
                    adamw.step()
                held = torch.cuda.max_memory_reserved(dev.device) if dev.cuda else 0
            figures = f"three steps, reserved {held / memory:.3f} of it" if dev.cuda else "three steps within it"
            out.append(Row(shape.name, label, figures, True, "memory=: the loop runs under a cap of M, or refuses"))
        except remat.BudgetError as error:
            least = format_bytes(error.least_bytes) if error.least_bytes else "?"
            out.append(Row(shape.name, label, f"refused (least {least})", True,
                           "memory=: the loop runs under a cap of M, or refuses"))
        except torch.OutOfMemoryError:
            out.append(Row(shape.name, label, f"out of memory at step {reached}" if reached else
                           "out of memory in apply", False, "memory=: the loop runs under a cap of M, or refuses"))
        finally:
            with contextlib.suppress(NameError):
                del model, adamw
            dev.free()


def _long_line(model: nn.Module, offload: bool = True) -> nn.Module:
    """remat's line for long sequences (rule 6); without offload for `profile_long`."""
    from remat._sites.blocks import find_blocks
    from remat._sites.tiles import tile_blocks

    remat.apply(model, head=True, offload=offload)
    tile_blocks(find_blocks(model), TILES)
    return model


LONG_CONFIGS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "transformers' checkpointing": hf_checkpointing,
    "remat head + tiles + offload": _long_line,
}


def _adamw_step(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device,
                optimizer: torch.optim.Optimizer) -> None:
    step(model, batch, device)
    optimizer.step()


def long_sequences(shape: Shape, base: nn.Module, dev: Device, out: list[Row]) -> None:
    """NOTE [ What the GPU check measures ], rule 6."""
    low, high = LONG_SEQS[shape.name]
    found: dict[str, tuple[float, int, float]] = {}  # bytes per token, whole AdamW step at `high`, step seconds
    for label, configure in LONG_CONFIGS.items():
        model = configure(copy.deepcopy(base).to(dev.device))
        try:
            peaks = []
            for seq in (low, high):
                batch = sample(dataclasses.replace(shape, seq=seq), dev.device)
                step(model, batch, dev.device)  # warm-up at this length
                with dev.peak() as peak:
                    step(model, batch, dev.device)
                peaks.append(peak[0])
            adamw = torch.optim.AdamW(model.parameters())
            _adamw_step(model, batch, dev.device, adamw)  # its state, made
            resident = dev.allocated() or _storage_bytes(
                [*model.parameters(), *model.buffers(), *batch.values(),
                 *(t for state in adamw.state.values() for t in state.values() if isinstance(t, torch.Tensor))])
            with dev.peak() as whole:
                _adamw_step(model, batch, dev.device, adamw)
            seconds = dev.timed(functools.partial(step, model, batch, dev.device))
            found[label] = ((peaks[1] - peaks[0]) / (high - low), resident + whole[0], seconds)
        except Exception as error:
            out.append(Row(shape.name, f"long: {label}", f"failed: {type(error).__name__}: {str(error)[:120]}", False))
        finally:
            del model
            dev.free()
    if len(found) < len(LONG_CONFIGS):
        return
    hf_label, ours_label = LONG_CONFIGS
    hf, ours = found[hf_label], found[ours_label]
    if dev.cuda:
        index = dev.device.index if dev.device.index is not None else torch.cuda.current_device()
        memory = torch.cuda.get_device_properties(index).total_memory
    else:
        memory = int(LONG_CPU_MEMORY * hf[1])
    longest = {label: int(high + (memory - whole) / per_token) for label, (per_token, whole, _) in found.items()}
    for label, (per_token, _, seconds) in found.items():
        out.append(Row(shape.name, f"long: {label}", f"{per_token / 1024:.1f} KiB/token between {low:,} and "
                       f"{high:,} tokens, longest in {format_bytes(memory)} ~{longest[label]:,} tokens, step at "
                       f"{high:,} {seconds * 1e3:.0f} ms"))
    share = ours[0] / hf[0]
    out.append(Row(shape.name, "target: long, bytes per token", f"remat's {share:.3f} of transformers'",
                   share <= 1 / 16 if dev.cuda else None, "remat's bytes per token <= 1/16 of transformers'"))
    slower = ours[2] / hf[2]
    out.append(Row(shape.name, "target: long, step time", f"remat's {slower:.2f}x transformers' at {high:,} tokens",
                   slower <= 1.15 if dev.cuda else None, "remat's step <= 1.15x transformers' at the longer length"))
    seq = 4 * longest[hf_label]
    if seq > int(shape.config["max_position_embeddings"]):
        return
    label = f"long: one AdamW step at {seq:,} tokens (4x transformers' longest)"
    model = _long_line(copy.deepcopy(base).to(dev.device))
    before = 0 if dev.cuda else _storage_bytes([*model.parameters(), *model.buffers()])  # the CPU's cap counts
    try:  # only what is allocated inside it
        with _capped(dev, memory - before):
            adamw = torch.optim.AdamW(model.parameters())
            _adamw_step(model, sample(dataclasses.replace(shape, seq=seq), dev.device), dev.device, adamw)
        out.append(Row(shape.name, label, "ran within the device", True if dev.cuda else None,
                       "remat's line runs 4x transformers' longest"))
    except torch.OutOfMemoryError:  # a GPU's target: at the CPU's tiny sizes the logits are no large share
        out.append(Row(shape.name, label, "out of memory", False if dev.cuda else None,
                       "remat's line runs 4x transformers' longest"))
    finally:
        with contextlib.suppress(NameError):
            del model, adamw
        dev.free()


def run(device: torch.device, shapes: Sequence[Shape], progress: Callable[[str], None] = lambda m: None) -> list[Row]:
    """Every row of the check, for each model of ``shapes``."""
    dev = Device(device)
    out: list[Row] = []
    for shape in shapes:
        progress(f"{shape.name}: building")
        base = build(shape)
        progress(f"{shape.name}: configurations")
        found = configurations(shape, base, dev, out)
        progress(f"{shape.name}: estimate")
        estimates(shape, base, dev, found, out)
        progress(f"{shape.name}: budgets")
        budgets(shape, base, dev, out, found)
        progress(f"{shape.name}: memory=")
        memories(shape, base, dev, out)
        del base
        dev.free()
    return out


def format_rows(device: torch.device, rows: Sequence[Row], tiny: bool) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    sizes = "tiny sizes (CI)" if tiny else "real sizes"
    lines = [f"GPU check: {name}, torch {torch.__version__}, bf16 autocast, {sizes}"]
    width = [max(len(r.model) for r in rows), max(len(r.what) for r in rows)] if rows else [0, 0]
    for r in rows:
        mark = "" if r.ok is None else ("  ok" if r.ok else "  FAILS: " + r.target)
        lines.append(f"{r.model.ljust(width[0])}  {r.what.ljust(width[1])}  {r.figures}{mark}")
    failed = [r for r in rows if r.ok is False]
    lines.append(f"{len(failed)} of {sum(r.ok is not None for r in rows)} checks fail" if failed else
                 f"every check holds ({sum(r.ok is not None for r in rows)})")
    return "\n".join(lines)


def main(device: torch.device, out: TextIO, progress: Callable[[str], None] = lambda m: None,
         tiny: bool | None = None) -> int:
    """Print the table; 1 where a check fails."""
    if tiny is None:
        tiny = device.type != "cuda"
    rows = run(device, TINY if tiny else REAL, progress)
    long = LONG_TINY if tiny else LONG_REAL
    progress(f"{long.name}: long sequences")
    long_sequences(long, build(long), Device(device), rows)
    print(format_rows(device, rows, tiny), file=out)
    return 1 if any(r.ok is False for r in rows) else 0


def _full_head(model: nn.Module) -> nn.Module:
    return remat.apply(model, head=True)


def profile_long(device: torch.device, out: TextIO, tiny: bool | None = None, rows: int = 15) -> None:
    """Where the tiles' step time goes (issue 54: the tiled line's step missed 1.15x on an H200): one step of full
    remat with the head, then with the tiles too, at the long rows' longer length under `torch.profiler`, the ops by
    self time on the device (on the CPU where there is none), and each step's wall time against its device time."""
    from torch.profiler import ProfilerActivity, profile

    if tiny is None:
        tiny = device.type != "cuda"
    shape = LONG_TINY if tiny else LONG_REAL
    dev, base = Device(device), build(shape)
    batch = sample(dataclasses.replace(shape, seq=LONG_SEQS[shape.name][1]), device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    key = "self_device_time_total" if dev.cuda else "self_cpu_time_total"
    tiled = functools.partial(_long_line, offload=False)
    for label, configure in (("remat full + head", _full_head), ("remat full + head + tiles", tiled)):
        model = configure(copy.deepcopy(base).to(device))
        step(model, batch, device)  # warm-up
        dev.sync()
        begun = time.perf_counter()
        with profile(activities=activities) as prof:
            step(model, batch, device)
            dev.sync()
        wall = time.perf_counter() - begun
        averages = prof.key_averages()
        busy = sum(getattr(event, key) for event in averages) / 1e6
        print(f"{shape.name}, {label}, {batch['input_ids'].shape[1]:,} tokens: step {wall * 1e3:.0f} ms under the "
              f"profiler, {len(averages)} kinds of op, {'device' if dev.cuda else 'CPU'} self time {busy * 1e3:.0f} ms",
              file=out)
        print(averages.table(sort_by=key, row_limit=rows), file=out)
        del model, prof
        dev.free()


if __name__ == "__main__":
    chosen = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "--profile-long" in sys.argv[1:]:
        profile_long(chosen, sys.stdout)
        raise SystemExit(0)
    raise SystemExit(main(chosen, sys.stdout))
