"""`remat.estimate` (docs/guides/estimate.md): predictions against real tracked steps, exact state bytes, fake-only
runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from benchmarks.estimate import check, measure_step
from remat._demo import ConvNetConfig, GPTConfig
from remat._estimate.constants import cublas_workspace
from remat._estimate_cli import Case, bench_case, hf_case
from remat._measure.fake import FakeTracker, allocator_bytes, fake_mode, storage_bytes

TINY_GPT = GPTConfig(blocks=3, d=32, heads=2, seq=16, batch=2, vocab=64)
TINY_CONVNET = ConvNetConfig(width=4, blocks_per_stage=1, image=8, batch=4)


def _stack(width: int = 32, depth: int = 4, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        blocks = [nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                  for _ in range(depth)]
    return nn.Sequential(*blocks).to(dtype)


def _assert_close(predicted: int, measured: int, what: str) -> None:
    assert abs(predicted / measured - 1) < 0.05, f"{what}: predicted {predicted}, measured {measured}"


# -- predicted against measured ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt", "convnet"])
def test_prediction_within_five_percent_of_a_real_step_per_config(name: str) -> None:
    def build() -> Case:
        return bench_case(name, config=TINY_GPT if name == "gpt" else TINY_CONVNET)

    configs = ("none", "full", "save_matmuls", remat.policies.save_matmuls)
    rows = check(build(), build, configs=configs, optimizer="adamw")
    assert len(rows) == 4
    for row in rows:
        assert row.predicted.grads_bytes == row.measured.grads_bytes
        assert row.predicted.optimizer_bytes == row.measured.optimizer_bytes
        _assert_close(row.predicted.peak_bytes, row.measured.peak_bytes, f"{name} {row.config} peak")
        _assert_close(row.predicted.activation_bytes, row.measured.activation_bytes, f"{name} {row.config} held")
    # The configurations differ in the real tracked steps, as they should (remat was on where it should be), so
    # the predictions above were checked against steps that differ too.
    none, full = rows[0].measured, rows[1].measured
    assert full.activation_bytes < none.activation_bytes / 2


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_budget_configuration_predicted_against_its_real_step() -> None:
    """The real step plans on its own (timed) profile and may pick other blocks; both fit, peaks agree."""

    def build() -> Case:
        return bench_case("gpt", config=TINY_GPT)

    none, full, budget = check(build(), build, configs=("none", "full", 0.9), optimizer="sgd")
    assert budget.config == "budget 0.9"
    for side in ("predicted", "measured"):  # whichever blocks each plan picked (their times may differ)
        peaks = [getattr(row, side).peak_bytes for row in (full, budget, none)]
        assert peaks == sorted(peaks), f"{side}: full, budget, none peaks {peaks}"
    assert budget.measured.activation_bytes < none.measured.activation_bytes


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.parametrize("kind", ["gpt2", "t5", "bert"])
def test_prediction_for_a_transformers_model(kind: str) -> None:
    pytest.importorskip("transformers")

    def build() -> Case:
        return hf_case(kind, tiny=True, seq=16, batch=2, device="cpu")

    for row in check(build(), build, configs=("none", "full"), optimizer="sgd"):
        assert row.predicted.optimizer_bytes == row.measured.optimizer_bytes
        _assert_close(row.predicted.peak_bytes, row.measured.peak_bytes, f"{kind} {row.config} peak")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models(dtype: torch.dtype) -> None:
    model = _stack(dtype=dtype)
    x = torch.randn(16, 32, dtype=dtype)
    report = remat.estimate(model, x, optimizer="adamw", configs=("none", "full"))
    assert report["none"].params_bytes == sum(p.numel() for p in model.parameters()) * 2
    both = remat.estimate(model, x, loss=lambda out: out.float().sum(), optimizer="adamw", configs=("none", "full"))
    for config in ("none", "full"):
        measured = measure_step(Case("stack", model, (x,), lambda out: out.float().sum()), config)
        assert both[config].activation_bytes == measured.activation_bytes
        assert both[config].peak_bytes == measured.peak_bytes
        assert both[config].grads_bytes == measured.grads_bytes
    assert report["full"].activation_bytes < report["none"].activation_bytes


def test_mixed_precision_under_autocast() -> None:
    model = _stack()
    x = torch.randn(16, 32)
    case = Case("stack", model, (x,), lambda out: out.float().sum())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        predicted = remat.estimate(model, x, loss=case.loss, optimizer="adam", configs=("none", "full"))
    for config in ("none", "full"):  # each real step in its own region, as the estimate's (the AMP recipe)
        measured = measure_step(case, config, optimizer="adam",
                                autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        assert predicted[config].activation_bytes == measured.activation_bytes
        _assert_close(predicted[config].peak_bytes, measured.peak_bytes, config)
    plain = remat.estimate(model, x, loss=case.loss, configs=("none",))
    # autocast changes what is held (bfloat16 activations, and its cache of bfloat16 weight copies)
    assert predicted["none"].activation_bytes != plain["none"].activation_bytes


# -- exact state ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("optimizer", "moments", "steps"),
    [(None, 0, 0), ("sgd", 1, 0), ("adam", 2, 1), ("adamw", 2, 1),
     (lambda ps: torch.optim.Adam(ps, amsgrad=True), 3, 1), (torch.optim.SGD, 0, 0)],
)
def test_params_grads_and_optimizer_state_are_exact(optimizer: object, moments: int, steps: int) -> None:
    model = _stack()
    frozen = model[0][0]
    frozen.weight.requires_grad_(False)  # no gradient, no optimizer state
    report = remat.estimate(model, torch.randn(8, 32), optimizer=optimizer, configs=("none",))  # type: ignore[arg-type]
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    trainable = [p for p in params if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    row = report["none"]
    assert row.params_bytes == param_bytes
    assert row.grads_bytes == trainable_bytes
    assert row.optimizer_bytes == moments * trainable_bytes + steps * 4 * len(trainable)
    assert row.peak_bytes >= row.params_bytes + row.optimizer_bytes + row.grads_bytes


def test_tied_weights_count_once() -> None:
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50, bias=False))
    model[1].weight = model[0].weight
    report = remat.estimate(model, torch.randint(0, 50, (4, 8)), optimizer="adam", configs=("none",))
    assert report["none"].params_bytes == report["none"].grads_bytes == 50 * 16 * 4
    assert model[1].weight is model[0].weight


# -- meta models, devices, the allocator ----------------------------------------------------------


def test_meta_model_estimates_like_the_real_one() -> None:
    real = remat.estimate(_stack(), torch.randn(8, 32), optimizer="adamw", configs=("none", "full"),)
    meta = remat.estimate(_stack(device="meta"), torch.randn(8, 32, device="meta"), optimizer="adamw",
                          configs=("none", "full"))
    assert meta.device == real.device == "cpu"
    assert meta.to_dict() == real.to_dict()


def test_no_real_allocation_during_an_estimate() -> None:
    # 8 blocks of two 2048 x 4096 weights: 512 MiB of float32 parameters, over 2 GiB for a real AdamW step.
    model = _stack(width=2048, depth=8, device="meta")
    with remat.track() as t:
        report = remat.estimate(model, torch.randn(64, 2048, device="meta"), optimizer="adamw",
                                configs=("none", "full"))
    assert report["none"].peak_bytes > 2 * 2**30
    assert t.peak("cpu") < 2**20  # fake storages count on "meta" for a plain tracker; real ones on "cpu"
    assert t.peak("meta") > 2**31  # ...and it did see the fake ones: the check can fail


def test_cuda_rounds_every_tensor_to_512_byte_blocks() -> None:
    assert [allocator_bytes(n, torch.device("cuda")) for n in (0, 1, 511, 512, 513, 2**20 + 1)] == [
        0, 512, 512, 512, 1024, 2**20 + 512]
    assert allocator_bytes(513, torch.device("cpu")) == 513
    cuda = torch.device("cuda", 0)
    with fake_mode(), FakeTracker() as t:  # fake CUDA tensors need no CUDA, as long as autograd stays out
        a = torch.empty(3, device="cuda")  # 12 bytes: one 512-byte block
        b = torch.empty(200, device="cuda")  # 800 bytes: two blocks
        c = torch.empty(10)  # on the CPU: 40 bytes, not rounded
        assert (t.current(cuda), t.current("cpu")) == (512 + 1024, 40)
        assert storage_bytes([a, b, c], cuda) == 1536 and storage_bytes([a, b, c]) == 852
        del a
        assert t.current(cuda) == 1024
    assert t.peak(cuda) == 1536


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="this torch has CUDA support")
def test_cuda_prediction_needs_a_cuda_build_of_torch() -> None:
    with pytest.raises(remat.RematError, match="cannot predict for `cuda:0` with this build of torch"):
        remat.estimate(_stack(), torch.randn(8, 32), device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")
def test_cuda_prediction_without_a_gpu_rounds_to_blocks() -> None:
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])  # 36- and 12-byte tensors
    x = torch.randn(5, 3)
    cpu = remat.estimate(model, x, optimizer="sgd", configs=("none",))["none"]
    cuda = remat.estimate(model, x, optimizer="sgd", configs=("none",), device="cuda")
    row = cuda["none"]
    assert cuda.device == "cuda:0" and "max_memory_allocated" in str(cuda)
    assert (row.params_bytes, row.grads_bytes, row.optimizer_bytes) == (
        cpu.params_bytes, cpu.grads_bytes, cpu.optimizer_bytes)  # exact tensor bytes
    assert row.peak_bytes % 512 == 0
    assert row.peak_bytes >= (8 + 8 + 1 + 8) * 512 > cpu.peak_bytes  # params, momenta, input, grads


@pytest.mark.cuda
@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")
def test_cuda_prediction_of_a_training_step_without_a_gpu() -> None:
    """With a CUDA build and no GPU, the CUDA step runs on the CPU standing in (NOTE [ CUDA without a GPU ]): AdamW's
    foreach temporaries, CUDA's blocks and the cuBLAS workspaces counted; with a GPU, on fake CUDA tensors."""
    model, x = _stack(width=64, depth=4), torch.randn(512, 64)
    configs = ("none", "full", 0.7)
    cpu = remat.estimate(model, x, optimizer="adamw", configs=configs)
    cuda = remat.estimate(model, x, optimizer="adamw", configs=configs, device="cuda")
    assert cuda.device == "cuda:0" and not remat.plan(model)
    for config in configs:
        row = cuda[config]
        assert row.constant_bytes == 2 * cublas_workspace(None if not torch.cuda.is_available() else
                                                          torch.cuda.get_device_capability(0))
        assert row.peak_bytes % 512 == 0 and row.refused is None
        assert row.phase_bytes["optimizer step"] - row.constant_bytes >= (
            cpu[config].phase_bytes["optimizer step"] + row.params_bytes // 2)  # foreach's temporary, on CUDA
    assert cuda["full"].activation_bytes < cuda["none"].activation_bytes
    with torch.autocast("cpu", dtype=torch.bfloat16):  # on the CPU standing in, CPU autocast stands for CUDA's
        bf16 = remat.estimate(model, x, optimizer="adamw", configs=("none",), device="cuda")
    if not torch.cuda.is_available():
        assert bf16["none"].activation_bytes < cuda["none"].activation_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prediction_matches_max_memory_allocated() -> None:
    model = _stack(width=256, depth=4).cuda()
    x = torch.randn(64, 256, device="cuda")
    for config in ("none", "full"):
        predicted = remat.estimate(model, x, optimizer="adamw", configs=(config,))[config]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        measured = measure_step(Case("stack", model, (x,), lambda out: out.sum()), config)
        torch.cuda.synchronize()
        assert before > 0 and measured.peak_bytes > 0
        _assert_close(predicted.peak_bytes, torch.cuda.max_memory_allocated(), config)


# -- errors and the user's model -------------------------------------------------------------------


class _Selecting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(x)
        return h[h > 0]  # boolean indexing: a shape that depends on the values


class _Reading(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(x)
        return h * float(h.max().item())


@pytest.mark.parametrize(("model", "op"), [(_Selecting(), "aten.nonzero"), (_Reading(), "_local_scalar_dense")])
def test_data_dependent_ops_raise_a_clear_error(model: nn.Module, op: str) -> None:
    params = list(model.parameters())
    with pytest.raises(remat.RematError, match=rf"^remat: estimate cannot run `{type(model).__name__}`.*{op}.*"
                       r"measure a real run"):
        remat.estimate(model, torch.randn(4, 8), optimizer="adam", configs=("none",))
    assert list(model.parameters()) == params and all(type(p) is nn.Parameter for p in params)


@torch.library.custom_op("remat_test::picky", mutates_args=())
def _picky(x: torch.Tensor) -> torch.Tensor:
    """A kernel whose fake kernel refuses what the real one runs, as torch's `aten._grouped_mm` refuses float32."""
    return x.sin()


@_picky.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("Expected inputs of BF16 type")


_picky.register_autograd(lambda ctx, grad: grad * ctx.x.cos(),
                         setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]))


