"""Shared test helpers: one comparison of remat against a no-remat float64 baseline, and a leak guard.

`assert_same_grads` is the helper every feature test uses (see tests/test_*.py): it runs the same model or
function twice from the same seeds, once as is and once through a remat variant, and compares outputs,
gradients of every input and parameter, buffers (BatchNorm statistics) and the RNG state after backward.
`assert_same_on_device` does the same for targets on the device written in Python (tests/pydevice.py, the
`test_device` fixture), where the state of every generator after backward is compared: the CPU's and each
index's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pydevice
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._engine import stats as _stats
from remat._engine.tree import map_tensors, tensors_in
from remat._sites import targets as _targets

# The switch as the environment set it (`REMAT=0` runs the whole suite with remat off: see `equivalence` below).
_SWITCH_AT_START = remat.is_enabled()

# NOTE [ Equivalence tests must fail without remat ]
# A test that compares remat with a run without remat proves something only if it fails when remat does nothing.
# Every test that calls a comparison helper (`assert_same_grads`, or the names a module lists in
# `EQUIVALENCE_HELPERS`) is marked `equivalence` at collection (others opt in with `@pytest.mark.equivalence`),
# and the helpers assert that remat recomputed. `.ci/run` runs them with `REMAT=0 REMAT_CHECK_EQUIVALENCE=1`:
# then each is a strict xfail, so one that passes with remat off fails the run, and a helper told
# `expect_recompute=False` (nothing should recompute there: the switch itself, a site with nothing to rebuild)
# skips its test. Tests that turn remat on whatever the switch says (`enabled=True`, the engine's own entry
# points) are marked `ignores_switch` and left out, as are Hypothesis tests (their examples vary).
_CHECK_EQUIVALENCE = os.environ.get("REMAT_CHECK_EQUIVALENCE", "") == "1"


# NOTE [ Slow tests ]
# 1. A test that takes seconds of its own because it starts processes (gloo or torchrun ranks, DeepSpeed, the
#    examples and `python -m remat` run as subprocesses), sweeps budgets over many models, or plans and measures
#    real training steps for more than about two seconds on two cores (budgets, tiles, the head or autocast
#    chosen by steps that run; estimates checked against real steps; the offload peaks), or runs a benchmark
#    or an exhaustive search, is marked `slow` (`@pytest.mark.slow`, or a module's `pytestmark`); nothing else
#    is. Each feature keeps a quicker test of its gradients in the README's command.
# 2. The README's test command, `python -m pytest -q`, leaves them out (pyproject's `addopts` carries
#    `-m "not slow"`), so a contributor's run stays within minutes on two cores, and says how many it left out.
# 3. CI runs them as a step of its own (`python -m pytest -q -m slow` in .ci/run), so nothing CI ran before is
#    dropped; a `-m` on the command line replaces the one in `addopts`, so the REMAT=0 check (`-m equivalence`)
#    covers the slow equivalence tests too, and `-m ""` runs the whole suite.
_SLOW = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    if _CHECK_EQUIVALENCE and _SWITCH_AT_START:
        raise pytest.UsageError("REMAT_CHECK_EQUIVALENCE=1 checks that tests fail with remat off: set REMAT=0 too.")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    slow = config.stash.get(_SLOW, 0)
    if slow and config.getoption("markexpr") == "not slow":  # NOTE [ Slow tests ], rule 2
        terminalreporter.write_line(f"{slow} slow integration tests left out (marked `slow`): "
                                    "`python -m pytest -q -m slow` runs them, `-m \"\"` the whole suite.")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, every test module) lives until the end: `gc.freeze` takes it
    out of the collector's sight, so that each `gc.collect()` a test runs (the leak and weakref tests: hundreds)
    scans what tests made, not the whole import graph again."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_SLOW] = sum(item.get_closest_marker("slow") is not None for item in items)
    # remat's public objects belong to the package (``__module__ = "remat"``), so pytest finds their examples in
    # remat/__init__.py, whichever of them a collected module happened to load: tests/test_public.py runs each once.
    public = [item for item in items if item.nodeid.startswith("remat/__init__.py::")]
    if public:
        config.hook.pytest_deselected(items=public)
        items[:] = [item for item in items if item not in public]
    for item in items:
        function = getattr(item, "function", None)
        if function is None or hasattr(function, "hypothesis") or item.get_closest_marker("ignores_switch"):
            continue
        helpers = (
            "assert_same_grads(", "assert_same_on_device(",
            *getattr(getattr(item, "module", None), "EQUIVALENCE_HELPERS", ()),
        )
        if item.get_closest_marker("equivalence") is None:
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            if any(helper in source for helper in helpers):
                item.add_marker(pytest.mark.equivalence)
        if _CHECK_EQUIVALENCE and item.get_closest_marker("equivalence") is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason="remat is off: an equivalence test must fail"))


def expect_recompute_or_skip(expect_recompute: bool) -> None:
    """Under the check that equivalence tests fail without remat, skip a comparison told nothing recomputes."""
    if _CHECK_EQUIVALENCE and not expect_recompute:
        pytest.skip("nothing should recompute here, so this comparison cannot fail with remat off")


def recomputes() -> int:
    """How many recomputes (rerun or replay) the engine has run in this process so far."""
    return _stats.recomputes


@contextlib.contextmanager
def garbage_collector_off() -> Iterator[None]:
    """Python's garbage collector off inside, on again after (whatever the body raised): what only a reference
    cycle keeps alive stays alive, so a weakref read inside tells a cycle from a tensor or model freed at once."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def randn(*shape: int, requires_grad: bool = False, seed: int = 0) -> torch.Tensor:
    """A float64 tensor from its own generator (the global RNG stays untouched)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_(requires_grad)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's store or torchrun: a fixed port fails with
    EADDRINUSE while another test run on the machine holds it (two clones, or the suite on two torch versions)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_ranks(rank: Callable[..., None], args: tuple[Any, ...], world: int, deadline_s: float) -> None:
    """Run `rank(index, *args)` in `world` processes (`torch.multiprocessing.spawn`), failing the test where they do
    not finish within `deadline_s`; a rank's exception is raised here with its traceback."""
    import torch.multiprocessing as mp

    context = mp.spawn(rank, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=1.0):  # raises ProcessRaisedException with the rank's traceback
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks did not finish within {deadline_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def run_cases(rank: int, port: int, world: int, out: str, names: list[str], run: Callable[[str], Any]) -> None:
    """One gloo rank of a multi-process test (`spawn_ranks`): each case `run(name)` in turn, its result or this
    rank's traceback saved to `out/rank{rank}.pt` (a dict by case) for the test process to read."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        results: dict[str, Any] = {}
        for name in names:
            try:
                results[name] = run(name)
            except Exception:
                results[name] = f"rank {rank}, case {name}:\n{traceback.format_exc()}"
            dist.barrier()
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def build_and_train(cases: dict[str, tuple[Callable[[], Any], Callable[..., Any]]],
                    *inputs: Any) -> Callable[[str], Any]:
    """A rank's `run` for `run_cases` over cases of `(build, train)`: `train(build(), *inputs)`."""
    return lambda name: cases[name][1](cases[name][0](), *inputs)


def ranks_results(rank: Callable[..., None], folder: Path, cases: Iterable[str], deepspeed_cases: Iterable[str],
                  world: int, deadline_s: float) -> list[dict[str, Any]]:
    """Run `rank(index, port, folder, names)` on `world` gloo ranks (`spawn_ranks`, `run_cases`) for `cases`
    (those of `deepspeed_cases` only where deepspeed is installed); each rank's results by case."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    skipped = set() if deepspeed_installed() else set(deepspeed_cases)
    spawn_ranks(rank, (free_port(), str(folder), [name for name in cases if name not in skipped]), world, deadline_s)
    return [torch.load(folder / f"rank{index}.pt", weights_only=False) for index in range(world)]


def case_results(results: list[dict[str, Any]], name: str, deepspeed_cases: Iterable[str],
                 failed: bool = False) -> list[Any]:
    """Each rank's result of case `name` (skipped where it needs deepspeed and it is absent); a rank's traceback
    fails the test unless `failed` asks for it."""
    if name in deepspeed_cases and not deepspeed_installed():
        pytest.skip("deepspeed is not installed")
    found = [result[name] for result in results]
    for got in found:
        if isinstance(got, str) and not failed:
            pytest.fail(got, pytrace=False)
    return found


def assert_full_gradients_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], step: int) -> None:
    """A step's full gradients by parameter name against a single process's (ZeRO-3 reduces them in float32)."""
    assert ours.keys() == theirs.keys()
    for param, grad in theirs.items():
        tolerance: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6} if ours[param].dtype != grad.dtype else {}
        torch.testing.assert_close(ours[param].to(grad.dtype), grad, **tolerance,
                                   msg=lambda m, p=param: f"step {step}, {p}: {m}")


def fsdp2_full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of an FSDP2 model, whole, by name."""
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}  # type: ignore[union-attr]


