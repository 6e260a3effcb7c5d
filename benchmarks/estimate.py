"""`python -m remat estimate` and `python -m benchmarks --model estimate`.

``python -m remat estimate`` prints `remat.estimate`'s table for a benchmark model or a Hugging Face config built
on the meta device (``--hf llama`` with no size flags is the 7B Llama). ``python -m benchmarks --model estimate``
checks the predictions: for every configuration of the benchmark's GPT-like stack and convnet and of tiny GPT-2
and Llama configs, the predicted peak and activation bytes next to those of a real CPU step of the same model,
counted with `remat.track` (NOTE [ What a real step counts ]), and their ratio.

NOTE [ What a real step counts ]
The real step is the one `remat.estimate` predicts (NOTE [ What an estimate runs ] in remat/_plan/estimate.py):
a warm-up optimizer step on zero gradients makes the optimizer's state, then one tracked step runs forward,
the loss, backward, the optimizer step and ``zero_grad``. The bytes alive before it (parameters, buffers, the
batch, the optimizer's state) are counted from their storages, and the tracker adds the step's own peak.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._estimate import DEFAULT_CONFIGS, is_budget
from remat._format import format_bytes
from remat._measure.loss import call as _call
from remat._measure.loss import default_loss
from remat._torch_compat import tree_leaves

from .convnets import CONVNET_SIZES, ConvNet, ConvNetConfig
from .models import GPT, GPT_SIZES, GPTConfig, human_count, parameter_count

__all__ = ["Case", "Checked", "bench_case", "check", "hf_case", "main", "measure_step", "run_checks"]

SEED = 1234
CONFIGS: tuple[Any, ...] = ("none", "full", "save_matmuls")
BUDGET = 0.6
"""The budget configuration `--model estimate` checks on the benchmark's models (a fraction of no remat's peak).

The real step plans on its own profile, whose times differ from the fake one's, so the two plans may pick
different blocks; both fit the budget, and their peaks agree within the target."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HF_KINDS = ("llama", "gpt2", "t5", "bert")


@dataclass
class Case:
    """A model, a batch and the loss of one training step."""

    name: str
    model: nn.Module
    sample: Any
    loss: Callable[[Any], torch.Tensor] | None = None
    where: Any = None


