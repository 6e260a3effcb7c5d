"""`python -m benchmarks.budget_families`: a budget's promise across transformers' causal LM families and both of
their attention implementations.

Each family is built small but with a real sequence (hidden 128, 4 layers, 4 heads, vocabulary 4,096, one row of
1,024 tokens, float32), with `attn_implementation="eager"` (the scores and a 4-D float mask materialized) and
`"sdpa"` where the family has it. For each fraction f, the budget is f x full remat's step peak, measured on a real
step of `remat.apply(model)` (not predicted); then `remat.apply(model, budget=B, sample=batch)` plans, and three
training steps run as a default loop runs them (gradients set to None before each, AdamW between them), each
forward and backward tracked. A row prints the three steps' peaks over B and the plan's prediction over the first
step's peak; the run exits with status 1 where a step went over 1.05 x B (the promise of docs/guides/budget.md) or
a budget that full remat fits (f >= 1) was refused.

`--family NAME` and `--attention NAME` (repeatable) run some; `--fraction F` (repeatable) other fractions; the
default, 9 families x 2 x 4 fractions, takes about ten minutes on two cores.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, TextIO

import torch
from torch import nn

import remat

__all__ = ["FAMILIES", "FRACTIONS", "Row", "main", "measure", "sweep"]

SLACK = 1.05  # a plan's steps stay within SLACK x its budget: docs/guides/budget.md
FRACTIONS = (1.0, 1.05, 1.2, 1.5)
ATTENTION = ("eager", "sdpa")
SEQ, VOCAB = 1024, 4096
_LLAMA_LIKE = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2}

#: family -> (config class, model class, sizes) in transformers
FAMILIES: dict[str, tuple[str, str, dict[str, int]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_LLAMA_LIKE, "intermediate_size": 1024}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_LLAMA_LIKE, "head_dim": 32}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**_LLAMA_LIKE, "head_dim": 32, "sliding_window": 256}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_LLAMA_LIKE, "num_key_value_heads": 4, "pad_token_id": 0,
                                               "eos_token_id": 2}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 2 * SEQ}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"hidden_size": 128, "ffn_dim": 512, "num_hidden_layers": 4,
                                            "num_attention_heads": 4, "max_position_embeddings": 2 * SEQ,
                                            "word_embed_proj_dim": 128}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"hidden_size": 128, "intermediate_size": 512,
                                                         "num_hidden_layers": 4, "num_attention_heads": 4}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {"hidden_size": 128, "num_hidden_layers": 4,
                                                     "num_attention_heads": 4}),
}


class Row(NamedTuple):
    """One family, attention and fraction: its three steps' peaks over the budget (empty where it was refused), the
    plan's prediction over the first step's peak, and the refusal's message."""

    family: str
    attention: str
    fraction: float
    steps: tuple[float, ...]
    predicted: float | None
    refused: str = ""

    @property
    def kept_promise(self) -> bool:
        """No step over `SLACK` x the budget; no refusal of a budget full remat fits."""
        if self.refused:
            return self.fraction < 1.0
        return max(self.steps) <= SLACK


def _model(family: str, attention: str) -> nn.Module | None:
    """The family's model with `attention`, or None where the family does not offer it."""
    transformers: Any = importlib.import_module("transformers")
    config_class, model_class, sizes = FAMILIES[family]
    torch.manual_seed(0)
    try:
        config = getattr(transformers, config_class)(vocab_size=VOCAB, attn_implementation=attention, **sizes)
        model: nn.Module = getattr(transformers, model_class)(config)
    except ValueError:  # transformers: this family has no such attention
        return None
    return model


def _step_peaks(model: nn.Module, batch: dict[str, torch.Tensor], steps: int) -> list[int]:
    """The tracked peaks of `steps` training steps' forward and backward, as a default loop runs them."""
    optimizer = torch.optim.AdamW(model.parameters())
    peaks = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with remat.track() as tracker:
            model(**batch).loss.backward()
        peaks.append(tracker.peak_bytes)
        optimizer.step()
    return peaks


def measure(family: str, attention: str, fractions: Sequence[float]) -> list[Row]:
    """The rows of one family and attention (none where the family does not offer it)."""
    base = _model(family, attention)
    if base is None:
        return []
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    full = _step_peaks(remat.apply(copy.deepcopy(base)), batch, 1)[0]
    rows = []
    for fraction in fractions:
        model, budget = copy.deepcopy(base), int(fraction * full)
        try:
            remat.apply(model, budget=budget, sample=batch)
        except remat.BudgetError as error:
            rows.append(Row(family, attention, fraction, (), None, " ".join(str(error).split())))
            continue
        plan = remat.plan(model).budget
        peaks = _step_peaks(model, batch, 3)
        predicted = plan.peak_bytes / peaks[0] if plan is not None else None
        rows.append(Row(family, attention, fraction, tuple(peak / budget for peak in peaks), predicted))
    return rows


def sweep(families: Sequence[str] | None = None, attention: Sequence[str] = ATTENTION,
          fractions: Sequence[float] = FRACTIONS, progress: TextIO | None = None) -> list[Row]:
    """Every row, families in order (default: all of `FAMILIES`), with transformers' and remat's logs quiet."""
    rows: list[Row] = []
    logger = logging.getLogger("remat")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        for family in families or list(FAMILIES):
            for implementation in attention:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    found = measure(family, implementation, fractions)
                rows.extend(found)
                if progress is not None:
                    for row in found:
                        print(format_row(row), file=progress, flush=True)
    finally:
        logger.setLevel(level)
    return rows


def format_row(row: Row) -> str:
    head = f"{row.family:9s} {row.attention:6s} {row.fraction:5.2f}"
    if row.refused:
        return f"{head}  refused: {row.refused[:100]}"
    steps = " ".join(f"{step:.4f}" for step in row.steps)
    predicted = f"{row.predicted:.3f}" if row.predicted is not None else "-"
    return f"{head}  {steps}   {predicted}{'' if row.kept_promise else '   OVER'}"


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Print every row; exit status 1 where the promise was broken."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.budget_families", description=__doc__.split("\n")[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="a family (repeatable)")
    parser.add_argument("--attention", action="append", choices=ATTENTION, help="an attention (repeatable)")
    parser.add_argument("--fraction", action="append", type=float, help="a fraction of full remat's step peak")
    parser.add_argument("--progress", action="store_true", help="print each row as it comes")
    args = parser.parse_args(argv)
    rows = sweep(args.family, args.attention or ATTENTION, args.fraction or FRACTIONS,
                 sys.stderr if args.progress else None)
    stream = out or sys.stdout
    print(f"budget = f x full remat's step peak; steps 1-3 over the budget, the prediction over step 1 "
          f"(torch {torch.__version__}, transformers {importlib.import_module('transformers').__version__})",
          file=stream)
    print(f"{'family':9s} {'attn':6s} {'f':>5s}  {'step 1':6s} {'step 2':6s} {'step 3':6s}   predicted", file=stream)
    for row in rows:
        print(format_row(row), file=stream)
    broken = [row for row in rows if not row.kept_promise]
    print(f"{len(rows) - len(broken)} of {len(rows)} rows keep the promise (steps within {SLACK} x the budget, "
          "no refusal where full remat fits).", file=stream)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
