"""`remat.apply(memory=...)`, the largest batch of `remat.estimate(memory=...)` and where a step peaks, each
checked against a real training step tracked with `remat.track()`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import recomputes
from torch import nn
from torch.utils._pytree import tree_leaves

import remat
from remat._estimate.reserve import DEFAULT

WIDTH = 32


def _model(depth: int = 6, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(depth)]
    return nn.Sequential(*blocks).to(dtype)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _real_step(model: nn.Module, x: torch.Tensor, optimizer: str | None = "adamw") -> tuple[int, dict[str, int]]:
    """One warm real step (state made by a step on zero gradients first): (total peak, peak per phase)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[optimizer](params) if optimizer else None
    if opt is not None:
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = [t for s in (opt.state.values() if opt else ()) for t in tree_leaves(s) if isinstance(t, torch.Tensor)]
    base = _bytes([*params, *model.buffers(), x, *state])
    phases: dict[str, int] = {}
    with remat.track() as t:  # the output let go of once the loss is made, as `loss = loss_fn(model(x))` does
        value = _loss(model(x))
        phases["forward"] = t.peak_bytes
        t._restart_peak()
        torch.autograd.backward(value)
        del value
        phases["backward"] = t.peak_bytes
        t._restart_peak()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            phases["optimizer step"] = t.peak_bytes
    peaks = {phase: base + n for phase, n in phases.items()}
    return max(peaks.values()), peaks


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(_loss(model(x)))
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


# -- apply(memory=...) ---------------------------------------------------------------------------


def test_memory_plan_runs_within_memory_and_matches_no_remat_gradients() -> None:
    x = torch.randn(512, WIDTH)
    none, _ = _real_step(_model(), x)
    full_model = remat.apply(_model(), policy=None)
    full, _ = _real_step(full_model, x)
    assert full < 0.7 * none  # room between the two for a plan
    memory = (none + full) // 2
    model = remat.apply(_model(), memory=memory, sample=x, loss=_loss, optimizer="adamw")
    sites = remat.plan(model)
    assert len(sites) > 0  # something is rematerialized: the plan is active
    measured, _ = _real_step(model, x)
    assert measured <= memory * 1.05, (measured, memory)

    model64 = remat.apply(_model(dtype=torch.float64), memory=memory * 2, sample=x.double(), loss=_loss,
                          optimizer=torch.optim.AdamW)
    assert len(remat.plan(model64)) > 0
    x64 = x.double()
    with remat.enabled(False):
        expected = _grads(model64, x64)
    torch.testing.assert_close(_grads(model64, x64), expected)


def test_memory_plan_is_checked_on_a_step_that_makes_its_gradients() -> None:
    """A step after ``zero_grad()`` makes its gradients in backward, and they take from the same memory: the
    plan's checked peak is a real step's rise from no gradients, not the (lower) rise with gradients there."""
    x = torch.randn(32, WIDTH)
    full, _ = _real_step(remat.apply(_model(), policy=None), x, None)
    model = remat.apply(_model(), memory=int(full * 1.02), sample=x, loss=_loss, optimizer=None)
    checked = remat.plan(model).budget
    assert checked is not None and checked.measured is not None

    def rise(zeroed: bool) -> int:
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if zeroed else None
        with remat.track() as t:
            torch.autograd.backward(_loss(model(x)))
        return t.peak_bytes

    assert checked.measured == rise(zeroed=False) > rise(zeroed=True)
    assert checked.measured <= checked.budget


def test_memory_below_full_remat_names_the_least_total() -> None:
    x = torch.randn(256, WIDTH)
    model = _model()
    with pytest.raises(remat.BudgetError, match="at least") as info:
        remat.apply(model, memory=100_000, sample=x, loss=_loss, optimizer=torch.optim.AdamW(model.parameters()))
    least = info.value.least_bytes
    assert least is not None and least > 100_000
    assert len(remat.plan(model)) == 0  # nothing left behind
    full, _ = _real_step(remat.apply(_model(), policy=None), x)
    assert full <= least * 1.05 and least <= full * 1.05  # the least total is what full remat measures
    planned = remat.apply(_model(), memory=int(least * 1.02), sample=x, loss=_loss, optimizer="adamw")
    assert _real_step(planned, x)[0] <= least * 1.02 * 1.05


