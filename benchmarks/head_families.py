"""`python -m benchmarks.head_families`: `remat.apply(model, head=True)` across transformers' causal LM families.

Every family of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` (189 in transformers 5.23) is built from its default config made
tiny (`tiny_config`: widths, depths, heads, experts and the vocabulary shrunk, dropout off), in float64 where the
model allows it (else float32), and trains one step twice on the same weights and batch: without remat, its loss
taken from its logits as its own `ForCausalLMLoss` takes it (labels shifted, the mean over tokens), and with
`remat.apply(model, head=True)` (with `--tiles N`, `remat.apply(model, head=True, tiles=N)`: the token-wise modules
of its blocks in tiles too). Each family ends in one of:

* `equal`: the routed loss went through the chunks (`logits` None) and equals the baseline's, every gradient too
  (`torch.testing.assert_close` at the dtype's default tolerances);
* `refused`: `apply` refused the model (no head it can route, or with `--tiles` nothing token-wise to tile: a
  `ValueError` saying what it found);
* `refused at step`: the first training step raised a `RematError` naming the use of the logits it cannot chunk;
* `DIFFERS`: routed, and the loss or a gradient differs from the baseline's: a silent difference, the one outcome
  that must never happen;
* `not routed`: `apply` accepted it but the step did not go through the chunks;
* `no tiny model`: the tiny config could not be built or its baseline step failed without remat (a limit of this
  harness's shrinking, not of remat).

`--family NAME` (repeatable) runs some; the default runs all, which takes minutes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import importlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import remat

__all__ = ["OUTCOMES", "Outcome", "check", "families", "main", "sweep", "tiny_config"]

OUTCOMES = ("equal", "refused", "refused at step", "DIFFERS", "not routed", "no tiny model")
BATCH, SEQ, VOCAB = 2, 8, 96

# sizes a tiny model takes, by config attribute (where the attribute is an int in the default config)
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 32, "n_embd": 32, "d_model": 32, "embed_dim": 32, "n_embed": 32,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "d_ff": 64, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "decoder_layers": 2, "encoder_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "num_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rotary_dim": 4, "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4, "v_head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 16, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2,
    "n_group": 1, "topk_group": 1, "max_position_embeddings": 64,
}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


class Outcome(NamedTuple):
    """What `remat.apply(model, head=True)` did with one family: one of `OUTCOMES`, and why."""

    kind: str
    detail: str = ""


class _Differs(Exception):
    """The routed step's loss or a gradient differs from the baseline's."""


def _transformers() -> Any:
    return importlib.import_module("transformers")  # the `hf` extra


def families() -> dict[str, str]:
    """Every causal LM family of the installed transformers: model type -> class name."""
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    return dict(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> Any:
    """The family's default config, made tiny (`SIZES`), dropout off, special tokens inside the vocabulary."""
    mapping = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    return _shrink(mapping[model_type]())


def _shrink(config: Any) -> Any:
    hf = _transformers()
    values = config.to_dict()
    for key, size in SIZES.items():
        value = getattr(config, key, None) if key in values else None
        if isinstance(value, int) and not isinstance(value, bool):
            with contextlib.suppress(Exception):
                setattr(config, key, size)
    for key in values:
        value = getattr(config, key, None)
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key.endswith("_drop")):
            setattr(config, key, 0.0)
        elif key in TOKEN_IDS and isinstance(value, int) and value >= VOCAB:
            setattr(config, key, 1)
        elif isinstance(value, hf.PretrainedConfig):
            _shrink(value)
    layers, kinds = getattr(config, "num_hidden_layers", None), getattr(config, "layer_types", None)
    if isinstance(kinds, list) and isinstance(layers, int) and kinds and len(kinds) != layers:
        config.layer_types = (kinds * layers)[:layers]
    return config


def _build(model_type: str, class_name: str) -> nn.Module:
    hf = _transformers()
    kind = getattr(hf, class_name)
    config = tiny_config(model_type)
    torch.manual_seed(0)
    try:
        model: nn.Module = kind(config)
    except Exception:
        for key in ("decoder", "text_config"):  # a composite config whose causal LM takes one part
            part = getattr(config, key, None)
            if isinstance(part, hf.PretrainedConfig):
                torch.manual_seed(0)
                model = kind(part)
                break
        else:
            raise
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.train()


