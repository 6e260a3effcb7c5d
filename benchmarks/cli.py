"""The benchmark behind ``python -m benchmarks`` (run from the repository's root).

For each model, every configuration runs on its own copy of the same weights and the same batch:
one warm-up step, one step under `remat.track` for memory and gradients, then ``repeats`` timed
steps, interleaved across configurations (``a b c a b c ...``) so that a machine's drift affects
them alike; the step time shown is the median. The tiny-function rows measure the per-call
overhead the same way.

NOTE [ What the memory columns count ]
Parameters and their ``.grad`` exist before the tracked step (the gradients are zero-filled
first, as after a step of ``zero_grad(set_to_none=False)``), so they are not counted: "peak" is
the highest number of live tensor bytes the step adds (activations, remat's saved inputs,
temporaries, incoming gradients), and "held" is what is still alive at the end of forward, minus
the loss itself (see NOTE [ Held for backward ] in remat/_measure/measure.py).

Configurations live in a registry (`register`), so rows such as ``save_matmuls`` or
``remat.chain`` plug in without touching the runner.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch

from remat._demo import human_count, parameter_count
from tests.models import CHAIN_SIZES, ChainNet

from .chain import bench_chain
from .configs import CONFIGS, NO_REMAT, TORCH, Config, register
from .runner import MODELS, STEPS_PER_REPEAT, Progress, Result, bench_model, bench_tiny, note
from .table import PLOT_MISSING, format_table, plot
from .targets import check_targets, format_checks
from .tiny import REPLAY_OPS, bench_replay, bench_startup

__all__ = ["CONFIGS", "NO_REMAT", "TORCH", "Config", "Result", "format_table", "main", "plot", "register", "run"]


def run(
    models: Sequence[str] = ("gpt", "convnet", "chain", "tiny"),
    *,
    size: str = "small",
    device: str | torch.device = "cpu",
    repeats: int = 3,
    progress: Callable[[str], None] = lambda message: None,
    startup: bool | None = None,
    profile: bool = True,
    trace: str | None = None,
) -> tuple[dict[str, Any], list[Result]]:
    """Run the benchmark and return its metadata and rows (what ``python -m benchmarks`` prints).

    Args:
        models: Any of ``"gpt"``, ``"convnet"``, ``"chain"``, ``"tiny"``, ``"offload"`` (an accelerator only).
        size: ``"small"`` (a quick CPU run) or ``"medium"`` (the larger sizes: GPT of 12 blocks, d=512).
        device: Where to run.
        repeats: Timed steps per configuration; the median is reported.
        progress: Called with a status message as the run goes.
        startup: Also time ``import remat`` and a first call in a fresh process; by default
            when ``"tiny"`` is among ``models``.
        profile: For ``"offload"``: one more step per row under ``torch.profiler``, summarized.
        trace: For ``"offload"``: a folder for each profiled step's Chrome trace.

    Returns:
        ``(meta, rows)``.

    Example:
        >>> from benchmarks.cli import run
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
        if name == "offload":  # its own rows and model (benchmarks/offload.py)
            from .offload import bench_offload

            meta["models"]["offload"], found = bench_offload(dev, repeats, progress, profile=profile, trace=trace)
            rows += [Result("offload", **{k: v for k, v in row.items() if k != "host_bytes"}) for row in found]
            continue
        if name == "tiny":
            meta["models"]["tiny"] = (
                f"(x * 2).sin() on 16 floats, step = forward+backward per call; region overhead on {REPLAY_OPS} ops"
            )
            rows += bench_tiny(dev, repeats, CONFIGS, progress)
            rows += bench_replay(dev, repeats, progress)
            continue
        if name == "chain":
            description, summary, chain_rows = bench_chain(ChainNet(CHAIN_SIZES[size]), dev, repeats, progress)
            meta["models"]["chain"] = description
            meta["chain"] = summary
            rows += chain_rows
            continue
        base = MODELS[name](size)
        meta["models"][name] = f"{base.describe()} ({human_count(parameter_count(base))} parameters, float32)"
        rows += bench_model(name, base, dev, repeats, CONFIGS, progress)
    if startup or (startup is None and "tiny" in models):
        meta["models"]["startup"] = "a fresh process: import remat after torch, first call of a @remat function"
        rows += bench_startup(progress)
    return meta, rows


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    """Run ``python -m benchmarks`` with command-line arguments ``argv``; return the exit status."""
    import argparse

    out = stdout or sys.stdout
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark activation checkpointing: remat against torch.utils.checkpoint and no remat.",
    )
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu)")
    parser.add_argument(
        "--model",
        choices=["gpt", "convnet", "chain", "tiny", "offload", "budget", "compile", "estimate", "head", "long", "gpu",
                 "all"],
        default="all",
        help="what to run (default: all); chain: remat.chain at 50%% of a convnet chain's activation memory "
        "against checkpoint_sequential; tiny: per-call overhead, replay overhead and start-up; "
        "offload: offloading to host memory on the GPT-like stack (needs --device cuda); "
        "budget: remat.apply(model, budget=...) against uniform configurations and torch.compile; "
        "compile: every remat site kind and budgets 0.3-0.8 under torch.compile (inductor, blocks compiled one by "
        "one), each row in its own process, against torch's checkpoint and compile's own budget (`python -m "
        "benchmarks.compile_sites --help`: --whole compiles the model as one graph); "
        "estimate: remat.estimate against real steps (`python -m remat estimate --help` estimates a model of "
        "your own); head: remat.apply(model, head=True) on a GPT-2 with the real vocabulary against full remat "
        "(`python -m benchmarks.head --help`: --sweep times the chunk sizes); long: bytes and step time per token "
        "at long sequences on a Llama-shaped stand-in, full remat with the head, tiles and per-block offload "
        "against transformers' own checkpointing (`python -m benchmarks.long --help`; one thread, about an hour on "
        "two cores); gpu: the memory promises at real sizes under bf16 autocast, one table (GPT-2 124M and a 1.1B "
        "Llama with --device cuda; tiny sizes on the CPU)",
    )
    parser.add_argument(
        "--size",
        choices=["small", "medium"],
        default="small",
        help="small (default): a quick CPU run; medium: GPT of 12 blocks, d=512, seq 256, batch 8 and a 64px ResNet",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats per configuration, each "
                        f"the fastest of {STEPS_PER_REPEAT} consecutive steps (median shown)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG of memory vs step time (matplotlib)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    parser.add_argument("--check", action="store_true", help="for remat's developers: exit with status 1 when a "
                        "target does not hold in this run (a row that fails exits with status 1 in any case)")
    parser.add_argument("--quick", action="store_true", help="with --model budget: a two-model subset of the sweep")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="with --model offload: no "
                        "step under torch.profiler after the timed ones (by default one per row, summarized)")
    parser.add_argument("--trace", metavar="DIR", help="with --model offload: also write each profiled step's "
                        "Chrome trace to DIR/offload-<row>.json")
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
        print(f"remat: cannot use --device {args.device}: {note(e)}", file=sys.stderr)
        return 2
    models = ["gpt", "convnet", "chain", "tiny"] if args.model == "all" else [args.model]
    progress = Progress(sys.stderr, args.quiet)
    if args.model == "budget":  # its own table: see benchmarks/budget.py
        from . import budget

        return budget.main(args.size, args.repeats, args.plot, progress, out, quick=args.quick)
    if args.model == "compile":  # its own table: see benchmarks/compile_sites.py
        from . import compile_sites

        argv = ["--threads", str(args.threads or 1), "--fractions", "0.3,0.4,0.5,0.6,0.7,0.8"]
        return compile_sites.main(argv, out)
    if args.model == "head":  # its own table: see benchmarks/head.py (needs the `hf` extra)
        from . import head

        return head.main(["--repeats", str(args.repeats), *(["--check"] if args.check else [])], out)
    if args.model == "long":  # its own table: see benchmarks/long.py (needs the `hf` extra)
        from . import long

        threads = ["--threads", str(args.threads)] if args.threads else []
        status = long.main(["--repeats", str(args.repeats), *threads, *(["--check"] if args.check else [])], out,
                           progress)
        progress.done()
        return status
    if args.model == "estimate":
        from .estimate import compare_main

        return compare_main(out, progress)
    if args.model == "gpu":  # its own table: see benchmarks/gpu_check.py
        from .gpu_check import main as gpu_main

        status = gpu_main(device, out, progress)
        progress.done()
        return status
    meta, rows = run(models, size=args.size, device=device, repeats=args.repeats, progress=progress,
                     profile=args.profile, trace=args.trace)  # fmt: skip
    progress.done()
    print(format_table(meta, rows), file=out)
    offloads = [row for row in rows if row.model == "offload"]
    if offloads:
        from .offload import format_offload

        section = format_offload([row.to_dict() for row in offloads])
        if section:
            print("\n" + section, file=out)
    checks = check_targets(rows, meta.get("chain"))
    if checks:
        print("\n" + format_checks(checks), file=out)
    failed = [row for row in rows if row.error]
    if failed:
        print(f"\n{len(failed)} row(s) failed:", file=out)
        for row in failed:
            print(f"  {row.model}: {row.config}: {row.error}", file=out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            data = {"meta": meta, "rows": [r.to_dict() for r in rows], "targets": [c.to_dict() for c in checks]}
            json.dump(data, f, indent=2)
    if args.plot:
        plot(meta, rows, args.plot)
    return 1 if failed or (args.check and not all(check.ok for check in checks)) else 0
