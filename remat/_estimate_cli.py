"""``python -m remat estimate``: `remat.estimate`'s table from the command line, for remat's built-in models (the
GPT-like stack and the convnet of remat/_demo.py) or a Hugging Face config built on the meta device (``--hf llama``
with no size flags is the 7B Llama). `Case`, `bench_case` and `hf_case` also serve the benchmark's check of the
estimates against real steps (``python -m benchmarks --model estimate``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import remat

from ._core.errors import RematError
from ._demo import CONVNET_SIZES, GPT, GPT_SIZES, ConvNet, ConvNetConfig, GPTConfig, human_count, parameter_count
from ._estimate.estimate import DEFAULT_CONFIGS, is_budget
from ._sites.head import can_route_head

__all__ = ["DTYPES", "HF_KINDS", "LONG_CONFIGS", "SEED", "Case", "bench_case", "default_configs", "estimate_main",
           "hf_case"]

SEED = 1234
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HF_KINDS = ("llama", "gpt2", "t5", "bert")
LONG_CONFIGS = ("full+head", "full+head+tiles", "full+head+tiles+offload")
"""The configurations that matter at long sequences (NOTE [ Long-sequence configurations ] in
remat/_estimate/long_sequences.py): in the default table of a causal LM (whose loss the head can route), the offload
row where the device is an accelerator (on the CPU offload is a pass-through)."""
HF_MISSING = ("remat: --hf builds a model with transformers, which is not installed: pip install 'remat[hf]' (in a "
              "clone of remat: pip install -e '.[hf]')")


class _Parser(argparse.ArgumentParser):
    """Reports a usage error on one line (and exits with status 2), as every error of the command does."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_count(text: str) -> int:
    """A command-line count (a size, a number of layers or ranks): an int of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, but got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, but got {value}")
    return value


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


# -- python -m remat estimate --------------------------------------------------------------------


def estimate_main(argv: Sequence[str], stdout: TextIO | None = None) -> int:
    """Run ``python -m remat estimate`` with ``argv`` (after the word ``estimate``); return the exit status."""
    out = stdout or sys.stdout
    parser = _Parser(
        prog="python -m remat estimate",
        description="Predict the memory of one training step per remat configuration, without allocating it "
        "(remat.estimate on fake tensors; models are built on the meta device).",
    )
    parser.add_argument("--hf", choices=HF_KINDS, help="a transformers config (its defaults; llama: 7B) instead "
                        "of the benchmark's models")
    parser.add_argument("--model", choices=["gpt", "convnet"], help="a benchmark model (default: both)")
    parser.add_argument("--size", choices=["small", "medium"], default="small", help="benchmark model size")
    parser.add_argument("--layers", type=_positive_count, help="number of layers (--hf)")
    parser.add_argument("--hidden", type=_positive_count, help="hidden size (--hf)")
    parser.add_argument("--heads", type=_positive_count, help="attention heads (--hf)")
    parser.add_argument("--seq", type=_positive_count, default=2048, help="sequence length (--hf; default 2048)")
    parser.add_argument("--batch", type=_positive_count, default=1, help="batch size (--hf; default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype (--hf)")
    parser.add_argument("--optimizer", choices=["none", "sgd", "adam", "adamw"], default="adamw",
                        help="optimizer step to include (default adamw)")
    parser.add_argument("--device", default="cpu", help="device to predict for (default cpu; cuda works "
                        "without a GPU: it predicts torch.cuda.max_memory_allocated)")
    parser.add_argument("--memory", help="device memory (e.g. 80GiB, --hf): also print the largest batch whose "
                        "step fits in it per configuration")
    parser.add_argument("--largest-seq", action="store_true", help="with --memory: also the longest sequence per "
                        "configuration (at --batch); the default configurations without the budget row")
    parser.add_argument("--configs", help="comma-separated configurations to compare (none, full, save_matmuls, "
                        "full+head, full+head+tiles, full+head+tiles+offload, a budget such as 0.3 or 6GiB; default: "
                        "none, full, save_matmuls, 0.3, and for a causal LM "
                        f"{', '.join(LONG_CONFIGS)}, the offload row on an accelerator)")
    parser.add_argument("--json", metavar="PATH", help="also write the reports as JSON")
    parser.add_argument("--jobs", type=_positive_count, default=_cores(),
                        help="processes that estimate the configurations side by side (default: the cores this "
                        "process may run on)")
    parser.add_argument("--world-size", type=_positive_count, help="predict one rank of this many data-parallel ranks")
    parser.add_argument("--shard", choices=["fsdp2", "ddp"], help="with --world-size: fsdp2, as if fully_shard "
                        "were applied to each block and the root; ddp, as if wrapped in DistributedDataParallel "
                        "(its gradient buckets counted)")
    args = parser.parse_args(list(argv))
    if args.memory is not None and not args.hf:
        parser.error("--memory needs --hf: the benchmark's models take a loss with fixed target shapes")
    if args.largest_seq and args.memory is None:
        parser.error("--largest-seq goes with --memory")
    if args.shard and not args.world_size:
        parser.error("--shard goes with --world-size")
    for flag in ("layers", "hidden", "heads"):
        if getattr(args, flag) is not None and not args.hf:
            parser.error(f"--{flag} goes with --hf (the benchmark's models take --model and --size)")
    if args.model is not None and args.hf:
        parser.error("--model and --hf each name a model: give one")
    try:
        torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"argument --device: {_first_line(error)}")
    search: dict[str, Any] = {} if args.memory is None else {
        "memory": args.memory, "batch_dim": 0, "seq_dim": 1 if args.largest_seq else None}
    optimizer = None if args.optimizer == "none" else args.optimizer
    ranks: dict[str, Any] = {"world_size": args.world_size, "shard": args.shard} if args.world_size else {}
    try:
        with _quiet_fake_tensors():
            return _run(args, search, optimizer, ranks, out)
    except ModuleNotFoundError as error:
        if args.hf and error.name is not None and error.name.split(".")[0] == "transformers":
            print(HF_MISSING, file=sys.stderr)
            return 2
        return _failed(error)
    except (ValueError, TypeError, RematError, OSError) as error:  # one line, as a usage error is
        message = " ".join(str(error).split())
        print(message if message.startswith("remat: ") else f"remat: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("remat: estimate interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # a command line reports on one line, never a traceback
        return _failed(error)


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """torch logs a traceback when an op fails on fake tensors, before raising; the command reports the error on one
    line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _failed(error: BaseException) -> int:
    """What the command reports of an error it did not expect: one line, the exit status 1."""
    print(f"remat: estimate failed: {type(error).__name__}: {_first_line(error)} (remat.estimate from Python shows "
          "the traceback; if it is remat's, please report it)", file=sys.stderr)
    return 1


