"""The built-in benchmark behind ``python -m remat`` (spec §5).

For each model, every configuration runs on its own copy of the same weights and the same batch:
one warm-up step, one step under `remat.track` for memory and gradients, then ``repeats`` timed
steps, interleaved across configurations (``a b c a b c ...``) so that a machine's drift affects
them alike; the step time shown is the median. The tiny-function rows measure the per-call
overhead of spec §5.1 the same way.

NOTE [ What the memory columns count ]
Parameters and their ``.grad`` exist before the tracked step (the gradients are zero-filled
first, as after a step of ``zero_grad(set_to_none=False)``), so they are not counted: "peak" is
the highest number of live tensor bytes the step adds (activations, remat's saved inputs,
temporaries, incoming gradients), and "held" is what is still alive at the end of forward, minus
the loss itself (see NOTE [ Held for backward ] in _measure.py).

Configurations live in a registry (`register`), so rows such as ``save_matmuls`` or
``remat.chain`` plug in without touching the runner.
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from .._api import remat
from .._measure.measure import format_bytes, format_seconds
from .._measure.track import synchronize as _sync
from .._measure.track import track
from .._policies import save_matmuls
from .models import (
    CHAIN_SIZES,
    CONVNET_SIZES,
    GPT,
    GPT_SIZES,
    BenchModel,
    ChainNet,
    ConvNet,
    human_count,
    parameter_count,
    tiny,
    tiny_input,
)

__all__ = ["CONFIGS", "Config", "Result", "format_table", "main", "plot", "register", "run"]

SEED = 1234
NO_REMAT = "no remat"
TORCH = "torch.utils.checkpoint"


# -- the registry of configurations --------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One benchmark row: how to rematerialize the blocks of a fresh copy of a model.

    Attributes:
        name: The row's label.
        prepare: Changes the copy in place: replaces ``model.call``, ``model.stack`` or the blocks,
            and returns a note for the table or None. It may raise ImportError/AttributeError when
            the feature is not available yet; the row then says so.
        wrap_tiny: How the tiny function of spec §5.1 is wrapped for the overhead rows, or None to
            leave this configuration out of them.
        models: Model names the row applies to; None for all.
    """

    name: str
    prepare: Callable[[BenchModel], str | None]
    wrap_tiny: Callable[[Callable[[torch.Tensor], torch.Tensor]], Callable[[torch.Tensor], torch.Tensor]] | None = None
    models: tuple[str, ...] | None = None


CONFIGS: list[Config] = []


def register(config: Config) -> Config:
    """Add a configuration (a row) to the benchmark; a later one with the same name replaces it.

    Example:
        >>> from remat.bench.cli import Config, register, CONFIGS
        >>> _ = register(Config("plain again", lambda model: None, models=("gpt",)))
        >>> CONFIGS[-1].name
        'plain again'
        >>> _ = CONFIGS.pop()
    """
    for i, existing in enumerate(CONFIGS):
        if existing.name == config.name:
            CONFIGS[i] = config
            return config
    CONFIGS.append(config)
    return config


def _torch_call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = checkpoint(block, x, use_reentrant=False)
    return out