def zero3_full_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under DeepSpeed ZeRO-3, whole, by name."""
    from deepspeed.utils import safe_get_full_grad

    return {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}


def train_steps(model: Any, loss_of: Callable[[Any], torch.Tensor], steps: int, lr: float, phase: list[str],
                gathers: Any, backward: Callable[[torch.Tensor], Any], grads_of: Callable[[Any], dict[str, Any]],
                step: Callable[[], Any] | None = None, **counts: Callable[[], int]) -> dict[str, list[Any]]:
    """`steps` training steps of a sharded model, SGD at `lr` (or the engine's `step`): after each backward its full
    gradients (`grads_of`), the gathers a patched collective counted per phase (`phase[0]` is "forward",
    "backward" or "step" as the step runs), and how much each of `counts` grew during the step."""
    optimizer = None if step is not None else torch.optim.SGD(model.parameters(), lr=lr)
    out: dict[str, list[Any]] = {"grads": [], "gathers": [], **{name: [] for name in counts}}
    for _ in range(steps):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        gathers.clear()
        before = {name: count() for name, count in counts.items()}
        phase[0] = "forward"
        loss = loss_of(model)
        phase[0] = "backward"
        backward(loss)
        out["grads"].append(grads_of(model))
        out["gathers"].append(dict(gathers))
        for name, count in counts.items():
            out[name].append(count() - before[name])
        phase[0] = "step"
        if optimizer is not None:
            optimizer.step()
        else:
            assert step is not None
            step()
    return out


def zero3_config(batch: int, world: int, lr: float) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with every parameter partitioned (nothing persistent, prefetched or kept live), SGD, no
    gradient clipping (DeepSpeed's default clips at 1.0)."""
    return {
        "train_batch_size": batch, "train_micro_batch_size_per_gpu": batch // world, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                              "stage3_max_live_parameters": 0},
        "optimizer": {"type": "SGD", "params": {"lr": lr}}, "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }


def deepspeed_installed() -> bool:
    """Whether deepspeed imports here (its cases are skipped where it does not)."""
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


def hooks_installed() -> bool:
    """Whether any saved-tensor default hooks are on the stack right now."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def dispatch_modes() -> int:
    return int(torch._C._len_torch_dispatch_stack())


@pytest.fixture
def float64_default() -> Iterator[None]:
    """float64 as the default dtype for one test (a module opts in: `pytestmark = usefixtures(...)`)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def test_device() -> Iterator[str]:
    """The name of the device type written in Python in tests/pydevice.py (two indices, a random stream each).

    Registered on first use, once per process (it cannot be undone). Backward runs on the calling thread during
    the test: the device's guard knows index 0 only, and autograd's device threads would assert on index 1. A test
    that leaves tensors on the device fails: the tests after it read the device's memory.
    """
    import pydevice

    pydevice.register()
    before = [pydevice.DEVICE.memory_allocated(index) for index in range(pydevice.COUNT)]
    with torch.autograd.set_multithreading_enabled(False):
        yield pydevice.NAME
    after = [pydevice.DEVICE.memory_allocated(index) for index in range(pydevice.COUNT)]
    if after != before:  # a cycle not yet collected is not a leak
        gc.collect()
        after = [pydevice.DEVICE.memory_allocated(index) for index in range(pydevice.COUNT)]
    assert after == before, (
        f"the test left tensors on {pydevice.NAME}: {before} bytes allocated per index before it, {after} after "
        "(a leak, or a tensor kept past the test: the tests after it measure this device's memory)")


@pytest.fixture(
    params=[
        pytest.param("cuda", marks=(pytest.mark.cuda, pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA device"))),
        pydevice.NAME,
    ]
)
def accelerator(request: pytest.FixtureRequest) -> str:
    """A device that is not the CPU, for tests whose behaviour is device-generic: CUDA where there is a GPU (the
    `cuda` marker), and always the device of tests/pydevice.py, so that no such path goes untested without one."""
    if request.param == pydevice.NAME:
        name: str = request.getfixturevalue("test_device")
        return name
    return "cuda"


def _switches() -> dict[str, Any]:
    """torch's process-wide switches a test may flip: each must be as it was when the test ends."""
    found: dict[str, Any] = {
        "grad mode": torch.is_grad_enabled(),
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "autocast cache": torch.is_autocast_cache_enabled(),
    }
    for kind in ("cpu", "cuda"):
        found[f"{kind} autocast"] = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
    if torch.cuda.is_initialized():  # reading it would initialise CUDA
        found["CUDA sync debug mode"] = torch.cuda.get_sync_debug_mode()
    return found


_SETTERS: dict[str, Callable[[Any], None]] = {
    "grad mode": torch.set_grad_enabled,
    "default dtype": torch.set_default_dtype,
    "deterministic algorithms": torch.use_deterministic_algorithms,
    "autocast cache": torch.set_autocast_cache_enabled,
    "cpu autocast": lambda state: (torch.set_autocast_enabled("cpu", state[0]),
                                   torch.set_autocast_dtype("cpu", state[1])),
    "cuda autocast": lambda state: (torch.set_autocast_enabled("cuda", state[0]),
                                    torch.set_autocast_dtype("cuda", state[1])),
    "CUDA sync debug mode": lambda mode: torch.cuda.set_sync_debug_mode(mode),
}


@contextlib.contextmanager
def switches_kept() -> Iterator[None]:
    """Fail if torch's process-wide switches (`_switches`) differ on exit from what they were on entry, after
    putting them back: one test that leaves a switch on must not fail the tests after it."""
    switches = _switches()
    yield
    changed = {name: value for name, value in switches.items() if _switches().get(name, value) != value}
    for name, value in changed.items():
        _SETTERS[name](value)
    assert not changed, f"the test left torch's switches changed: {sorted(changed)} (restore them in `finally`)"


@pytest.fixture(autouse=True)
def _no_state_left_behind() -> Iterator[None]:
    """After every test: no saved-tensor hooks, no dispatch modes, no open module sites; switch as it was; torch's
    process-wide switches (grad mode, autocast, CUDA's sync debug mode, ...) as they were, put back if not."""
    assert not hooks_installed(), "a previous test left saved-tensor hooks installed"
    with switches_kept():
        yield
    left_hooks = hooks_installed()
    left_modes = dispatch_modes()
    left_sites = list(_targets._open_sites.stack)
    while hooks_installed():
        torch._C._autograd._pop_saved_tensors_default_hooks()
    _targets._open_sites.stack.clear()
    remat.set_enabled(_SWITCH_AT_START)
    assert not left_hooks, "the test left saved-tensor hooks installed"
    assert left_modes == 0, "the test left a dispatch mode on the stack"
    assert not left_sites, "the test left a module site open"


def loss_of(out: Any) -> torch.Tensor:
    """A scalar that depends on every floating output element with a distinct fixed weight."""
    generator = torch.Generator().manual_seed(1234)
    total = torch.zeros(())
    for tensor in tensors_in(out, []):
        if tensor.is_floating_point() and tensor.requires_grad:
            weight = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            total = total + (tensor * weight).sum()
    return total


def _fresh(inputs: Any) -> Any:
    """A copy of `inputs` with every tensor cloned as a new leaf that keeps its requires_grad."""
    return map_tensors(inputs, lambda t: t.detach().clone().requires_grad_(t.requires_grad))


class Run:
    """What one run produced: outputs, loss, gradients of inputs and parameters, buffers, RNG after."""

    def __init__(self, out: Any, loss: torch.Tensor, grads: dict[str, Any], buffers: dict[str, Any],
                 rng: torch.Tensor, target: Any) -> None:
        self.out, self.loss, self.grads, self.buffers, self.rng, self.target = (
            out, loss, grads, buffers, rng, target
        )


def run_once(
    make: Callable[[], Any],
    inputs: tuple[Any, ...],
    wrap: Callable[[Any], Callable[..., Any]],
    *,
    kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    backward: Callable[[torch.Tensor, list[torch.Tensor]], None] | None = None,
) -> Run:
    """Build the target from `seed`, call it through `wrap`, run backward, collect every gradient."""
    torch.manual_seed(seed)
    target = make()
    if isinstance(target, nn.Module):
        target = target.double()
    args, kw = _fresh(inputs), _fresh(kwargs or {})
    fn = wrap(target)
    torch.manual_seed(seed + 1)
    out = fn(*args, **kw)
    loss = loss_of(out)
    leaves = [t for t in tensors_in((args, kw), []) if t.requires_grad]
    params = dict(target.named_parameters()) if isinstance(target, nn.Module) else {}
    if loss.requires_grad:
        if backward is None:
            loss.backward()
        else:
            backward(loss, leaves + list(params.values()))
    grads: dict[str, Any] = {f"input {i}": t.grad for i, t in enumerate(leaves)}
    grads.update({f"parameter {name}": p.grad for name, p in params.items()})
    buffers = (
        {name: b.clone() for name, b in target.named_buffers()} if isinstance(target, nn.Module) else {}
    )
    return Run(out, loss.detach(), grads, buffers, torch.get_rng_state(), target)


def assert_same_grads(
    make: Callable[[], Any],
    inputs: tuple[Any, ...],
    variant: Callable[[Any], Callable[..., Any]] = remat.remat,
    *,
    kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    backward: Callable[[torch.Tensor, list[torch.Tensor]], None] | None = None,
    expect_recompute: bool = True,
) -> tuple[Run, Run]:
    """Compare a no-remat run with a remat run of the same model or function, from the same seeds.

    Args:
        make: builds the target: an `nn.Module` (made float64) or a plain function. Called once per run
            after `torch.manual_seed(seed)`, so both runs start from the same parameters.
        inputs: positional arguments; tensors anywhere inside are cloned for each run as fresh leaves that
            keep their `requires_grad`.
        variant: turns the target into the rematerialized callable (`remat`, `remat.apply(...)`, a
            `remat.checkpoint` partial, ...). The baseline calls the target as it is.
        kwargs: keyword arguments, cloned the same way.
        seed: the seed of the parameters; the call itself runs after `torch.manual_seed(seed + 1)`.
        backward: how to run backward given `(loss, leaves)`; default `loss.backward()`.
        expect_recompute: the remat run must have recomputed at least once (counted by the engine), so that
            the comparison proves remat was active; `False` for the few cases where nothing may recompute
            (nothing saved inside the site, the site switched off, no backward).

    Returns:
        The baseline run and the remat run, for further checks.

    Compares outputs (values and `requires_grad`), every input and parameter gradient, every buffer, and
    the CPU RNG state after backward, with `torch.testing.assert_close` at default tolerances.
    """
    expect_recompute_or_skip(expect_recompute)
    base = run_once(make, inputs, lambda target: target, kwargs=kwargs, seed=seed, backward=backward)
    before = _stats.recomputes
    ours = run_once(make, inputs, variant, kwargs=kwargs, seed=seed, backward=backward)
    if expect_recompute:
        assert _stats.recomputes > before, (
            "remat recomputed nothing: the comparison would pass without remat (pass expect_recompute=False "
            "where nothing should recompute)"
        )
    base_out, our_out = tensors_in(base.out, []), tensors_in(ours.out, [])
    assert len(base_out) == len(our_out), "remat changed the number of output tensors"
    for index, (expected, got) in enumerate(zip(base_out, our_out, strict=True)):
        assert got.requires_grad == expected.requires_grad, f"output {index}: requires_grad differs"
        torch.testing.assert_close(got, expected, msg=lambda m, i=index: f"output {i}: {m}")
    torch.testing.assert_close(ours.loss, base.loss)
    assert ours.grads.keys() == base.grads.keys()
    for key, expected in base.grads.items():
        got = ours.grads[key]
        assert (got is None) == (expected is None), f"{key}: gradient present in only one run"
        if expected is not None:
            torch.testing.assert_close(got, expected, msg=lambda m, k=key: f"gradient of {k}: {m}")
    assert ours.buffers.keys() == base.buffers.keys()
    for key, expected in base.buffers.items():
        torch.testing.assert_close(ours.buffers[key], expected, msg=lambda m, k=key: f"buffer {k}: {m}")
    assert torch.equal(ours.rng, base.rng), "the RNG state after backward differs from a run without remat"
    return base, ours


# -- the device written in Python (tests/pydevice.py) --------------------------------------------------------------


class DeviceRun(NamedTuple):
    """One run of `run`: outputs and gradients (on their devices), every generator after backward."""

    outs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    states: tuple[torch.Tensor, ...]  # the CPU's generator, then each index's (`pydevice.stream_states()`)
    drew: tuple[bool, ...]  # which of those generators the call and its backward moved


def run(make: Callable[[], Any], inputs: tuple[torch.Tensor, ...], wrap: Callable[[Any], Any]) -> DeviceRun:
    """Build the target from seed 0, call it through `wrap` from seed 1, back-propagate a weighted sum.

    A target that is not a module names the module whose parameters count in its attribute `module`.
    """
    torch.manual_seed(0)  # the CPU's generator and every index's
    target = make()
    args = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
    fn = wrap(target)
    torch.manual_seed(1)
    seeded = pydevice.stream_states()
    outs = tensors_in(fn(*args), [])
    weights = torch.Generator().manual_seed(1234)
    loss = torch.zeros((), dtype=torch.float64)
    for out in outs:
        if out.requires_grad:
            weight = torch.randn(out.shape, generator=weights, dtype=out.dtype).to(out.device)
            loss = loss + (out * weight).sum().cpu()
    loss.backward()
    grads: dict[str, torch.Tensor | None] = {f"input {i}": t.grad for i, t in enumerate(args) if t.requires_grad}
    module = target if isinstance(target, nn.Module) else getattr(target, "module", None)
    if module is not None:
        grads.update((f"parameter {name}", p.grad) for name, p in module.named_parameters())
    states = pydevice.stream_states()
    drew = tuple(not torch.equal(a, b) for a, b in zip(seeded, states, strict=True))
    return DeviceRun([out.detach() for out in outs], grads, states, drew)


def assert_same_on_device(
    make: Callable[[], Any],
    inputs: tuple[torch.Tensor, ...],
    variant: Callable[[Any], Any],
    *,
    expect_recompute: bool = True,
) -> tuple[DeviceRun, DeviceRun]:
    """`assert_same_grads` for the device of tests/pydevice.py (use with the `test_device` fixture).

    Runs `make()` as is and through `variant` (`run`, same seeds) and compares outputs and gradients (values
    and devices) and the state of every generator after backward, the CPU's and each index's, exactly. The
    remat run must have recomputed, unless `expect_recompute=False`.

    Returns:
        The baseline run and the remat run.
    """
    expect_recompute_or_skip(expect_recompute)
    base = run(make, inputs, lambda target: target)
    before = _stats.recomputes
    ours = run(make, inputs, variant)
    if expect_recompute:
        assert _stats.recomputes > before, "remat recomputed nothing: the comparison would pass without remat"
    assert len(ours.outs) == len(base.outs), "remat changed the number of output tensors"
    for index, (expected, got) in enumerate(zip(base.outs, ours.outs, strict=True)):
        assert got.device == expected.device, f"output {index} is on {got.device}, not {expected.device}"
        torch.testing.assert_close(got.cpu(), expected.cpu(), msg=lambda m, i=index: f"output {i}: {m}")
    assert ours.grads.keys() == base.grads.keys()
    for key, want in base.grads.items():
        have = ours.grads[key]
        assert (have is None) == (want is None), f"{key}: gradient present in only one run"
        if want is not None and have is not None:
            assert have.device == want.device, f"the gradient of {key} is on {have.device}, not {want.device}"
            torch.testing.assert_close(have.cpu(), want.cpu(), msg=lambda m, k=key: f"gradient of {k}: {m}")
    names = ("cpu", *(f"{pydevice.NAME}:{index}" for index in range(pydevice.COUNT)))
    for name, want, have in zip(names, base.states, ours.states, strict=True):
        assert torch.equal(have, want), f"the {name} generator after backward differs from a run without remat"
    return base, ours


class CountOps(TorchDispatchMode):
    """Inside the block, `count` is the number of aten calls that `which(func)` picks."""

    def __init__(self, which: Callable[[Any], Any]) -> None:
        super().__init__()
        self.which = which
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += bool(self.which(func))
        return func(*args, **(kwargs or {}))


def budget_choices(names: tuple[str, ...], policies: tuple[Any, ...], labels: tuple[str, ...]) -> Any:
    """The choices of a budget on blocks `names` (`policies`, labelled `labels`), without the recompute check, for
    tests that profile or place choices themselves."""
    from remat._budget.choices import Choices
    from remat._budget.regimes import BudgetRegime
    from remat._core.requests import BudgetRequest

    choices = Choices(names, BudgetRegime(BudgetRequest(budget=1.0, sample=(), check=False)))
    choices.policies, choices.labels = policies, labels
    return choices


def optimistic_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every choice of a budget's profile predicted to hold a tenth of what it does: a plan that fits on paper and
    not in a real step (what the budget's checks of real steps must catch)."""
    from remat._budget import driver as _fit

    real = _fit.measured_costs

    def optimistic(*args: Any, **kwargs: Any) -> Any:
        cost = real(*args, **kwargs)
        rows = tuple(
            tuple(
                None if c is None else dataclasses.replace(
                    c, held_bytes=c.held_bytes // 10, forward_peak=c.forward_peak // 10,
                    backward_peak=c.backward_peak // 10,
                )
                for c in row
            )
            for row in cost.blocks
        )
        return dataclasses.replace(cost, blocks=rows)

    monkeypatch.setattr(_fit, "measured_costs", optimistic)