def default_configs(model: nn.Module, device: str, largest_seq: bool) -> tuple[Any, ...]:
    """The configurations ``python -m remat estimate`` compares without ``--configs``.

    `remat.estimate`'s defaults, and for a causal LM (a model whose loss `remat.apply(model, head=True)` can route)
    the configurations that matter at long sequences (`LONG_CONFIGS`: the offload row on an accelerator only, where
    it changes the device's peak). With ``largest_seq`` the budget row is left out: a budget plans anew at each
    size the search tries, for a row the fixed configurations already bracket.
    """
    configs = [c for c in DEFAULT_CONFIGS if not (largest_seq and is_budget(c))]
    if can_route_head(model):
        configs += [c for c in LONG_CONFIGS if "offload" not in c or torch.device(device).type != "cpu"]
    return tuple(configs)


def _config(text: str) -> Any:
    """A configuration as given on the command line: a fraction is a number, the rest strings."""
    try:
        return float(text) if "." in text and not text.lower().endswith("b") else text
    except ValueError:
        return text


def _cores() -> int:
    """The cores this process may run on (its affinity, where the platform says), else the machine's."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _run(args: argparse.Namespace, search: dict[str, Any], optimizer: str | None, ranks: dict[str, Any],
         out: TextIO) -> int:
    if args.hf:
        cases = [hf_case(args.hf, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                         batch=args.batch, dtype=DTYPES[args.dtype])]
    else:
        cases = [bench_case(name, args.size, device="meta") for name in ([args.model] if args.model
                                                                        else ["gpt", "convnet"])]
    reports = []
    for case in cases:
        configs = (tuple(_config(part.strip()) for part in args.configs.split(",") if part.strip()) if args.configs
                   else default_configs(case.model, args.device, args.largest_seq))
        start = time.perf_counter()
        report = remat.estimate(case.model, case.sample, loss=case.loss, optimizer=optimizer, where=case.where,
                                configs=configs, device=args.device, jobs=args.jobs, **ranks, **search)
        print(f"{case.name}: estimated in {time.perf_counter() - start:.1f} s", file=out)
        print(report, file=out)
        reports.append(report.to_dict())
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(reports, f, indent=2)
    return 0