def test_memory_argument_errors() -> None:
    x = torch.randn(8, WIDTH)
    with pytest.raises(ValueError, match="not both"):
        remat.apply(_model(), memory="1GiB", budget=0.5, sample=x)
    with pytest.raises(ValueError, match="goes with `memory`"):
        remat.apply(_model(), optimizer="adamw")
    with pytest.raises(ValueError, match="needs `sample=`"):
        remat.apply(_model(), memory="1GiB")
    with pytest.raises(TypeError, match="memory"):
        remat.apply(_model(), memory=0.5, sample=x)


# -- on a device whose optimizers take their foreach path --------------------------------------------------


def _on(device: str, width: int = 256, batch: int = 1024) -> tuple[Any, torch.Tensor]:
    """The model and batch of a default loop on ``device`` (made inside the caller's tracker, as on a device)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(4)]
    return nn.Sequential(*blocks).to(device), torch.randn(batch, width).to(device)


def _adamw_loop(model: nn.Module, x: torch.Tensor, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for _ in range(steps):
        optimizer.zero_grad()  # set_to_none=True: backward allocates the gradients again
        _loss(model(x)).backward()
        optimizer.step()


def _loop_total(device: str) -> int:
    """The peak of three steps of the default AdamW loop, everything allocated inside: what the device holds."""
    with remat.track() as t:
        model, x = _on(device)
        _adamw_loop(model, x, torch.optim.AdamW(model.parameters()))
    return t.peak(device)


def test_the_estimate_of_a_default_adamw_loop_on_a_device_prices_its_foreach_step(test_device: str) -> None:
    """torch's AdamW takes its foreach path on an accelerator (one parameter-sized temporary more at its peak);
    the estimate's fake parameters would take the for-loop: it prices the path the real parameters take."""
    model, x = _on(test_device, batch=16)  # the optimizer step is the peak
    report = remat.estimate(model, x, loss=_loss, optimizer="adamw", configs=("none",))
    with remat.track() as t:
        model, x = _on(test_device, batch=16)
        _adamw_loop(model, x, torch.optim.AdamW(model.parameters()))
    row = report["none"]
    assert row.peak_phase == "optimizer step"
    assert abs(row.peak_bytes / t.peak(test_device) - 1) < 0.05, (row.peak_bytes, t.peak(test_device))
    on_cpu = remat.estimate(_on("cpu", batch=16)[0], x.cpu(), loss=_loss, optimizer="adamw", configs=("none",))
    assert row.peak_bytes - on_cpu["none"].peak_bytes >= row.params_bytes // 2  # the foreach temporary
    explicit = remat.estimate(model, x, loss=_loss, configs=("none",),
                              optimizer=lambda params: torch.optim.AdamW(params, foreach=False))
    # an explicit choice is honoured (the bytes apart: AdamW's step counters stay on the host)
    assert abs(explicit["none"].peak_bytes - on_cpu["none"].peak_bytes) < 1024


@contextlib.contextmanager
def _device_of(size: int | None) -> Iterator[Callable[[], int]]:
    """The Python device as a device of ``size`` bytes for its allocator model (cached segments given back before it
    reserves past it, as CUDA's allocator does): yields what it has reserved at most since, above what it held."""
    import pydevice

    device = pydevice.DEVICE
    device.empty_cache()
    device.reset_peak_memory_stats()
    held = device.memory_reserved()
    device.set_memory_limit(None if size is None else size + held)
    try:
        yield lambda: device.max_memory_reserved() - held
    finally:
        device.set_memory_limit(None)


def _full_loop_fits(device: str, memory: int) -> bool:
    """Whether full remat's loop fits a device of ``memory``: its tensors (`track(limit=)`) and what its allocator
    reserves."""
    try:
        with _device_of(memory) as reserved, remat.track(limit=memory):
            model, x = _on(device)
            _adamw_loop(remat.apply(model), x, torch.optim.AdamW(model.parameters()))
    except torch.OutOfMemoryError:
        return False
    return reserved() <= memory