class _Picky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = _picky(block(x))
        return x


def test_an_op_whose_fake_kernel_refuses_says_it_ran_on_fake_tensors() -> None:
    """The error is torch's own, with a note that it came from fake tensors and what that can mean; the real step
    runs. Before, a MoE model's `estimate` or `apply(budget=)` on the CPU ended in a bare `aten._grouped_mm` error."""
    _Picky()(torch.randn(4, 8)).sum().backward()  # the real kernel runs
    with pytest.raises(RuntimeError, match="BF16") as raised:
        remat.estimate(_Picky(), torch.randn(4, 8), configs=("none",))
    assert "remat: raised while remat.estimate ran `_Picky` on fake tensors" in "".join(raised.value.__notes__)
    with pytest.raises(RuntimeError, match="BF16") as raised:
        remat.apply(_Picky(), budget=0.5, sample=torch.randn(4, 8))
    assert "remat: raised while the budget's profile ran `_Picky` on fake tensors" in "".join(raised.value.__notes__)


def test_the_users_model_is_left_as_it_was() -> None:
    model = _stack()
    remat.remat(model[1], policy=remat.policies.save_matmuls)  # the user's own site
    seen: list[int] = []
    handle = model[2].register_forward_hook(lambda module, args, out: seen.append(1))
    params = {name: p for name, p in model.named_parameters()}
    tables = {name: {key: dict(getattr(m, key)) for key in ("_forward_pre_hooks", "_forward_hooks")}
              for name, m in model.named_modules()}
    names = {name: set(vars(m)) for name, m in model.named_modules()}
    plan = str(remat.plan(model))
    remat.estimate(model, torch.randn(8, 32), optimizer="adamw", configs=("none", "full", "save_matmuls"))
    assert seen == [1, 1, 1]  # the user's hook ran once per configuration and is still there
    assert {name: p for name, p in model.named_parameters()} == params
    assert all(p.grad is None and type(p) is nn.Parameter for p in model.parameters())
    assert {name: {key: dict(getattr(m, key)) for key in ("_forward_pre_hooks", "_forward_hooks")}
            for name, m in model.named_modules()} == tables
    assert {name: set(vars(m)) for name, m in model.named_modules()} == names
    assert str(remat.plan(model)) == plan
    handle.remove()


