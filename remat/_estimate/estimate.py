"""`remat.estimate`: the peak memory of a training step per remat configuration, before allocating it.

This face turns each configuration into remat sites on the model for the duration of its step (NOTE [ Applying
a configuration for a while ]); `predict.predict` runs the step on fake tensors and counts its bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .._budget.driver import fit_budget
from .._chain.chain import parse_budget
from .._core.options import Options
from .._core.policies import Policy, save_matmuls
from .._core.public import claim
from .._core.requests import BudgetRequest, Where
from .._core.switch import enabled
from .._core.units import parse_memory
from .._measure import ddp as _ddp
from .._measure import sharded as _sharded
from .._measure.fake import resolve_device
from .._measure.host_offload import HostOffload
from .._sites import targets as _targets
from .._sites.integrations import engine_of
from .largest_batch import position_table, searches
from .long_sequences import split_extras, with_extras
from .predict import OPTIMIZERS, Configured, OptimizerLike, Refine, predict
from .report import EstimateReport
from .reserve import headroom_bytes

__all__ = ["DEFAULT_CONFIGS", "estimate", "is_budget"]

DEFAULT_CONFIGS: tuple[Any, ...] = ("none", "full", "save_matmuls", 0.3)
"""The configurations `estimate` compares by default."""


# NOTE [ Applying a configuration for a while ]
# 1. A configuration is on the user's model only while its row is estimated, on the model as it was before remat:
#    what `remat(module)`, `remat.apply` or an earlier budget put on its instances (sites, tiles, a routed head, a
#    budget's hook) is set aside for the row, and every module's hook tables and instance attributes are put back
#    exactly afterwards (NOTE [ A model set aside ] in remat/_sites/targets.py). A row is the same on a model remat
#    was applied to as on a fresh one.
# 2. "full", "save_matmuls" and a policy rematerialize the blocks `remat.apply(model)` picks (or `where`); a budget
#    lets the planner choose per block.
# 3. "none" switches every site off with `remat.enabled(False)`; the others run with the switch on, whatever `REMAT`
#    says, since that is what they predict. Sites of a class `@remat` decorated are the class's, not set aside: they
#    run in every row but "none".


def _config_label(config: Any) -> str:
    if isinstance(config, str):
        return config
    if isinstance(config, Policy):
        return "full" if config.saves_nothing else repr(config)
    if isinstance(config, (int, float)):
        return f"budget {config}"
    return str(getattr(config, "__name__", None) or repr(config))


def is_budget(config: Any) -> bool:
    """Whether an estimate configuration is a memory budget (bytes, a string with units, a fraction)."""
    if isinstance(config, bool):
        return False
    return isinstance(config, (int, float)) or (isinstance(config, str) and config not in _NAMED)


_NAMED: dict[str, Policy | None] = {"none": None, "full": Policy(), "save_matmuls": save_matmuls}


def _configuration(model: nn.Module, config: Any, where: Where | None, offload: Any = False) -> Configured:
    """How to apply one configuration; argument errors are raised here, before any step runs."""
    base, extras = split_extras(config)
    if extras:  # the head, tiles, per-block offload: NOTE [ Long-sequence configurations ]
        if base not in ("full", "save_matmuls"):
            raise ValueError(f"remat: estimate's configuration {config!r} adds to {base!r}; the head, tiles and "
                             "offload add to 'full' or 'save_matmuls'.")
        offloaded = HostOffload() if "offload" in extras else False
        return with_extras(model, _configuration(model, base, where, offloaded), config, extras, where)
    if isinstance(config, bool) or config is None:
        raise TypeError(f"remat: estimate's configurations are 'none', 'full', 'save_matmuls', a policy or a "
                        f"budget, but got {config!r}.")
    if config == "none":
        @contextlib.contextmanager
        def off(sample: Any) -> Iterator[None]:
            with _targets.set_aside(model), enabled(False):
                yield

        return Configured(config, "none", off)
    if is_budget(config):
        try:
            parse_budget(config)
        except ValueError:
            if not isinstance(config, str):
                raise
            raise ValueError(f"remat: estimate does not know the configuration {config!r}: give 'none', 'full', "
                             "'save_matmuls' ('full+head', 'save_matmuls+head': the loss in chunks too), a "
                             "policy, or a budget (bytes, '6GiB', a fraction).") from None

        @contextlib.contextmanager
        def planned(sample: Any) -> Iterator[None]:
            with _targets.set_aside(model):
                # the planner of remat.apply(budget=), on fake tensors; the plan verified at once, as a real model's
                # first training step would verify it (NOTE [ The first step ])
                request = BudgetRequest(budget=config, sample=sample, where=where, first_step=False)
                fit_budget(model, request, request.budget)
                with enabled(True):
                    yield

        return Configured(config, _config_label(config), planned, alike=False)
    policy = _NAMED[config] if isinstance(config, str) else config
    if not (isinstance(policy, Policy) or callable(policy)):
        raise TypeError(f"remat: estimate's configurations are 'none', 'full', 'save_matmuls', a policy or a "
                        f"budget, but got `{type(config).__name__}`.")
    options = Options(policy=policy, offload=offload)
    _targets.select(model, where)  # no blocks, or a `where` that matches nothing: raise now

    @contextlib.contextmanager
    def applied(sample: Any) -> Iterator[None]:
        with _targets.set_aside(model):
            _targets.apply_blocks(model, where, 1, options)
            with enabled(True):
                yield

    return Configured(config, _config_label(config), applied)


def estimate(
    model: nn.Module,
    sample: Any,
    *,
    loss: Callable[[Any], torch.Tensor] | None = None,
    optimizer: OptimizerLike = None,
    configs: Sequence[Any] | None = None,
    where: Where | None = None,
    device: str | torch.device | None = None,
    world_size: int | None = None,
    shard: str | None = None,
    memory: int | str | None = None,
    batch_dim: int | None = None,
    seq_dim: int | None = None,
    headroom: float | int | str | None = None,
    jobs: int = 1,
) -> EstimateReport:
    """Predict the memory of one training step of `model` on `sample`, per remat configuration, without running it.

    The step (forward, loss, backward, the optimizer step) runs on fake tensors: each op computes the shapes of
    its outputs only, and remat's byte tracker counts them as `remat.track` counts real ones. The model may be
    real (its parameters are swapped for fake ones for the duration and put back; nothing about it changes) or
    built on the meta device, so a 7-billion-parameter model is estimated on a laptop in seconds. Parameters,
    gradients and optimizer state are exact; what is held for backward, the step peak (what `budget=` bounds: the
    most bytes live during forward and backward above the step's start, gradients included) and the device peak
    (the whole step, parameters and optimizer state included: what `memory=` bounds) match a real run within a few
    percent.
    The step is a steady-state one of a default loop, ``loss = model(**batch).loss; loss.backward();
    optimizer.step(); optimizer.zero_grad()``, which lets go of the model's output once the loss is made (a loop
    that keeps it peaks up to a row's ``output_bytes`` higher): see NOTE [ What an estimate runs ] in predict.py.

    Args:
        model: the model, real or on the meta device, in the train/eval mode the step should use.
        sample: the model's inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments.
            Real, meta or fake tensors; only their shapes and dtypes matter.
        loss: a callable from the model's output to the scalar loss; by default the output's `.loss` if it has
            one, else the sum of its floating-point tensors.
        optimizer: None (no optimizer step), "sgd" (momentum 0.9), "adam", "adamw", an optimizer class, or a
            callable from the list of trainable parameters to an optimizer.
        configs: what to compare: "none" (remat switched off: every site but those forced on with
            `enabled=True`), "full" and "save_matmuls" (on the blocks `remat.apply(model)` picks, or `where`),
            "full+head" and "save_matmuls+head" (the same, and a Hugging Face causal LM's loss in chunks, as
            `remat.apply(model, head=True)`), with "+tiles" (or "+tiles=N") the blocks' token-wise modules in tiles
            (`remat.tiled`) and with "+offload" what each block keeps on the host (`offload=True`; on an
            accelerator), as in "full+head+tiles+offload", a `remat.policies` policy, or a budget (bytes, "1.5GiB",
            a fraction of no remat's step peak) for the planner of `remat.apply(model, budget=...)`, which routes
            the head where only that fits. Default: ("none", "full", "save_matmuls", 0.3), the budget only where
            that planner exists.
        where: which blocks the configurations rematerialize, as for `remat.apply`.
        device: the device to predict for; default: the model's, else the sample's, else the CPU. On CUDA the
            device peak predicts `torch.cuda.max_memory_allocated` (tensors rounded up to 512-byte blocks).
        world_size: predict one rank of a data-parallel run of this many ranks: for a model the user
            `fully_shard`-ed (default: its mesh's size), or with `shard="fsdp2"`. Runs in this process on torch's
            fake process group: remat's own, made for the estimate, or the user's (`init_process_group("fake",
            ...)`, torchtitan's recipe; then the default is its size); the sample is one rank's batch. See "Many
            GPUs" in the README.
        shard: "fsdp2": estimate a plain model as if `fully_shard` were applied to each block `remat.apply`
            picks (or `where`) and to the root, on `world_size` ranks. "ddp": as if wrapped in
            `DistributedDataParallel` with its defaults: everything whole on every rank, plus its gradient
            buckets (`world_size` changes nothing then, and no process group is needed). A model already
            wrapped in `DistributedDataParallel` is estimated so, with its own `gradient_as_bucket_view`.
        memory: with `batch_dim` and/or `seq_dim`, the device memory (bytes, or a string such as "80GiB") to
            fit: each configuration also gets the largest batch size (`largest_batch`, along `batch_dim` of the
            sample's tensors) and sequence length (`largest_seq`, along `seq_dim`, at the sample's batch size)
            whose device peak fits in it (less `headroom`), found by bisection on fake tensors. Where the model
            holds a table of learned positions (GPT-2's `wpe`), the report's `positions` names it, and its text
            says when a `largest_seq` is more than the model can take.
        batch_dim, seq_dim: the dimension of the sample's tensors that is the batch, the sequence.
        headroom: with `memory`, what of it to leave to the device's allocator, as for `remat.apply(memory=)`: a
            fraction of `memory` or bytes; by default 0.1 where the device's allocator caches (CUDA), else 0.
        jobs: how many worker processes estimate the configurations side by side, forked from this one (on Linux;
            one process's whole model, not a rank's): the report is the same, sooner on as many cores. Fork only
            where forking this process is safe (`python -m remat estimate` does: `--jobs`).

    Returns:
        An `EstimateReport`: `report[config]` has `params_bytes`, `grads_bytes`, `optimizer_bytes`,
        `activation_bytes` (held for backward), `step_peak_bytes`, `peak_bytes` (the device peak) and
        `output_bytes`; `print(report)` shows a table that says what each column counts; `report.to_dict()` for
        scripts.

    Raises:
        RematError: an op in the step depends on tensor values (`nonzero`, `.item()`), which fake tensors do
            not have (the message names the op); or a budget configuration without the budget planner.
        ValueError, TypeError: an unknown configuration or optimizer, or no blocks to rematerialize.

    >>> import torch, remat
    >>> with torch.device("meta"):
    ...     model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    >>> report = remat.estimate(model, torch.randn(64, 1024), optimizer="adamw", configs=("none", "full"))
    >>> report["none"].grads_bytes == report["none"].params_bytes == 8 * (1024 * 1024 + 1024) * 4
    True
    >>> print(str(report).splitlines()[0])
    remat.estimate: Sequential, one training step (optimizer step AdamW), predicted for cpu
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat: estimate expects an nn.Module, but got `{type(model).__name__}`.")
    if isinstance(optimizer, str) and optimizer.lower() not in OPTIMIZERS:
        raise ValueError(f"remat: estimate's `optimizer` must be one of {sorted(OPTIMIZERS)}, an optimizer class "
                         f"or a factory, but got {optimizer!r}.")
    if optimizer is not None and not isinstance(optimizer, str) and not callable(optimizer):
        raise TypeError(f"remat: estimate's `optimizer` must be a name, an optimizer class or a factory, but got "
                        f"`{type(optimizer).__name__}`.")
    if configs is None:
        configs = DEFAULT_CONFIGS
    if isinstance(configs, (str, Policy)) or not isinstance(configs, Sequence):
        configs = (configs,)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"remat: estimate's `jobs` must be a positive int (how many processes), but got {jobs!r}.")
    target = resolve_device(model, sample, device)
    room = 0
    if memory is not None:  # the allocator's share: NOTE [ The allocator's reserve ] in reserve.py
        room = headroom_bytes(headroom, parse_memory(memory, "estimate's `memory`"), target)
    elif headroom is not None:
        raise ValueError("remat: estimate's `headroom` goes with `memory=`.")
    refine = searches(sample, memory if not room else parse_memory(memory, "") - room, batch_dim, seq_dim)
    if shard == "ddp" or _ddp.unwrap(model) is not None:
        report = _per_rank_ddp(model, sample, loss, optimizer, configs, where, target, world_size, shard,
                               refine)
    elif world_size is not None or shard is not None or _sharded.is_sharded(model):
        report = _per_rank(model, sample, loss, optimizer, configs, where, target, world_size, shard, refine)
    else:
        resolved = [_configuration(model, config, where) for config in configs]
        report = predict(model, sample, loss=loss, optimizer=optimizer, configs=resolved, device=target,
                         refine=refine, engine=engine_of(model), jobs=jobs)  # one rank's, under DeepSpeed
    if refine is None:
        return report
    return dataclasses.replace(report, memory=parse_memory(memory, "estimate's `memory`"), headroom=room,
                               positions=position_table(model) if seq_dim is not None else None)


def _per_rank(model: nn.Module, sample: Any, loss: Callable[[Any], torch.Tensor] | None, optimizer: OptimizerLike,
              configs: Sequence[Any], where: Where | None, target: torch.device, world_size: int | None,
              shard: str | None, refine: Refine | None) -> EstimateReport:
    """One rank's estimate, on a sharded shadow of the model: NOTE [ Estimating one rank of FSDP2 ]."""
    if shard not in (None, "fsdp2"):
        raise ValueError(f"remat: estimate's `shard` must be None, 'fsdp2' or 'ddp', but got {shard!r}.")
    if world_size is None:  # the user's mesh, else the user's own fake process group
        world_size = _sharded.mesh_size(model) or _sharded.users_fake_world()
    size = _check_size(world_size)
    copy, settings = _sharded.shadow(model)
    if shard == "fsdp2":
        for _, block in _targets.select(copy, where):
            settings.setdefault(block, _sharded.Sharding(None, None))
        settings.setdefault(copy, _sharded.Sharding(None, None))
    resolved = [_configuration(copy, config, where) for config in configs]
    with _sharded.fake_world(size, target) as mesh:

        def prepare() -> list[torch.Tensor]:
            _sharded.shard(copy, settings, mesh)
            return list(copy.parameters())

        report = predict(copy, sample, loss=loss, optimizer=optimizer, configs=resolved, device=target,
                         prepare=prepare, refine=refine)
    return dataclasses.replace(report, model=type(model).__qualname__)


def _check_size(size: object) -> int:
    if size is None or isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"remat: estimate's `world_size` must be a positive int, but got {size!r}.")
    return size


def _per_rank_ddp(model: nn.Module, sample: Any, loss: Callable[[Any], torch.Tensor] | None,
                  optimizer: OptimizerLike, configs: Sequence[Any], where: Where | None, target: torch.device,
                  world_size: int | None, shard: str | None, refine: Refine | None) -> EstimateReport:
    """One rank's estimate under DDP: the plain step with the reducer's buckets, NOTE [ Estimating one rank of DDP ]."""
    if world_size is not None:
        _check_size(world_size)
    wrapped = _ddp.unwrap(model)
    if wrapped is not None and shard not in (None, "ddp"):
        raise ValueError(f"remat: estimate got a DistributedDataParallel model with shard={shard!r}; pass "
                         "shard='ddp' (or none) for it, or the unwrapped module for another sharding.")
    module, views = wrapped if wrapped is not None else (model, False)
    if _sharded.is_sharded(module):
        raise ValueError("remat: estimate got shard='ddp' for a model that `fully_shard` was applied to; pass "
                         "shard='fsdp2' (or none) for it, or the model before `fully_shard` for DDP.")
    buckets = _ddp.Buckets(views)

    def resident(params: list[torch.Tensor]) -> list[torch.Tensor]:
        buckets.make(params)
        return buckets.flats

    resolved = [_configuration(module, config, where) for config in configs]
    try:
        report = predict(module, sample, loss=loss, optimizer=optimizer, configs=resolved, device=target,
                         resident=resident, refine=refine)
    finally:
        buckets.close()
    return dataclasses.replace(report, model=type(model).__qualname__)

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