@pytest.mark.slow  # a sweep of memory= with three AdamW steps each: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.parametrize("fraction", [0.6, 0.7, 0.8, 0.9])
def test_memory_plan_and_three_adamw_steps_fit_a_device_of_that_memory(test_device: str, fraction: float) -> None:
    """`apply(memory=M)` on a device, then the default AdamW loop, all on a device of M: its tensors under
    `track(limit=M)`, and what its allocator reserves (the model of CUDA's caching allocator of tests/pydevice.py,
    which reserves more than the tensors take) within M. Or `apply` refuses, and full remat's loop does not fit M
    either (a true refusal), or does only without the allocator's headroom (NOTE [ The allocator's reserve ])."""
    with _device_of(None) as reserved:
        model, x = _on(test_device)
        _adamw_loop(model, x, torch.optim.AdamW(model.parameters()))
        del model, x
    memory = int(fraction * reserved())  # of what the loop without remat holds on the device
    before = recomputes()
    try:
        with _device_of(memory) as reserved, remat.track(limit=memory) as tracked:
            model, x = _on(test_device)
            optimizer = torch.optim.AdamW(model.parameters())
            remat.apply(model, memory=memory, sample=x, loss=_loss, optimizer=optimizer)
            _adamw_loop(model, x, optimizer)
            del model, x, optimizer
    except remat.BudgetError as error:
        assert error.least_bytes is not None and error.least_bytes > memory
        if _full_loop_fits(test_device, memory):
            assert "allocator" in str(error)  # full remat fits only without the headroom it is refused for
            assert not _full_loop_fits(test_device, int(memory * (1 - DEFAULT)))
        return
    assert tracked.peak(test_device) <= memory and reserved() <= memory, (tracked.peak(test_device), reserved())
    assert recomputes() > before


def test_the_device_model_reserves_as_a_caching_allocator(test_device: str) -> None:
    """The allocator model of tests/pydevice.py: blocks rounded to 512 bytes in 2 MiB segments (20 MiB above 1 MiB),
    freed blocks cached, `empty_cache` gives back what holds nothing."""
    import pydevice

    device = pydevice.DEVICE
    device.empty_cache()
    start = device.memory_reserved(), device.memory_allocated()
    small = torch.empty(250, device=test_device)  # 1000 bytes: one 1024-byte block of a new 2 MiB segment
    assert device.memory_allocated() - start[1] == 1024 and device.memory_reserved() - start[0] == 2 << 20
    large = torch.empty(3 << 18, device=test_device)  # 3 MiB: a 20 MiB segment
    assert device.memory_reserved() - start[0] == 22 << 20
    del small, large
    assert device.memory_allocated() == start[1] and device.memory_reserved() - start[0] == 22 << 20  # cached
    device.empty_cache()
    assert device.memory_reserved() == start[0]


def test_headroom_arguments() -> None:
    x = torch.randn(8, WIDTH)
    with pytest.raises(ValueError, match="`headroom` goes with `memory=`"):
        remat.apply(_model(), budget=0.5, sample=x, headroom=0.1)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        remat.apply(_model(), memory="1GiB", sample=x, loss=_loss, optimizer="sgd", headroom=1.5)
    with pytest.raises(ValueError, match="leaves nothing"):
        remat.apply(_model(), memory="1MiB", sample=x, loss=_loss, optimizer="sgd", headroom="2MiB")
    with pytest.raises(remat.BudgetError, match="left to the allocator") as info:  # the CPU's default is none
        full, _ = _real_step(remat.apply(_model(), policy=None), x)
        remat.apply(_model(), memory=full, sample=x, loss=_loss, optimizer="adamw", headroom=0.5)
    assert info.value.least_bytes is not None and info.value.least_bytes > full


def test_the_largest_batch_leaves_the_allocator_its_headroom(test_device: str) -> None:
    model, x = _on(test_device, batch=64)
    memory = 80 << 20
    kept = remat.estimate(model, x, loss=_loss, optimizer="adamw", configs=("none",), memory=memory, batch_dim=0)
    bare = remat.estimate(model, x, loss=_loss, optimizer="adamw", configs=("none",), memory=memory, batch_dim=0,
                          headroom=0)
    assert kept.headroom == memory // 10 and bare.headroom == 0
    assert "(8.00 MiB left to the allocator)" in str(kept)
    batch = kept["none"].largest_batch
    assert batch is not None and 0 < batch < bare["none"].largest_batch  # type: ignore[operator]
    fits = remat.estimate(model, torch.randn(batch, x.shape[1]).to(test_device), loss=_loss, optimizer="adamw",
                          configs=("none",))
    assert fits["none"].peak_bytes <= memory - kept.headroom