def test_none_switches_sites_off_and_full_runs_even_when_remat_is_off() -> None:
    model = remat.apply(_stack())
    with remat.enabled(False):
        report = remat.estimate(model, torch.randn(8, 32), configs=("none", "full"))
    assert report["full"].activation_bytes < report["none"].activation_bytes
    assert len(remat.plan(model)) == 4  # the user's sites survive


def test_a_budget_configuration_uses_the_planner() -> None:
    model = _stack()
    report = remat.estimate(model, torch.randn(256, 32), configs=("none", "full", 0.9))
    assert report["full"].activation_bytes < report[0.9].activation_bytes < report["none"].activation_bytes
    assert report[0.9].label == "budget 0.9"
    assert not remat.plan(model)  # the planned sites are gone again
    from remat._budget import regimes as _regimes

    checked: list[int] = []
    real = _regimes.verify

    def spy(assignment: Any, measure: Any, place: Any, *slack: Any) -> Any:
        checked.append(1)
        return real(assignment, measure, place, *slack)

    _regimes.verify = spy  # type: ignore[assignment]
    try:  # the assignment a real model ends with once its first step verified it: verified at once, on fake tensors
        remat.estimate(model, torch.randn(256, 32), configs=(0.9,))
    finally:
        _regimes.verify = real  # type: ignore[assignment]
    assert checked
    # the default configurations end with a budget of 0.3, which this small stack cannot meet: a refused row
    refused = remat.estimate(model, torch.randn(256, 32))[0.3]
    assert refused.refused is not None and "smallest feasible budget" in refused.refused
    assert not remat.plan(model)


