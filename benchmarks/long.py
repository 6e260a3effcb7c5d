"""`python -m benchmarks --model long` (or `python -m benchmarks.long`): long sequences, bytes and time per token.

A Llama-shaped stand-in (d=256, MLP 896, 8 layers, 8 heads / 4 KV heads, vocabulary 8,016: the proportions of Llama 3
8B scaled down; float32, batch 1, SDPA attention) trains one step per configuration, each on its own copy of the
same weights:

* transformers' own checkpointing (`gradient_checkpointing_enable`, non-reentrant);
* `remat.apply(model)`, full remat of every decoder layer;
* `remat.apply(model, head=True)`: the loss in chunks too (`remat.linear_cross_entropy`);
* the same with each layer's MLP and norms in tiles (`remat.tiled`, `TILES` tiles);
* the same on the device written in Python (tests/pydevice.py), and with per-block offload there
  (`offload=True`: each layer's input on the host), where host memory is not the device's. On that device
  attention runs the CPU's fused kernel (`pydevice.fused_attention()`), as a GPU runs its own.

Per row: activation bytes per token, the slope of the step's peak between `SEQS` (`remat.track`, above the step's
start, the gradients allocated by backward as after `zero_grad()`; on the Python device its bytes only); the peak at
the longer sequence; step time per token at the longer one, the median of `--repeats` steps taken in rounds across
the CPU rows, one thread (the Python device's steps are not timed: its ops run through a Python fallback); and
whether the gradients equal no remat's on a float64 copy (`GRAD_SEQ` tokens, the loss taken from the logits in
float64, as the model's own loss would upcast to float32).

The estimate check (`--no-estimate` skips it): for each remat configuration, `remat.estimate(..., memory=MEMORY,
seq_dim=1)`'s longest sequence `s`, then real steps whose peak under `remat.track()` (the answer a step under
`remat.track(limit=...)` gives) must stay within the memory less what lives before the step and less the headroom
the estimate left to the allocator (on the Python device, whose allocator caches as CUDA's does, 10% by default:
NOTE [ The allocator's reserve ]): `s` tokens must fit and 5% more must not, so the longest that fits is within 5%
of the estimate. Then `remat.apply(model, memory=M)` on the Python device at the longer sequence, with M between
the estimates of head + tiles and of per-block offload too, where only offload fits: the plan must take the head,
tiles and per-block offload itself, and its first three steps must allocate and reserve at most M on that device.

Targets (issue 54): head + tiles at most `TILES_TARGET` KiB per token, with per-block offload on the Python device at
most `OFFLOAD_TARGET`; the step at the longer sequence at most `STEP_TARGET` x transformers' checkpointing's; every
row's gradients equal no remat's; every estimate within 5%.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._core.units import format_bytes
from remat._sites.blocks import find_blocks
from remat._sites.tiles import tile_blocks

from .gpu_check import hf_checkpointing

__all__ = ["CONFIG", "ROWS", "SEQS", "TILES", "main", "measure"]

CONFIG = {"hidden_size": 256, "intermediate_size": 896, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 4, "vocab_size": 8016, "max_position_embeddings": 16384}
SEQS = (4096, 8192)
TILES = 8
GRAD_SEQ = 256
MEMORY = 256 * 2**20
"""The memory of the estimate check: the longest sequences land between a few hundred and ten thousand tokens."""
TILES_TARGET, OFFLOAD_TARGET, STEP_TARGET, ESTIMATE_TARGET = 21.0, 13.0, 1.15, 0.05
HF = "transformers' checkpointing"


@dataclasses.dataclass(frozen=True)
class Row:
    """A configuration: how to set it on a model, where it runs, whether it is timed, its estimate's name."""

    label: str
    configure: Callable[[nn.Module], object]
    device: str = "cpu"  # or "python": the device of tests/pydevice.py
    timed: bool = True
    estimate: str | None = None


def _tiled(offload: bool = False) -> Callable[[nn.Module], object]:
    def configure(model: nn.Module) -> None:
        remat.apply(model, head=True, offload=offload)
        tile_blocks(find_blocks(model), TILES)

    return configure


ROWS = (
    Row(HF, hf_checkpointing),
    Row("remat.apply(model)", remat.apply, estimate="full"),
    Row("remat.apply(model, head=True)", lambda model: remat.apply(model, head=True), estimate="full+head"),
    Row(f"  + tiles ({TILES})", _tiled(), estimate="full+head+tiles"),
    Row(f"  + tiles ({TILES}), Python device", _tiled(), device="python", timed=False),
    Row("  + per-block offload, Python device", _tiled(offload=True), device="python", timed=False,
        estimate="full+head+tiles+offload"),
)