def _step(model: nn.Module, ids: torch.Tensor, routed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step: with `routed`, through the model's own loss (which the route computes in chunks);
    else its loss taken from its logits as `ForCausalLMLoss` does, in the logits' dtype."""
    torch.manual_seed(1)
    if routed:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        if out.logits is not None:
            raise LookupError("the step did not go through the chunks (its output has logits)")
        loss = out.loss
    else:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def check(model_type: str, class_name: str, tiles: int | None = None) -> Outcome:
    """One family's outcome (see the module's docstring); `tiles` adds `tiles=` to the request."""
    request: dict[str, Any] = {"head": True} if tiles is None else {"head": True, "tiles": tiles}
    try:
        model = _build(model_type, class_name)
    except Exception as error:
        return Outcome("no tiny model", _why(error))
    try:
        remat.apply(copy.deepcopy(model), **request)  # a refusal comes here, before any step
    except ValueError as error:
        return Outcome("refused", str(error))
    ids = torch.randint(3, VOCAB - 1, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    try:
        try:
            wide = copy.deepcopy(model).double()
            expected = _step(copy.deepcopy(wide), ids, routed=False)
            model = wide
        except Exception:
            expected = _step(copy.deepcopy(model), ids, routed=False)
    except Exception as error:
        return Outcome("no tiny model", "its own step: " + _why(error))
    try:
        applied = remat.apply(model, **request)
        loss, grads = _step(applied, ids, routed=True)
        _compare(expected, loss, grads)
    except remat.RematError as error:
        return Outcome("refused at step", str(error))
    except LookupError as error:
        return Outcome("not routed", str(error))
    except _Differs as error:
        return Outcome("DIFFERS", str(error))
    except Exception as error:
        return Outcome("DIFFERS", "the routed step failed where the model's own ran: " + _why(error))
    tiled = "" if tiles is None else f", {len(remat.plan(applied).tiles)} modules tiled"
    return Outcome("equal", str(loss.dtype).removeprefix("torch.") + tiled)


def _compare(expected: tuple[torch.Tensor, dict[str, torch.Tensor]], loss: torch.Tensor,
             grads: dict[str, torch.Tensor]) -> None:
    try:
        torch.testing.assert_close(loss.to(expected[0].dtype), expected[0])
        if grads.keys() != expected[1].keys():
            raise AssertionError(f"gradients of {sorted(grads.keys() ^ expected[1].keys())} on one side only")
        for name, grad in expected[1].items():
            torch.testing.assert_close(grads[name], grad, msg=functools.partial(_named, name))
    except AssertionError as error:
        raise _Differs(" ".join(str(error).split())) from None


def _named(name: str, message: str) -> str:
    return f"gradient of {name}: {message}"


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' and remat's logs and warnings off while families are built and stepped."""
    logger = logging.getLogger("remat")
    level, hf_logging = logger.level, _transformers().logging
    verbosity = hf_logging.get_verbosity()
    logger.setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
        hf_logging.set_verbosity(verbosity)


def sweep(names: Sequence[str] | None = None, progress: TextIO | None = None,
          tiles: int | None = None) -> dict[str, Outcome]:
    """The outcome of every family named (default: all of them), in order; `tiles` adds `tiles=` to the request."""
    every = families()
    results: dict[str, Outcome] = {}
    for name in names or list(every):
        with _quiet():
            results[name] = check(name, every[name], tiles)
        if progress is not None:
            print(f"{name:28s} {results[name].kind}", file=progress, flush=True)
    return results


def format_sweep(results: dict[str, Outcome], width: int = 160, tiles: int | None = None) -> str:
    counts = collections.Counter(outcome.kind for outcome in results.values())
    request = "head=True" if tiles is None else f"head=True, tiles={tiles}"
    lines = [f"remat.apply(model, {request}) on {len(results)} causal LM families of transformers "
             f"{_transformers().__version__} (tiny configs; float64 where the model allows)"]
    for name, outcome in results.items():
        lines.append(f"  {name:28s} {outcome.kind:16s} {outcome.detail}"[:width])
    lines.append("outcomes: " + ", ".join(f"{kind} {counts[kind]}" for kind in OUTCOMES))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Print every family's outcome; exit status 1 where one differs silently."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.head_families", description=__doc__.split("\n")[0])
    parser.add_argument("--family", action="append", help="a model type (repeatable); default: every family")
    parser.add_argument("--progress", action="store_true", help="print each family's outcome as it comes")
    parser.add_argument("--tiles", type=int, help="also tile the blocks' token-wise modules in this many tiles")
    args = parser.parse_args(argv)
    results = sweep(args.family, sys.stderr if args.progress else None, args.tiles)
    print(format_sweep(results, tiles=args.tiles), file=out or sys.stdout)
    return 1 if any(outcome.kind == "DIFFERS" for outcome in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