# -- the largest batch -----------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["none", "full"])
def test_largest_batch_runs_within_memory_and_the_next_does_not(config: str) -> None:
    memory = 1_500_000
    report = remat.estimate(_model(), torch.randn(4, WIDTH), loss=_loss, optimizer="adamw", configs=(config,),
                            memory=memory, batch_dim=0)
    batch = report[config].largest_batch
    assert batch is not None and batch > 4
    assert report.memory == memory and "largest batch" in str(report)

    def measured(n: int) -> int:
        model = _model() if config == "none" else remat.apply(_model(), policy=None)
        with remat.enabled(config != "none"):
            return _real_step(model, torch.randn(n, WIDTH))[0]

    assert measured(batch) <= memory < measured(batch + 1)


def test_largest_sequence_along_seq_dim() -> None:
    memory = 1_500_000
    report = remat.estimate(_model(), torch.randn(2, 8, WIDTH), loss=_loss, optimizer="adamw", configs=("none",),
                            memory=memory, batch_dim=0, seq_dim=1)
    row = report["none"]
    assert row.largest_batch is not None and row.largest_seq is not None
    seq = row.largest_seq
    assert _real_step(_model(), torch.randn(2, seq, WIDTH))[0] <= memory < _real_step(
        _model(), torch.randn(2, seq + 1, WIDTH))[0]


def test_search_arguments() -> None:
    x = torch.randn(4, WIDTH)
    with pytest.raises(ValueError, match="batch_dim"):
        remat.estimate(_model(), x, loss=_loss, configs=("none",), memory="1MiB")
    with pytest.raises(ValueError, match="go with `memory=`"):
        remat.estimate(_model(), x, loss=_loss, configs=("none",), batch_dim=0)
    with pytest.raises(ValueError, match="dimension"):
        remat.estimate(_model(), x, loss=_loss, configs=("none",), memory="1MiB", batch_dim=3)


def test_a_budget_that_cannot_be_met_is_a_refused_row() -> None:
    """The default configurations include a budget (0.3 of no remat's peak); where no plan meets it, the estimate
    still answers, with that row refused (and its largest batch searched below the sample's)."""
    report = remat.estimate(_model(depth=2), torch.randn(4, WIDTH), loss=_loss, optimizer="adamw",
                            memory="64KiB", batch_dim=0)
    row = report[0.3]
    assert row.refused is not None and "smallest feasible budget" in row.refused
    assert row.least_bytes is not None and row.least_bytes > 0 and row.peak_bytes == 0
    assert row.params_bytes == report["none"].params_bytes and row.optimizer_bytes == report["none"].optimizer_bytes
    assert row.largest_batch is not None and report["none"].refused is None
    text = str(report)
    assert "budget 0.3: refused on this sample" in text and report.to_dict()["configs"][3]["refused"] == row.refused


# -- where the step peaks ------------------------------------------------------------------------