# -- the device written in Python ---------------------------------------------------------------------------------


def _python_device() -> tuple[str, str]:
    """The device of tests/pydevice.py (registered once) and the attention that runs the CPU's fused kernel on it."""
    root = str(Path(__file__).resolve().parents[1] / "tests")
    if root not in sys.path:
        sys.path.insert(0, root)
    pydevice: Any = importlib.import_module("pydevice")
    pydevice.register()
    return f"{pydevice.NAME}:0", pydevice.fused_attention()


@contextlib.contextmanager
def _on(device: str) -> Iterator[None]:
    """Backward on the calling thread where the device needs it (tests/pydevice.py)."""
    if device == "cpu":
        yield
        return
    with torch.autograd.set_multithreading_enabled(False):
        yield


# -- steps ----------------------------------------------------------------------------------------------------


def build(row: Row, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, str]:
    """The stand-in from seed 0 under ``row``'s configuration, on its device; returns it and the device."""
    hf: Any = importlib.import_module("transformers")  # the `hf` extra
    device, attention = ("cpu", "sdpa") if row.device == "cpu" else _python_device()
    torch.manual_seed(0)
    model: nn.Module = hf.LlamaForCausalLM(hf.LlamaConfig(**CONFIG, attn_implementation=attention))
    model = model.to(dtype).to(device).train()
    row.configure(model)
    return model, device


def batch(seq: int, device: str) -> dict[str, Any]:
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def step(model: nn.Module, inputs: dict[str, Any]) -> None:
    for parameter in model.parameters():
        parameter.grad = None  # backward allocates them, as after `optimizer.zero_grad()`
    model(**inputs).loss.backward()


def peak(model: nn.Module, device: str, seq: int) -> int:
    """The step's peak above its start, on ``device`` (the Python device's own bytes there)."""
    inputs = batch(seq, device)
    with _on(device), remat.track() as tracker:
        step(model, inputs)
    return tracker.peak(device) if device != "cpu" else tracker.peak_bytes


# -- gradients ------------------------------------------------------------------------------------------------