def test_bad_arguments() -> None:
    model = _stack()
    with pytest.raises(ValueError, match="does not know the configuration 'ful'"):
        remat.estimate(model, torch.randn(8, 32), configs=("ful",))
    with pytest.raises(ValueError, match="`optimizer` must be one of"):
        remat.estimate(model, torch.randn(8, 32), optimizer="lion")
    with pytest.raises(ValueError, match="found no blocks"):
        remat.estimate(nn.Linear(2, 2), torch.randn(1, 2), configs=("full",))
    with pytest.raises(TypeError, match="expects an nn\\.Module"):
        remat.estimate(lambda x: x, torch.randn(1))  # type: ignore[arg-type]


def test_report_table_lookup_and_dict() -> None:
    model = _stack()
    report = remat.estimate(model, torch.randn(8, 32), optimizer="adamw",
                            configs=("none", remat.policies.save_matmuls))
    lines = str(report).splitlines()
    assert lines[0] == "remat.estimate: Sequential, one training step (optimizer step AdamW), predicted for cpu"
    assert lines[1].split() == ["config", "params", "grads", "optimizer", "held", "for", "backward", "step", "peak",
                                "device", "peak", "peaks", "in"]
    phases = ["peaks in", *(row.peak_phase for row in report)]
    assert len({len(line) - len(phase) for line, phase in zip(lines[1:4], phases, strict=True)}) == 1  # aligned
    assert report[remat.policies.save_matmuls] is report["matmuls"] is report.rows[1]
    assert report.to_dict()["configs"][0]["config"] == "none"
    assert set(report.to_dict()["configs"][1]) >= {"params_bytes", "grads_bytes", "optimizer_bytes",
                                                   "activation_bytes", "peak_bytes"}
    with pytest.raises(KeyError, match="no configuration 'full'"):
        report["full"]
    assert remat.remat.estimate is remat.estimate


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5", "bert"])
def test_cli_prints_the_table(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from remat.__main__ import main
    from remat._estimate_cli import HF_KINDS

    assert kind in HF_KINDS
    assert main(["estimate", "--hf", kind, "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8",
                 "--dtype", "bfloat16", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "(1 layers" in out and "predicted for cpu" in out
    assert out.count("iB") >= 10


def test_loss_default_uses_the_outputs_loss_or_sums_floats() -> None:
    model = _stack()
    x = torch.randn(8, 32)
    default = remat.estimate(model, x, configs=("none",))["none"]
    explicit = remat.estimate(model, x, loss=lambda out: out.sum(), configs=("none",))["none"]
    assert default == explicit
    with pytest.raises(ValueError, match="one-element tensor"):
        remat.estimate(model, x, loss=lambda out: out, configs=("none",))


def test_a_peak_at_the_optimizer_step_is_exact_for_every_configuration() -> None:
    # Large weights, a tiny batch: the peak is Adam's step (its temporaries on top of params, grads and state),
    # which runs once and is reused for the other configurations (NOTE [ One optimizer step ]).
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)])
    x = torch.randn(2, 256)
    configs = ("none", "full", "save_matmuls")
    report = remat.estimate(model, x, optimizer="adam", configs=configs)
    for config in configs:
        row = report[config]
        measured = measure_step(Case("stack", model, (x,), lambda out: out.sum()), config, optimizer="adam")
        assert row.peak_bytes == measured.peak_bytes
        assert row.peak_bytes > row.params_bytes + row.grads_bytes + row.optimizer_bytes + row.activation_bytes