def bench_case(name: str, size: str = "small", *, device: str = "cpu", seed: int = SEED,
               config: GPTConfig | ConvNetConfig | None = None) -> Case:
    """The benchmark's GPT-like stack or convnet (``name`` "gpt" or "convnet"), on ``device`` ("meta" allowed)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model: GPT | ConvNet = (
            GPT(config if isinstance(config, GPTConfig) else GPT_SIZES[size]) if name == "gpt"
            else ConvNet(config if isinstance(config, ConvNetConfig) else CONVNET_SIZES[size])
        )
    first, target = model.sample(torch.device("cpu"), seed=seed)
    flat = 1 if name == "gpt" else None

    def loss(out: torch.Tensor) -> torch.Tensor:
        if flat is None:
            return F.cross_entropy(out, target)
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    return Case(f"{name} ({model.describe()})", model, (first,), loss)


# kind -> (config class, model class, a tiny config, names of (layers, hidden size, heads) in the config)
_HF: dict[str, tuple[str, str, dict[str, Any], tuple[str, str, tuple[str, ...]]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 4},
              ("num_hidden_layers", "hidden_size", ("num_attention_heads", "num_key_value_heads"))),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_layer": 4, "n_head": 4},
             ("n_layer", "n_embd", ("n_head",))),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           {"d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 2, "num_heads": 4},
           ("num_layers", "d_model", ("num_heads",))),
    "bert": ("BertConfig", "BertForMaskedLM",
             {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4},
             ("num_hidden_layers", "hidden_size", ("num_attention_heads",))),
}


def hf_case(kind: str, *, layers: int | None = None, hidden: int | None = None, heads: int | None = None,
            seq: int = 2048, batch: int = 1, dtype: torch.dtype = torch.float32, device: str = "meta",
            tiny: bool = False, seed: int = SEED) -> Case:
    """A transformers model (``kind`` in `HF_KINDS`) from its config's defaults, the flags overriding them.

    ``tiny`` starts from a config of a few layers of width 64 instead of the defaults (for real runs).
    """
    import transformers as tf

    if kind not in _HF:
        raise ValueError(f"remat: --hf must be one of {', '.join(HF_KINDS)}, but got {kind!r}.")
    config_name, model_name, small, names = _HF[kind]
    vocab = 512 if tiny else None
    config: Any = getattr(tf, config_name)(**(small if tiny else {}))
    build: Any = getattr(tf, model_name)
    if vocab is not None:
        config.vocab_size = vocab
    for value, name in zip((layers, hidden), names[:2], strict=True):
        if value is not None:
            setattr(config, name, value)
    if heads is not None:
        for name in names[2]:
            setattr(config, name, heads)
    if kind == "t5":
        if layers is not None:
            config.num_decoder_layers = layers
        if getattr(config, "decoder_start_token_id", None) is None:  # T5Config() leaves it to the checkpoints
            config.decoder_start_token_id = config.pad_token_id or 0
    for name in ("n_positions", "max_position_embeddings"):  # room for --seq
        if getattr(config, name, None) is not None and getattr(config, name) < seq:
            setattr(config, name, seq)
    torch.manual_seed(seed)
    with torch.device(device):
        model = build(config).to(dtype)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    sample: dict[str, Any] = {"input_ids": ids, "labels": ids}
    if kind != "bert":
        sample["use_cache"] = False
    size = f"{config.num_hidden_layers if kind != 't5' else config.num_layers} layers"
    name = f"{build.__name__} ({size}, {human_count(parameter_count(model))} parameters, {str(dtype)[6:]}, " \
           f"batch {batch}, seq {seq})"
    return Case(name, model, sample)


# -- a real step ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """Bytes of a real training step (NOTE [ What a real step counts ])."""

    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    peak_bytes: int


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _optimizer(kind: str | None, params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    trainable = [p for p in params if p.requires_grad]
    if kind is None:
        return None
    if kind == "sgd":
        return torch.optim.SGD(trainable, lr=0.01, momentum=0.9)
    made: torch.optim.Optimizer = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](trainable)
    return made


def measure_step(case: Case, config: Any, optimizer: str | None = "adamw", seed: int = SEED) -> Measured:
    """Run one real training step of ``case`` under ``config`` ("none", "full", "save_matmuls", a policy, a budget).

    The model's weights change (the optimizer steps); its remat sites are removed afterwards.
    """
    model = case.model
    params = list(model.parameters())
    opt = _optimizer(optimizer, params)
    if opt is not None:
        for p in params:
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = [t for s in (opt.state.values() if opt else ()) for t in tree_leaves(s) if isinstance(t, torch.Tensor)]
    inputs = [t for t in tree_leaves(case.sample) if isinstance(t, torch.Tensor)]
    base = _storage_bytes([*params, *model.buffers(), *inputs, *state])
    if config == "none":
        switch = remat.enabled(False)
    elif is_budget(config):
        remat.apply(model, case.where, budget=config, sample=case.sample, loss=case.loss)
        switch = remat.enabled(True)
    else:
        policy = remat.policies.save_matmuls if config == "save_matmuls" else None if config == "full" else config
        remat.apply(model, case.where, policy=policy)
        switch = remat.enabled(True)
    try:
        torch.manual_seed(seed)
        with switch, remat.track() as t:
            out = _call(model, case.sample)
            value = case.loss(out) if case.loss is not None else default_loss(out)
            held = t.current_bytes - sum(t._bytes_of([value]).values())
            torch.autograd.backward(value)
            grads = _storage_bytes([p.grad for p in params if p.grad is not None])
            del out, value
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        remat.undo(model)
    return Measured(grads, _storage_bytes(state), held, base + t.peak_bytes)


# -- predicted against measured ----------------------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """One configuration of one model: predicted and measured bytes."""

    model: str
    config: str
    predicted: remat.ConfigEstimate
    measured: Measured

    @property
    def peak_ratio(self) -> float:
        """Predicted / measured peak."""
        return self.predicted.peak_bytes / self.measured.peak_bytes

    @property
    def activation_ratio(self) -> float:
        """Predicted / measured activation bytes."""
        return self.predicted.activation_bytes / max(self.measured.activation_bytes, 1)


def check(case: Case, build: Callable[[], Case], configs: Sequence[Any] = CONFIGS,
          optimizer: str | None = "adamw") -> list[Checked]:
    """Estimate ``case`` and measure each configuration on a fresh ``build()`` of the same model."""
    report = remat.estimate(case.model, case.sample, loss=case.loss, optimizer=optimizer, configs=configs,
                            where=case.where)
    rows = []
    for config in configs:
        measured = measure_step(build(), config, optimizer)
        rows.append(Checked(case.name, report[config].label, report[config], measured))
    return rows


BENCH_MODELS = ("gpt", "convnet")


def _cases() -> list[tuple[str, Callable[[], Case]]]:
    cases: list[tuple[str, Callable[[], Case]]] = [
        ("gpt", lambda: bench_case("gpt")),
        ("convnet", lambda: bench_case("convnet")),
    ]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return cases
    return [*cases,
            *((kind, lambda kind=kind: hf_case(kind, tiny=True, seq=64, batch=2, device="cpu")) for kind in HF_KINDS)]


def run_checks(progress: Callable[[str], None] = lambda message: None) -> list[Checked]:
    """Predicted against measured for every configuration of every model of ``--model estimate``."""
    rows: list[Checked] = []
    for name, build in _cases():
        progress(f"estimate: {name}")
        rows += check(build(), build, configs=(*CONFIGS, BUDGET) if name in BENCH_MODELS else CONFIGS)
    return rows


def format_checks(rows: Sequence[Checked]) -> str:
    """The table of ``python -m benchmarks --model estimate``."""
    fmt = format_bytes
    header = ("model", "config", "predicted peak", "measured peak", "ratio", "pred. activations",
              "meas. activations", "ratio")
    table = [header, *((r.model, r.config, fmt(r.predicted.peak_bytes), fmt(r.measured.peak_bytes),
                        f"{r.peak_ratio:.4f}", fmt(r.predicted.activation_bytes),
                        fmt(r.measured.activation_bytes), f"{r.activation_ratio:.4f}") for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["remat.estimate against a real CPU step (remat.track), AdamW, float32; target: ratios within "
             "0.95-1.05"]
    for row in table:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]),
                 *(c.rjust(w) for c, w in zip(row[2:], widths[2:], strict=True))]
        lines.append("  ".join(cells).rstrip())
    worst = max((abs(r.peak_ratio - 1) for r in rows), default=0.0)
    lines.append(f"worst peak ratio off by {worst:.2%}")
    return "\n".join(lines)


# -- python -m remat estimate --------------------------------------------------------------------


def main(argv: Sequence[str], stdout: TextIO | None = None) -> int:
    """Run ``python -m remat estimate`` with ``argv`` (after the word ``estimate``); return the exit status."""
    out = stdout or sys.stdout
    parser = argparse.ArgumentParser(
        prog="python -m remat estimate",
        description="Predict the memory of one training step per remat configuration, without allocating it "
        "(remat.estimate on fake tensors; models are built on the meta device).",
    )
    parser.add_argument("--hf", choices=HF_KINDS, help="a transformers config (its defaults; llama: 7B) instead "
                        "of the benchmark's models")
    parser.add_argument("--model", choices=["gpt", "convnet"], help="a benchmark model (default: both)")
    parser.add_argument("--size", choices=["small", "medium"], default="small", help="benchmark model size")
    parser.add_argument("--layers", type=int, help="number of layers (--hf)")
    parser.add_argument("--hidden", type=int, help="hidden size (--hf)")
    parser.add_argument("--heads", type=int, help="attention heads (--hf)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (--hf; default 2048)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (--hf; default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype (--hf)")
    parser.add_argument("--optimizer", choices=["none", "sgd", "adam", "adamw"], default="adamw",
                        help="optimizer step to include (default adamw)")
    parser.add_argument("--device", default="cpu", help="device to predict for (default cpu; cuda works "
                        "without a GPU: it predicts torch.cuda.max_memory_allocated)")
    parser.add_argument("--memory", help="device memory (e.g. 80GiB, --hf): also print the largest batch whose "
                        "step fits in it per configuration")
    parser.add_argument("--largest-seq", action="store_true", help="with --memory: also the largest sequence length")
    parser.add_argument("--json", metavar="PATH", help="also write the reports as JSON")
    parser.add_argument("--world-size", type=int, help="predict one rank of this many data-parallel ranks")
    parser.add_argument("--shard", choices=["fsdp2", "ddp"], help="with --world-size: fsdp2, as if fully_shard "
                        "were applied to each block and the root; ddp, as if wrapped in DistributedDataParallel "
                        "(its gradient buckets counted)")
    args = parser.parse_args(list(argv))
    if args.memory is not None and not args.hf:
        parser.error("--memory needs --hf: the benchmark's models take a loss with fixed target shapes")
    if args.largest_seq and args.memory is None:
        parser.error("--largest-seq goes with --memory")
    search: dict[str, Any] = {} if args.memory is None else {
        "memory": args.memory, "batch_dim": 0, "seq_dim": 1 if args.largest_seq else None}
    optimizer = None if args.optimizer == "none" else args.optimizer
    ranks: dict[str, Any] = {"world_size": args.world_size, "shard": args.shard} if args.world_size else {}
    if args.shard and not args.world_size:
        parser.error("--shard goes with --world-size")
    if args.hf:
        cases = [hf_case(args.hf, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                         batch=args.batch, dtype=DTYPES[args.dtype])]
    else:
        cases = [bench_case(name, args.size, device="meta") for name in ([args.model] if args.model
                                                                        else ["gpt", "convnet"])]
    reports = []
    for case in cases:
        start = time.perf_counter()
        configs: tuple[Any, ...] = tuple(DEFAULT_CONFIGS)
        try:
            report = remat.estimate(case.model, case.sample, loss=case.loss, optimizer=optimizer, where=case.where,
                                    configs=configs, device=args.device, **ranks, **search)
            unfit = ""
        except remat.BudgetError as e:  # the budget row does not fit this model: the other rows still tell
            configs = tuple(config for config in configs if isinstance(config, str))
            report = remat.estimate(case.model, case.sample, loss=case.loss, optimizer=optimizer, where=case.where,
                                    configs=configs, device=args.device, **ranks, **search)
            unfit = str(e)
        print(f"{case.name}: estimated in {time.perf_counter() - start:.1f} s", file=out)
        print(report, file=out)
        if unfit:
            print(unfit, file=out)
        reports.append(report.to_dict())
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(reports, f, indent=2)
    return 0


def compare_main(stdout: TextIO, progress: Callable[[str], None]) -> int:
    """Run ``python -m benchmarks --model estimate``: predicted against measured."""
    print(format_checks(run_checks(progress)), file=stdout)
    return 0