def _grads(row: Row | None) -> dict[str, torch.Tensor]:
    """Float64 gradients at `GRAD_SEQ` tokens: no remat's (``row`` None) from the logits, a row's from its loss."""
    plain = Row("no remat", lambda model: None)
    model, device = build(row or plain, torch.float64)
    inputs = batch(GRAD_SEQ, device)
    for parameter in model.parameters():
        parameter.grad = None
    torch.manual_seed(1)
    with _on(device):
        if row is None:
            logits = model(input_ids=inputs["input_ids"], use_cache=False).logits
            ids = inputs["input_ids"]
            torch.autograd.backward(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
        else:
            model(**inputs).loss.backward()
    return {name: p.grad.detach().cpu() for name, p in model.named_parameters() if p.grad is not None}


def _equal(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> bool:
    if ours.keys() != reference.keys():
        return False
    try:
        for name, grad in reference.items():
            torch.testing.assert_close(ours[name], grad)
    except AssertionError:
        return False
    return True


# -- the estimate check ---------------------------------------------------------------------------------------


def _fits(row: Row, seq: int, memory: int) -> bool:
    """Whether a real step of ``row`` at ``seq`` tokens stays within ``memory`` (what lives before it included).

    Read as the step's peak under `remat.track()` against the memory less what lives before the step: the same
    answer as running it under `remat.track(limit=...)` (which raises at the first op that would take the bytes it
    counts past the limit), without raising. On the Python-written device an out-of-memory error raised inside a
    tile's backward aborts the process (C++ `terminate`), which the CPU does not do; see docs/guides/long-sequences.md.
    """
    model, device = build(row)
    inputs = batch(seq, device)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # the labels are the ids: counted once
                for t in [*model.parameters(), *model.buffers(), inputs["input_ids"], inputs["labels"]]}
    resident = int(sum(storages.values()))
    with _on(device), remat.track() as tracker:
        step(model, inputs)
    peak: int = tracker.peak(device) if device != "cpu" else tracker.peak_bytes
    return peak <= memory - resident


def check_estimate(row: Row, memory: int = MEMORY) -> dict[str, Any]:
    """The estimate's longest sequence for ``row`` and whether the real longest is within 5% of it."""
    assert row.estimate is not None
    plain = Row(row.label, lambda model: None, row.device)
    model, device = build(plain)
    start = time.perf_counter()
    with _on(device):
        report = remat.estimate(model, batch(1024, device), configs=(row.estimate,), memory=memory, seq_dim=1,
                                device=device)
    seconds = time.perf_counter() - start
    longest = report[row.estimate].largest_seq
    room = report.headroom  # what the estimate left to a caching allocator (the Python device's): not tensors' bytes
    del model
    if not longest:
        return {"estimate": longest, "seconds": seconds, "headroom": room, "ok": False}
    fits = _fits(row, longest, memory - room)
    over = _fits(row, math.ceil(longest * (1 + ESTIMATE_TARGET)), memory - room)
    return {"estimate": longest, "seconds": seconds, "headroom": room, "fits": fits, "over_fits": over,
            "ok": fits and not over}


def check_memory_plan(seq: int) -> dict[str, Any]:
    """`remat.apply(model, memory=M)` on the Python device at ``seq`` tokens, with M between what full remat with the
    head and tiles needs and what per-block offload too needs (their estimates, a tenth of M left to the allocator as
    the plan leaves it: NOTE [ The allocator's reserve ]), where only offload fits: what the plan chose, and the
    allocated and reserved peaks of its first three steps (gradients set to None before each) against M."""
    plain = Row("memory plan", lambda model: None, "python")
    model, device = build(plain)
    pydevice: Any = importlib.import_module("pydevice")
    inputs = batch(seq, device)
    configs = (ROWS[3].estimate or "", ROWS[5].estimate or "")
    with _on(device):
        report = remat.estimate(model, inputs, configs=configs, device=device)
    tiled, offloaded = (report[config].peak_bytes for config in configs)
    memory = int((offloaded + 0.85 * (tiled - offloaded)) / 0.9)
    start = time.perf_counter()
    with _on(device):
        remat.apply(model, memory=memory, sample=inputs)
        seconds = time.perf_counter() - start
        pydevice.DEVICE.reset_peak_memory_stats(0)
        for _ in range(3):
            step(model, inputs)
    plan = remat.plan(model)
    chosen = sorted({site.choice for site in plan.sites})
    allocated, reserved = pydevice.DEVICE.max_memory_allocated(0), pydevice.DEVICE.max_memory_reserved(0)
    del model
    return {"seq": seq, "memory": memory, "needs": {"tiles": tiled, "offload": offloaded}, "seconds": seconds,
            "choices": chosen, "tiled": len(plan.tiles), "head": plan.head is not None, "allocated": allocated,
            "reserved": reserved,
            "ok": allocated <= memory and reserved <= memory and chosen == ["full + offload"] and bool(plan.tiles)}


# -- the table ------------------------------------------------------------------------------------------------


def measure(repeats: int = 3, seqs: Sequence[int] = SEQS, estimate: bool = True,
            progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Every row's bytes per token, peak, step time and gradient check; the estimate check (see the docstring)."""
    results: dict[str, dict[str, Any]] = {}
    timed: dict[str, nn.Module] = {}
    low, high = seqs
    for row in ROWS:
        progress(f"{row.label.strip()}: peaks at {low} and {high} tokens")
        model, device = build(row)
        peaks = [peak(model, device, seq) for seq in (low, high)]
        results[row.label] = {"device": device, "peaks": peaks, "seconds": [],
                              "kib_per_token": (peaks[1] - peaks[0]) / (high - low) / 1024}
        if row.timed:
            timed[row.label] = model
        else:
            del model
    long_batch = batch(high, "cpu")
    for round_ in range(repeats):
        for label, model in timed.items():
            progress(f"{label.strip()}: step {round_ + 1} of {repeats} at {high} tokens")
            start = time.perf_counter()
            step(model, long_batch)
            results[label]["seconds"].append(time.perf_counter() - start)
    timed.clear()
    progress("gradients (float64)")
    reference = _grads(None)
    for row in ROWS:
        results[row.label]["grads_equal"] = _equal(_grads(row), reference)
    checks: dict[str, Any] = {}
    if estimate:
        for row in ROWS:
            if row.estimate is not None:
                progress(f"{row.label.strip()}: estimate check")
                checks[row.label] = check_estimate(row)
    plan: dict[str, Any] | None = None
    if estimate:
        progress("apply(memory=...) on the Python device")
        plan = check_memory_plan(high)
    for found in results.values():
        found["step_seconds"] = statistics.median(found["seconds"]) if found["seconds"] else None
    return {"seqs": list(seqs), "threads": torch.get_num_threads(), "rows": results, "estimates": checks,
            "memory": MEMORY, "memory_plan": plan}


def format_result(result: dict[str, Any]) -> str:
    low, high = result["seqs"]
    rows = result["rows"]
    hf = rows[HF]
    lines = [
        f"Llama-shaped stand-in (d=256, MLP 896, 8 layers, 8/4 heads, vocabulary 8,016), float32, batch 1, SDPA; "
        f"bytes per token: slope of remat.track's peak between {low:,} and {high:,} tokens; step: median at "
        f"{high:,} tokens, {result['threads']} thread(s); gradients: float64 at {GRAD_SEQ} tokens, against no remat",
        f"{'configuration':40s} {'KiB/token':>10s} {'peak':>11s} {'us/token':>9s} {'vs HF':>6s}  gradients equal",
    ]
    for label, row in rows.items():
        seconds = row["step_seconds"]
        per_token = f"{seconds / high * 1e6:8.1f}" if seconds else "       -"
        ratio = f"{seconds / hf['step_seconds']:5.2f}x" if seconds and hf["step_seconds"] else "     -"
        lines.append(f"{label:40s} {row['kib_per_token']:10.1f} {format_bytes(row['peaks'][1]):>11s} "
                     f"{per_token} {ratio}  {'yes' if row['grads_equal'] else 'NO'}")
    tiles = rows[ROWS[3].label]
    offload = rows[ROWS[5].label]
    step_ratio = tiles["step_seconds"] / hf["step_seconds"] if tiles["step_seconds"] and hf["step_seconds"] else None
    lines += [
        "",
        f"target: head + tiles <= {TILES_TARGET} KiB/token: {tiles['kib_per_token']:.1f} "
        f"{_verdict(tiles['kib_per_token'] <= TILES_TARGET)}",
        f"target: + per-block offload (Python device) <= {OFFLOAD_TARGET} KiB/token: {offload['kib_per_token']:.1f} "
        f"{_verdict(offload['kib_per_token'] <= OFFLOAD_TARGET)}",
    ]
    if step_ratio is not None:
        lines.append(f"target: head + tiles' step at {high:,} tokens <= {STEP_TARGET}x transformers' checkpointing's: "
                     f"{step_ratio:.2f}x {_verdict(step_ratio <= STEP_TARGET)}")
    lines.append(f"target: gradients equal no remat's (float64): "
                 f"{_verdict(all(row['grads_equal'] for row in rows.values()))}")
    for label, check in result["estimates"].items():
        if "fits" in check:
            room = (f", {format_bytes(check['headroom'])} of it left to the allocator, so the real steps run in the "
                    "rest" if check["headroom"] else "")
            fits = "yes" if check["fits"] else "NO"
            what = (f"estimate's longest sequence in {format_bytes(result['memory'])}{room}: {check['estimate']:,} "
                    f"tokens (in {check['seconds']:.1f} s); a real step there fits: {fits}, "
                    f"5% longer fits: {'yes' if check['over_fits'] else 'no'}")
        else:
            what = f"estimate found no sequence that fits ({check['estimate']})"
        lines.append(f"target: {label.strip()}: {what} {_verdict(check['ok'])}")
    plan = result.get("memory_plan")
    if plan is not None:
        needs = plan["needs"]
        lines.append(
            f"target: apply(memory={format_bytes(plan['memory'])}) at {plan['seq']:,} tokens, Python device (head and "
            f"tiles need {format_bytes(needs['tiles'])}, with offload {format_bytes(needs['offload'])}): planned in "
            f"{plan['seconds']:.0f} s with {', '.join(plan['choices'])}, "
            f"{plan['tiled']} modules in tiles, {'the head in chunks' if plan['head'] else 'the own head'}; three "
            f"steps allocated {format_bytes(plan['allocated'])}, reserved {format_bytes(plan['reserved'])} "
            f"{_verdict(plan['ok'])}")
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def targets_hold(result: dict[str, Any]) -> bool:
    rows = result["rows"]
    tiles, offload, hf = rows[ROWS[3].label], rows[ROWS[5].label], rows[HF]
    timed = tiles["step_seconds"] is None or tiles["step_seconds"] <= STEP_TARGET * hf["step_seconds"]
    return bool(tiles["kib_per_token"] <= TILES_TARGET and offload["kib_per_token"] <= OFFLOAD_TARGET and timed
                and all(row["grads_equal"] for row in rows.values())
                and all(check["ok"] for check in result["estimates"].values())
                and (result.get("memory_plan") or {}).get("ok", True))


def main(argv: Sequence[str] | None = None, out: TextIO | None = None,
         progress: Callable[[str], None] = lambda message: None) -> int:
    """Print the table; exit status 1 where `--check` is given and a target does not hold."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per CPU configuration (median shown)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)), help="the two sequence lengths of the slope")
    parser.add_argument("--no-estimate", dest="estimate", action="store_false", help="skip the estimate check")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target does not hold")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    low, high = (int(part) for part in args.seqs.split(","))
    result = measure(args.repeats, (low, high), args.estimate, progress)
    print(format_result(result), file=out or sys.stdout)
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 1 if args.check and not targets_hold(result) else 0


if __name__ == "__main__":
    raise SystemExit(main(progress=lambda message: print(message, file=sys.stderr)))