def test_the_step_peak_is_one_quantity_in_the_estimate_the_plan_and_measure() -> None:
    """No remat's step peak (the most bytes live during forward and backward above the step's start, gradients
    included) reads the same in `remat.estimate`, `remat.plan` and `remat.measure`, and a fractional budget is a
    fraction of it; what is held for backward reads the same in the estimate and in measure."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.TransformerEncoderLayer(64, 4, batch_first=True) for _ in range(3)))  # the README's
    x = torch.randn(8, 32, 64)
    report = remat.estimate(model, x, optimizer="adamw", configs=("none",))
    assert str(report).splitlines()[1].split()[-6:-2] == ["step", "peak", "device", "peak"]
    assert "\nstep peak: the most bytes live during forward and backward above" in str(report)
    row = report["none"]
    measured = remat.measure(model, x)
    remat.apply(model, budget=0.5, sample=x)
    assignment = remat.plan(model).budget
    assert assignment is not None and assignment.no_remat is not None
    no_remat = assignment.no_remat[0]
    for other in (measured.peak_bytes, no_remat):
        assert abs(row.step_peak_bytes - other) <= 0.03 * other, (row.step_peak_bytes, measured.peak_bytes, no_remat)
    assert row.peak_bytes > row.step_peak_bytes + row.params_bytes + row.optimizer_bytes  # the device peak
    assert abs(row.activation_bytes - measured.held_bytes) <= 0.03 * measured.held_bytes
    assert assignment.budget == int(0.5 * no_remat)


class _Experts(nn.Module):
    """A mixture of experts' matmuls as transformers makes them: the tokens sorted by expert, one grouped matmul."""

    def __init__(self, experts: int = 4, width: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, width, hidden) / width**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, width) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor([x.shape[0] // 4 * (i + 1) for i in range(4)], dtype=torch.int32)
        h = torch._grouped_mm(x, self.up, offs=offsets).relu()
        return torch._grouped_mm(h, self.down, offs=offsets)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no grouped matmul")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_grouped_matmul_in_float_estimates_on_the_cpu_as_it_runs(dtype: torch.dtype) -> None:
    """torch's fake kernel of `aten._grouped_mm` takes bfloat16 alone (CUDA's kernel does), the CPU's float32 and
    float16 too: a MoE model of those on the CPU is estimated, every byte as a real step holds it (implementation
    note of `fake_mode` in remat/_measure/fake.py)."""
    model = nn.Sequential(_Experts(), _Experts()).to(dtype)
    x = torch.randn(256, 16, dtype=dtype, requires_grad=True)
    row = remat.estimate(model, x, loss=lambda out: out.square().mean(), configs=("none",))["none"]
    state = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), x])
    with remat.track() as tracked:
        model(x).square().mean().backward()
    assert row.peak_bytes == state + tracked.peak_bytes