def _torch_tiny(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def wrapped(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(fn, x, use_reentrant=False)
        return out

    return wrapped


def _remat_blocks(model: BenchModel) -> str | None:
    for block in model.blocks:
        remat(block)
    return None


def _remat_tiny(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return remat(fn)


def _region_call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with remat.region():
        out: torch.Tensor = block(x)
    return out


def _region_blocks(model: BenchModel) -> str | None:
    model.call = _region_call
    return None


def _region_tiny(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def wrapped(x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            return fn(x)

    return wrapped


def _save_matmuls_blocks(model: BenchModel) -> str | None:
    for block in model.blocks:
        remat(policy=save_matmuls)(block)
    return None


def _chain_blocks(model: BenchModel) -> str | None:
    from .._errors import BudgetError
    from .._plan.chain import chain

    with torch.no_grad():
        sample = model.embed(*model.sample(next(model.parameters()).device, seed=SEED))
    try:
        model.stack = chain(list(model.blocks), budget=0.5, sample=sample)
    except BudgetError as e:
        smallest = re.search(r"smallest feasible budget is (\d+) bytes", str(e))
        if smallest is None:
            raise
        budget = int(smallest.group(1))
        model.stack = chain(list(model.blocks), budget=budget, sample=sample)
        return f"50% is below the smallest budget; ran at that, {format_bytes(budget)}"
    return None


class _Sequential(nn.Module):
    def __init__(self, blocks: nn.ModuleList, segments: int) -> None:
        super().__init__()
        self.blocks, self.segments = blocks, segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = cast(Callable[..., torch.Tensor], checkpoint_sequential)
        return run(list(self.blocks), self.segments, x, use_reentrant=False)


def _sequential_blocks(model: BenchModel) -> str | None:
    model.stack = _Sequential(model.blocks, max(1, round(math.sqrt(len(model.blocks)))))
    return None


def _torch_blocks(model: BenchModel) -> str | None:
    model.call = _torch_call
    return None


register(Config(NO_REMAT, lambda model: None, wrap_tiny=lambda fn: fn))
register(Config(TORCH, _torch_blocks, wrap_tiny=_torch_tiny))
register(Config("@remat", _remat_blocks, wrap_tiny=_remat_tiny))
register(Config("remat.region", _region_blocks, wrap_tiny=_region_tiny))
register(Config("@remat(policy=save_matmuls)", _save_matmuls_blocks))
register(Config("checkpoint_sequential, √n segments", _sequential_blocks))
register(Config("remat.chain(budget=0.5)", _chain_blocks))


# -- results -------------------------------------------------------------------------------------


@dataclass
class Result:
    """One row of the table: a configuration measured on a model.

    ``step_seconds`` holds every timed repeat (per call for the tiny function); ``step`` is
    their median.
    """

    model: str
    config: str
    peak_bytes: int | None = None
    held_bytes: int | None = None
    step_seconds: list[float] = field(default_factory=list)
    grad_diff: float | None = None
    note: str = ""
    compare: bool = True  # whether ratios to the no-remat and torch rows make sense

    @property
    def step(self) -> float | None:
        """Median step time in seconds, or None when the row did not run."""
        return statistics.median(self.step_seconds) if self.step_seconds else None

    def to_dict(self) -> dict[str, Any]:
        """Return the row as plain JSON-ready values, with the median step time."""
        return {**asdict(self), "step_median_seconds": self.step}


# -- progress ------------------------------------------------------------------------------------


class _Progress:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self, stream: TextIO, quiet: bool) -> None:
        self.stream, self.quiet = stream, quiet
        self.tty = stream.isatty()
        self.width = 0
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        line = f"[{time.perf_counter() - self.start:5.1f} s] {message}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


# -- running -------------------------------------------------------------------------------------


def _note(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 60 else text[:57] + "..."


def _timed_step(model: BenchModel, batch: Sequence[torch.Tensor], device: torch.device) -> float:
    for p in model.parameters():
        p.grad = None
    devices = {device}
    _sync(devices)
    start = time.perf_counter()
    loss = model.loss(*batch)
    torch.autograd.backward(loss)
    _sync(devices)
    return time.perf_counter() - start


def _tracked_step(model: BenchModel, batch: Sequence[torch.Tensor]) -> tuple[int, int, list[torch.Tensor]]:
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)  # see NOTE [ What the memory columns count ]
    torch.manual_seed(SEED)
    with track() as t:
        loss = model.loss(*batch)
        held = t.current_bytes - sum(t._bytes_of([loss]).values())
        torch.autograd.backward(loss)
        del loss
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return t.peak_bytes, held, grads


def _max_diff(grads: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    return max((float((g - r).abs().max()) for g, r in zip(grads, reference, strict=True) if g.numel()), default=0.0)


MODELS: dict[str, Callable[[str], BenchModel]] = {
    "gpt": lambda size: GPT(GPT_SIZES[size]),
    "convnet": lambda size: ConvNet(CONVNET_SIZES[size]),
}


def _bench_model(
    name: str,
    base: BenchModel,
    device: torch.device,
    repeats: int,
    configs: Sequence[Config],
    progress: Callable[[str], None],
) -> list[Result]:
    base.to(device).train()
    batch = base.sample(device, seed=SEED)
    results: list[Result] = []
    running: list[tuple[Result, BenchModel]] = []
    for config in configs:
        if config.models is not None and name not in config.models:
            continue
        result = Result(name, config.name)
        results.append(result)
        progress(f"{name}: preparing {config.name}")
        model = copy.deepcopy(base)
        try:
            result.note = config.prepare(model) or ""
        except (ImportError, AttributeError) as e:
            result.note = f"not available ({_note(e)})"
            continue
        try:
            torch.manual_seed(SEED)
            _timed_step(model, batch, device)  # warm-up: lazy imports, allocator, caches
        except Exception as e:
            result.note = f"failed: {_note(e)}"
            continue
        running.append((result, model))
    reference: list[torch.Tensor] | None = None
    for result, model in running:
        progress(f"{name}: memory of {result.config}")
        result.peak_bytes, result.held_bytes, grads = _tracked_step(model, batch)
        if reference is None and result.config == NO_REMAT:
            reference = grads
        if reference is not None:
            result.grad_diff = _max_diff(grads, reference)
    for r in range(repeats):
        for result, model in running:
            progress(f"{name}: repeat {r + 1}/{repeats}, {result.config}")
            torch.manual_seed(SEED + r)
            result.step_seconds.append(_timed_step(model, batch, device))
    return results


def _bench_tiny(
    device: torch.device,
    repeats: int,
    configs: Sequence[Config],
    progress: Callable[[str], None],
    calls: int = 300,
) -> list[Result]:
    x = tiny_input(device)
    seed_grad = torch.ones_like(x)
    results: list[Result] = []
    running: list[tuple[Result, Callable[[torch.Tensor], torch.Tensor]]] = []
    reference: torch.Tensor | None = None
    for config in configs:
        if config.wrap_tiny is None or (config.models is not None and "tiny" not in config.models):
            continue
        result = Result("tiny", config.name)
        results.append(result)
        progress(f"tiny: preparing {config.name}")
        try:
            fn = config.wrap_tiny(tiny)
        except (ImportError, AttributeError) as e:
            result.note = f"not available ({_note(e)})"
            continue
        try:
            for _ in range(20):  # warm-up
                x.grad = None
                torch.autograd.backward(fn(x), seed_grad)
        except Exception as e:
            result.note = f"failed: {_note(e)}"
            continue
        assert x.grad is not None
        if reference is None and config.name == NO_REMAT:
            reference = x.grad.clone()
        if reference is not None:
            result.grad_diff = float((x.grad - reference).abs().max())
        running.append((result, fn))
    for r in range(repeats):
        for result, fn in running:
            progress(f"tiny: repeat {r + 1}/{repeats}, {result.config}")
            _sync({device})
            start = time.perf_counter()
            for _ in range(calls):
                torch.autograd.backward(fn(x), seed_grad)
            _sync({device})
            result.step_seconds.append((time.perf_counter() - start) / calls)
    by_name = {res.config: res.step for res in results}
    plain, theirs = by_name.get(NO_REMAT), by_name.get(TORCH)
    for res in results:
        ours = res.step
        if res.config in (NO_REMAT, TORCH) or None in (ours, plain, theirs):
            continue
        assert ours is not None and plain is not None and theirs is not None
        if theirs > plain:
            ratio = (ours - plain) / (theirs - plain)
            res.note = f"overhead {ratio:.2f} of torch's (§5.1 target ≤ 0.33)"
    return results


# -- remat.chain against checkpoint_sequential (spec §5.5) -----------------------------------------

CHAIN_BUDGET = 0.5
CHAIN = f"remat.chain(budget={CHAIN_BUDGET})"


def _sequential_name(k: int) -> str:
    return f"checkpoint_sequential, {k} segment{'s' if k > 1 else ''}"


def _bench_chain(
    base: ChainNet, device: torch.device, repeats: int, progress: Callable[[str], None]
) -> tuple[str, dict[str, Any], list[Result]]:
    """Spec §5.5 on `ChainNet`: `remat.chain` at 50% of the chain's activation memory, against
    torch's `checkpoint_sequential` (``use_reentrant=False``) with every segment count 1..n.

    Every configuration is a row of `_bench_model` (same peak definition, interleaved repeats). The
    table keeps no remat, the chain and the fastest ``checkpoint_sequential`` whose measured peak is
    at most the chain's; the whole sweep, the budget and the plan's predictions go to the returned
    summary (the ``chain`` entry of the JSON metadata).
    """
    from .._errors import BudgetError
    from .._plan.chain import Chain, chain
    from .._plan.solver import Plan

    n = len(base.blocks)
    chains: list[Chain] = []

    def chained(model: BenchModel) -> str | None:
        sample = model.sample(device, seed=SEED)[0]
        note = None
        try:
            built = chain(list(model.blocks), budget=CHAIN_BUDGET, sample=sample)
        except BudgetError as e:
            smallest = re.search(r"smallest feasible budget is (\d+) bytes", str(e))
            if smallest is None:
                raise
            built = chain(list(model.blocks), budget=int(smallest.group(1)), sample=sample)
            note = f"{CHAIN_BUDGET:.0%} is below the smallest budget; ran at that"
        model.stack = built
        chains.append(built)
        return note

    def sequential(k: int) -> Callable[[BenchModel], str | None]:
        def prepare(model: BenchModel) -> str | None:
            model.stack = _Sequential(model.blocks, k)
            return None

        return prepare

    configs = [
        Config(NO_REMAT, lambda model: None),
        Config(CHAIN, chained),
        *(Config(_sequential_name(k), sequential(k)) for k in range(1, n + 1)),
    ]
    description = f"{base.describe()} ({human_count(parameter_count(base))} parameters, float32)"
    rows = _bench_model("chain", base, device, repeats, configs, progress)
    by_name = {r.config: r for r in rows}
    none, ours = by_name[NO_REMAT], by_name[CHAIN]
    sweep = [by_name[_sequential_name(k)] for k in range(1, n + 1)]
    summary: dict[str, Any] = {
        "budget_fraction": CHAIN_BUDGET,
        "sequential": "torch.utils.checkpoint.checkpoint_sequential(use_reentrant=False)",
        "sweep": [{"segments": k + 1, "peak_bytes": r.peak_bytes, "step_median_seconds": r.step}
                  for k, r in enumerate(sweep)],
    }  # fmt: skip
    shown = [none, ours]
    if not chains or ours.peak_bytes is None or ours.step is None:
        return description, summary, shown + sweep
    plan = chains[0].plan
    assert plan is not None
    input_bytes, budget = plan.input_bytes, plan.budget
    assert budget is not None
    # The budget counts the chain's input (NOTE [ Memory model ] in _solver.py); the measured peak does
    # not (the batch exists before the step), so it is added back to compare like with like.
    counted = ours.peak_bytes + input_bytes
    baseline = Plan.no_remat(plan.stages, input_bytes=input_bytes)
    summary.update(
        budget_bytes=budget,
        input_bytes=input_bytes,
        predicted_peak_bytes=plan.peak_bytes,
        measured_peak_bytes=ours.peak_bytes,
        peak_over_budget=counted / budget,
        predicted_seconds=plan.makespan,
        measured_seconds=ours.step,
        predicted_over_measured=plan.makespan / ours.step,
        extra_forwards=plan.extra_forwards(),
        no_remat_predicted_peak_bytes=baseline.peak_bytes,
        no_remat_measured_peak_bytes=none.peak_bytes,
        no_remat_predicted_seconds=baseline.makespan,
        no_remat_measured_seconds=none.step,
    )
    summary.update(
        # The chain returns its parameters' gradients to autograd when its backward ends, so a copy of
        # them is alive on top of the zero-filled .grad (see NOTE [ What the memory columns count ]):
        # what the measured peak adds to the plan's, which counts activations only.
        parameter_bytes=sum(p.numel() * p.element_size() for p in base.parameters()),
        measured_minus_predicted_bytes=counted - plan.peak_bytes,
    )
    ours.note = "; ".join(
        filter(None, [
            ours.note,
            f"peak+input/budget {counted / budget:.3f} (budget {format_bytes(budget)}, §5.5 ≤ 1.05)",
            f"predicted/measured time {plan.makespan / ours.step:.2f} (§5.5 within 15%)",
        ])
    )  # fmt: skip
    if none.step is not None:
        none.note = f"predicted/measured time {baseline.makespan / none.step:.2f} (the chain's profile, no remat)"
    fits = [(r.step, k + 1, r) for k, r in enumerate(sweep) if r.step is not None and r.peak_bytes is not None
            and r.peak_bytes <= ours.peak_bytes]  # fmt: skip
    if not fits:
        summary["best_sequential"] = None
        ours.note += "; no checkpoint_sequential fits its peak"
        return description, summary, shown
    _, k, best = min(fits, key=lambda fit: fit[0])
    assert best.step is not None
    best.config = f"{_sequential_name(k)} (best fitting)"
    best.note = f"fastest k of 1..{n} with peak ≤ the chain's; chain time/this {ours.step / best.step:.2f}x (§5.5 ≤ 1)"
    summary.update(best_sequential=k, best_sequential_seconds=best.step, chain_over_sequential=ours.step / best.step)
    return description, summary, [*shown, best]


REPLAY_OPS = 64


def _many_ops(x: torch.Tensor) -> torch.Tensor:
    for _ in range(REPLAY_OPS // 2):
        x = (x * 1.0001).sin()
    return x


def _bench_replay(device: torch.device, repeats: int, progress: Callable[[str], None], calls: int = 30) -> list[Result]:
    """Forward-only overhead of `remat.region` per recorded op (spec §5.2), against the plain function.

    Two rows: ops on a tensor that needs no grad (the recording alone), and on one that does (recording plus
    the saved-tensor hooks of the ops that save tensors: `sin` saves its input, half of the ops here).
    """
    rows = [
        (Result("tiny", "remat.region forward, per op", compare=False), False),
        (Result("tiny", "remat.region forward, per op, with grad", compare=False), True),
    ]
    def region(x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            return _many_ops(x)

    for result, grad in rows:
        x = tiny_input(device).requires_grad_(grad)
        plain_times: list[float] = []
        for r in range(repeats):
            progress(f"tiny: replay overhead, repeat {r + 1}/{repeats}")
            pair = []
            for fn in (_many_ops, region):
                fn(x)  # warm-up
                _sync({device})
                best = math.inf
                for _ in range(3):
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(x)
                    _sync({device})
                    best = min(best, (time.perf_counter() - start) / calls)
                pair.append(best)
            plain_times.append(pair[0])
            result.step_seconds.append((pair[1] - pair[0]) / REPLAY_OPS)
        plain = format_seconds(statistics.median(plain_times) / REPLAY_OPS)
        result.note = f"overhead per recorded op (§5.2 target ≤ 5 µs); an op itself takes {plain}"
    return [result for result, _ in rows]


_STARTUP = """
import time, torch
t0 = time.perf_counter()
import remat
t1 = time.perf_counter()
x = torch.randn(16, requires_grad=True)
f = remat.remat(lambda t: (t * 2).sin())
t2 = time.perf_counter()
f(x).sum().backward()
t3 = time.perf_counter()
print(t1 - t0, t3 - t2)
"""


def _bench_startup(progress: Callable[[str], None]) -> list[Result]:
    """Cost of ``import remat`` after ``import torch``, and of the first @remat call (spec §5.6), in a fresh process."""
    import os
    import subprocess
    from pathlib import Path

    progress("startup: import remat and first call in a fresh process")
    imported = Result("startup", "import remat (after torch)", compare=False)
    first = Result("startup", "first @remat call, forward+backward", compare=False)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    # Measured as installed packages run: from cached bytecode. The first run writes it (an environment with
    # PYTHONDONTWRITEBYTECODE would otherwise compile every module on every import); the median of three after.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        for run in range(4):
            done = subprocess.run(
                [sys.executable, "-c", _STARTUP], capture_output=True, text=True, env=env, timeout=300, check=True
            )
            import_s, first_s = (float(v) for v in done.stdout.split()[-2:])
            if run:
                imported.step_seconds.append(import_s)
                first.step_seconds.append(first_s)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        imported.note = first.note = f"failed: {_note(e)}"
        return [imported, first]
    imported.note = "§5.6 target ≤ 50 ms (cached bytecode)"
    first.note = "§5.6: no one-off second of set-up"
    return [imported, first]


def run(
    models: Sequence[str] = ("gpt", "convnet", "chain", "tiny"),
    *,
    size: str = "small",
    device: str | torch.device = "cpu",
    repeats: int = 3,
    progress: Callable[[str], None] = lambda message: None,
    startup: bool | None = None,
) -> tuple[dict[str, Any], list[Result]]:
    """Run the benchmark and return its metadata and rows (what ``python -m remat`` prints).

    Args:
        models: Any of ``"gpt"``, ``"convnet"``, ``"chain"``, ``"tiny"``.
        size: ``"small"`` (a quick CPU run) or ``"medium"`` (the sizes of spec §5).
        device: Where to run.
        repeats: Timed steps per configuration; the median is reported.
        progress: Called with a status message as the run goes.
        startup: Also time ``import remat`` and a first call in a fresh process; by default
            when ``"tiny"`` is among ``models``.

    Returns:
        ``(meta, rows)``.

    Example:
        >>> from remat.bench.cli import run
        >>> meta, rows = run(["tiny"], repeats=1, startup=False)
        >>> rows[0].config, rows[0].step is not None
        ('no remat', True)
    """
    dev = torch.device(device)
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "size": size,
        "repeats": repeats,
        "models": {},
    }
    rows: list[Result] = []
    for name in models:
        if name == "tiny":
            meta["models"]["tiny"] = (
                f"(x * 2).sin() on 16 floats, step = forward+backward per call; region overhead on {REPLAY_OPS} ops"
            )
            rows += _bench_tiny(dev, repeats, CONFIGS, progress)
            rows += _bench_replay(dev, repeats, progress)
            continue
        if name == "chain":
            description, summary, chain_rows = _bench_chain(ChainNet(CHAIN_SIZES[size]), dev, repeats, progress)
            meta["models"]["chain"] = description
            meta["chain"] = summary
            rows += chain_rows
            continue
        base = MODELS[name](size)
        meta["models"][name] = f"{base.describe()} ({human_count(parameter_count(base))} parameters, float32)"
        rows += _bench_model(name, base, dev, repeats, CONFIGS, progress)
    if startup or (startup is None and "tiny" in models):
        meta["models"]["startup"] = "a fresh process: import remat after torch, first call of a @remat function"
        rows += _bench_startup(progress)
    return meta, rows


# -- output --------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def format_table(meta: dict[str, Any], rows: Sequence[Result]) -> str:
    """Render the benchmark as one aligned table with its header."""
    plural = "" if meta["threads"] == 1 else "s"
    repeats_plural = "" if meta["repeats"] == 1 else "s"
    lines = [
        f"remat benchmark · {meta['date']} · {meta['device']}, {meta['threads']} thread{plural} · "
        f"torch {meta['torch']} · size {meta['size']} · median of {meta['repeats']} repeat{repeats_plural}",
        *(f"  {name}: {text}" for name, text in meta["models"].items()),
        "  peak: highest live tensor bytes a training step adds beyond parameters and gradients;",
        "  held: bytes kept for backward at the end of forward (both counted by remat.track)",
        "",
    ]
    head = (
        "model",
        "configuration",
        "peak",
        "held",
        "step",
        "peak/none",
        "peak/torch",
        "time/none",
        "time/torch",
        "max|Δgrad|",
        "note",
    )
    table: list[tuple[str, ...]] = [head]
    by_key = {(r.model, r.config): r for r in rows}
    for r in rows:
        none, theirs = by_key.get((r.model, NO_REMAT)), by_key.get((r.model, TORCH))
        if not r.compare:
            none = theirs = None
        table.append(
            (
                r.model,
                r.config,
                "-" if r.peak_bytes is None else format_bytes(r.peak_bytes),
                "-" if r.held_bytes is None else format_bytes(r.held_bytes),
                format_seconds(r.step),
                _ratio(r.peak_bytes, none.peak_bytes if none else None),
                _ratio(r.peak_bytes, theirs.peak_bytes if theirs else None),
                _ratio(r.step, none.step if none else None),
                _ratio(r.step, theirs.step if theirs else None),
                "-" if r.grad_diff is None else f"{r.grad_diff:.1e}",
                r.note,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        cells = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row[:-1], widths, strict=False))]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
        if i == 0:
            lines.append("-" * len(lines[-1]))
    noisy = [r for r in rows if r.compare and len(r.step_seconds) > 1 and max(r.step_seconds) > 2 * min(r.step_seconds)]
    if noisy:
        worst = max(noisy, key=lambda r: max(r.step_seconds) / min(r.step_seconds))
        rows_text = f"{len(noisy)} row{'s' if len(noisy) > 1 else ''}"
        lines += [
            "",
            f"warning: the step times of {rows_text} varied more than 2x between repeats (worst: "
            f"{worst.model} {worst.config}, {format_seconds(min(worst.step_seconds))} to "
            f"{format_seconds(max(worst.step_seconds))}).",
            "  The machine was busy: time ratios may mislead. Try --threads 1 (no stalls of OpenMP threads "
            "waiting for each other) or more --repeats.",
        ]
    return "\n".join(lines)


def plot(meta: dict[str, Any], rows: Sequence[Result], path: str) -> None:
    """Save a PNG of peak memory against step time, one panel per model (needs matplotlib)."""
    matplotlib: Any = importlib.import_module("matplotlib")  # optional, untyped here
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")

    models = [m for m in meta["models"] if m != "tiny"]
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(6 * max(len(models), 1), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        for r in rows:
            if r.model != model or r.step is None or r.peak_bytes is None:
                continue
            ax.scatter(r.step * 1e3, r.peak_bytes / 2**20)
            ax.annotate(r.config, (r.step * 1e3, r.peak_bytes / 2**20), fontsize=8)
        ax.set_title(f"{model}: {meta['models'][model]}", fontsize=8)
        ax.set_xlabel("step time (ms)")
        ax.set_ylabel("peak live tensor memory (MiB)")
    fig.suptitle(f"remat benchmark, {meta['device']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOT_MISSING = (
    "remat: --plot needs matplotlib, which is not installed; install it with "
    "`pip install matplotlib` (or `pip install 'remat[plot]'`), or leave out --plot."
)


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    """Run ``python -m remat`` with command-line arguments ``argv``; return the exit status."""
    import argparse

    out = stdout or sys.stdout
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["estimate"]:  # python -m remat estimate: remat.estimate's table (bench/estimate.py)
        from .estimate import main as estimate_main

        return estimate_main(argv[1:], out)
    parser = argparse.ArgumentParser(
        prog="python -m remat",
        description="Benchmark activation checkpointing: remat against torch.utils.checkpoint and no remat.",
    )
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu)")
    parser.add_argument(
        "--model",
        choices=["gpt", "convnet", "chain", "tiny", "estimate", "all"],
        default="all",
        help="what to run (default: all); chain: remat.chain at 50%% of a convnet chain's activation memory "
        "against checkpoint_sequential (spec §5.5); tiny: per-call overhead, replay overhead and start-up; "
        "estimate: remat.estimate against real steps (spec §5.8; `python -m remat estimate --help` for its own table)",
    )
    parser.add_argument(
        "--size",
        choices=["small", "medium"],
        default="small",
        help="small (default): a quick CPU run; medium: GPT of 12 blocks, d=512, seq 256, batch 8 and a 64px ResNet",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (median shown)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG of memory vs step time (matplotlib)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(PLOT_MISSING, file=sys.stderr)
        return 2
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        print(f"remat: cannot use --device {args.device}: {_note(e)}", file=sys.stderr)
        return 2
    models = ["gpt", "convnet", "chain", "tiny"] if args.model == "all" else [args.model]
    progress = _Progress(sys.stderr, args.quiet)
    if args.model == "estimate":
        from .estimate import compare_main

        return compare_main(out, progress)
    meta, rows = run(models, size=args.size, device=device, repeats=args.repeats, progress=progress)
    progress.done()
    print(format_table(meta, rows), file=out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "rows": [r.to_dict() for r in rows]}, f, indent=2)
    if args.plot:
        plot(meta, rows, args.plot)
    return 0