class _Wide(nn.Module):
    """One big layer among small ones: its parameters, gradients and Adam state dominate the optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(WIDTH, WIDTH)
        self.big = nn.Linear(WIDTH, 64 * WIDTH)
        self.out = nn.Linear(64 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> Any:
        return self.out(self.big(self.small(x)).relu())


def test_phase_and_holders_when_the_optimizer_step_dominates() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, WIDTH)
    report = remat.estimate(_Wide(), x, loss=_loss, optimizer="adam", configs=("none",))
    row = report["none"]
    _, measured = _real_step(_Wide(), x, optimizer="adam")
    assert max(measured, key=lambda phase: measured[phase]) == "optimizer step" == row.peak_phase
    assert [name for name, _ in row.holders[:2]] in (["big", "out"], ["out", "big"])
    assert row.holders[0][1] > 10 * dict(row.holders).get("small", 0)
    assert "optimizer step sets the peak under every configuration" in str(report)
    for phase, n in measured.items():
        assert abs(row.phase_bytes[phase] / n - 1) < 0.05, (phase, row.phase_bytes[phase], n)


def test_phase_and_holders_when_activations_dominate() -> None:
    x = torch.randn(4096, WIDTH)
    report = remat.estimate(_model(), x, loss=_loss, optimizer="adamw", configs=("none",))
    row = report["none"]
    _, measured = _real_step(_model(), x)
    assert max(measured, key=lambda phase: measured[phase]) == row.peak_phase != "optimizer step"
    assert row.holders[0][0].startswith("*.")  # activations of the blocks, folded


@pytest.mark.slow  # largest-batch bisections: NOTE [ Slow tests ] in tests/conftest.py
def test_cli_prints_the_largest_batch(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from remat.__main__ import main

    assert main(["estimate", "--hf", "llama", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8",
                 "--optimizer", "sgd", "--memory", "64MiB", "--largest-seq"]) == 0
    out = capsys.readouterr().out
    # the configurations of long sequences: none, full, save_matmuls, full+head, full+head+tiles (offload on an
    # accelerator only)
    assert out.count("largest batch that fits in 64.00 MiB") == 5, out
    assert out.count("sequence length") == 5 and "full+head+tiles: largest batch" in out, out
    with pytest.raises(SystemExit):
        main(["estimate", "--memory", "64MiB"])  # the benchmark's models: --hf only


@pytest.mark.slow  # estimates at several sizes: NOTE [ Slow tests ] in tests/conftest.py
def test_cli_says_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    """Where not one sample fits, each configuration says so, with its peak (it printed "largest batch that fits
    in 1.00 KiB: 0, sequence length 0")."""
    pytest.importorskip("transformers")
    from remat.__main__ import main

    assert main(["estimate", "--hf", "llama", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8",
                 "--optimizer", "sgd", "--memory", "1KiB", "--largest-seq"]) == 0
    out = capsys.readouterr().out
    assert out.count("nothing fits in 1.00 KiB, not even a batch of 1 (its device peak at the sample: ") == 5, out
    assert "largest batch" not in out, out


def test_a_memory_the_allocators_segments_outweigh_is_refused_naming_a_total_that_fits(
        test_device: str, caplog: pytest.LogCaptureFixture) -> None:
    """A small model's step reserves a whole segment more than a memory just above full remat's estimate: `apply`
    refuses without a warning of a plan below full remat's own peak (which it would not make), and the least total
    it names is at most what full remat's loop reserves, and fits."""
    with _device_of(None) as reserved:
        model, x = _on(test_device, width=64, batch=256)
        _adamw_loop(remat.apply(model), x, torch.optim.AdamW(model.parameters()))
        full_loop = reserved()
        del model, x
    model, x = _on(test_device, width=64, batch=256)
    row = remat.estimate(model, x, loss=_loss, configs=("full",), device=test_device)["full"]
    memory = int(1.15 * row.peak_bytes / (1 - DEFAULT))
    with caplog.at_level(logging.WARNING, logger="remat"), pytest.raises(remat.BudgetError) as refused:
        remat.apply(model, memory=memory, sample=x, loss=_loss)
    assert not [record for record in caplog.records if "planning again" in record.getMessage()]
    least = refused.value.least_bytes
    assert least is not None and memory < least <= full_loop, (memory, least, full_loop)
    before = recomputes()
    with _device_of(least) as reserved:
        optimizer = torch.optim.AdamW(model.parameters())
        remat.apply(model, memory=least, sample=x, loss=_loss, optimizer=optimizer)
        _adamw_loop(model, x, optimizer)
        assert reserved() <= least
    assert recomputes() > before
    del model, x, optimizer


class _Tabled(nn.Module):
    """Blocks behind a large table the step only reads (as GPT-Neo's and GPT-BigCode's causal masks are kept) and a
    BatchNorm whose statistics the step writes."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("table", torch.ones(4096, 4096, dtype=torch.bool))  # 16 MiB
        self.norm = nn.BatchNorm1d(width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                    nn.Linear(4 * width, width)) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.norm(x) * self.table[: x.shape[0], :1].to(x.dtype))


def test_applys_own_peak_holds_no_copy_of_a_buffer_its_steps_only_read() -> None:
    """`apply(memory=M)` at the least M its plan fits: its own real steps (the plan's check) stay within M, but for
    the copies of the BatchNorm statistics they write (put back after), with no copy of the table they only read
    (NOTE [ Buffers a measured step writes ] in remat/_measure/state.py)."""
    model, x = _Tabled(), torch.randn(2048, 64)
    memory = remat.estimate(model, x, loss=_loss, configs=("full",))["full"].peak_bytes
    state = _bytes([*model.parameters(), *model.buffers(), x])
    written = _bytes(list(model.norm.buffers()))
    before = [b.clone() for b in model.buffers()]
    with remat.track() as tracked:
        remat.apply(model, memory=memory, sample=x, loss=_loss)
    assert state + tracked.peak_bytes <= memory + written, (state + tracked.peak_bytes, memory)
    assert all(torch.equal(b, old) for b, old in zip(model.buffers(), before, strict=True))
    assert sum(site.choice != "kept" for site in remat.plan(model)) > 0  # remat was active
