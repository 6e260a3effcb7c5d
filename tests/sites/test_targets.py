"""Every target `@remat` takes (docs/guides/sites.md): functions, methods, classes, instances, `remat.apply`, `undo`."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from conftest import assert_same_grads, randn
from models import MLP, Attention, Cell, ConvBN, TransformerBlock, Unrolled
from torch import nn

import remat
from remat._engine import stats as _stats


def recomputes() -> int:
    return _stats.recomputes


def recomputed_in_backward(module: nn.Module, x: torch.Tensor) -> int:
    """How many recomputes one forward and backward of `module` ran."""
    before = recomputes()
    module(x).sum().backward()
    return recomputes() - before


X = randn(4, 8, requires_grad=True)


def as_class(cls: type[nn.Module]) -> Callable[[nn.Module], nn.Module]:
    """A variant for `assert_same_grads`: the module the baseline's `make` built, its class switched to the
    rematerialized `cls` (a subclass of that module's class), so that only remat differs between the runs."""

    def variant(module: nn.Module) -> nn.Module:
        assert issubclass(cls, type(module))
        module.__class__ = cls
        return module

    return variant


# -- functions --------------------------------------------------------------------------------------------
def mlp_fn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """A two-layer MLP as a plain function."""
    return (F.gelu(x @ w1) * scale) @ w2


def test_bare_decorator_on_a_function_matches_baseline() -> None:
    inputs = (X, randn(8, 16, requires_grad=True, seed=1), randn(16, 8, requires_grad=True, seed=2))
    assert_same_grads(lambda: mlp_fn, inputs, remat.remat, kwargs={"scale": 0.5})


@pytest.mark.ignores_switch  # enabled=True
def test_decorator_with_options_on_a_function_matches_baseline() -> None:
    inputs = (X, randn(8, 16, requires_grad=True, seed=1), randn(16, 8, requires_grad=True, seed=2))
    with_options = remat.remat(preserve_rng=False, check=False, name="mlp", enabled=True)
    assert_same_grads(lambda: mlp_fn, inputs, with_options)


def test_decorated_function_recomputes_in_backward() -> None:
    fn = remat.remat(mlp_fn)
    before = recomputes()
    fn(X, randn(8, 16, requires_grad=True), randn(16, 8)).sum().backward()
    assert recomputes() - before == 1


def test_signature_and_metadata_are_the_originals() -> None:
    fn = remat.remat(mlp_fn)
    assert inspect.signature(fn) == inspect.signature(mlp_fn)
    assert fn.__name__ == "mlp_fn" and fn.__doc__ == mlp_fn.__doc__
    assert fn.__wrapped__ is mlp_fn  # type: ignore[attr-defined]


def test_both_import_spellings_are_the_same_decorator() -> None:
    from remat import remat as decorator

    inputs = (X, randn(8, 16, requires_grad=True, seed=1), randn(16, 8, requires_grad=True, seed=2))
    assert callable(remat)
    assert_same_grads(lambda: mlp_fn, inputs, remat)  # the package module itself
    assert_same_grads(lambda: mlp_fn, inputs, decorator)
    assert_same_grads(lambda: mlp_fn, inputs, remat(name="package"))
    assert decorator.apply is remat.apply and decorator.undo is remat.undo
    assert decorator.checkpoint is remat.checkpoint and decorator.set_enabled is remat.set_enabled


# -- methods ----------------------------------------------------------------------------------------------
class MethodForward(MLP):
    @remat.remat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class MethodHelper(MLP):
    """A non-forward method decorated with options; forward calls it with a keyword."""

    @remat.remat(name="helper")
    def hidden(self, x: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
        return torch.tanh(self.fc2(F.relu(self.fc1(x)))) + shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.hidden(x, shift=0.5) - 0.5)


@pytest.mark.parametrize("make", [MethodForward, MethodHelper])
def test_decorated_methods_match_baseline(make: type[nn.Module]) -> None:
    assert_same_grads(make, (X,), lambda module: module)  # the class itself is the variant
    torch.manual_seed(0)
    plain = MLP().double()
    torch.manual_seed(0)
    decorated = make().double()
    x1, x2 = X.detach().clone().requires_grad_(), X.detach().clone().requires_grad_()
    plain(x1).sum().backward()
    assert recomputed_in_backward(decorated, x2) == 1
    for (name, p), q in zip(plain.named_parameters(), decorated.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_method_signature_is_the_originals() -> None:
    assert inspect.signature(MethodHelper.hidden) == inspect.signature(
        MethodHelper.hidden.__wrapped__  # type: ignore[attr-defined]
    )
    assert list(inspect.signature(MethodHelper().hidden).parameters) == ["x", "shift"]


def test_static_and_class_methods() -> None:
    class Ops:
        @remat.remat
        @staticmethod
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x.sin().sin()

        @remat.remat
        @classmethod
        def thrice(cls, x: torch.Tensor) -> torch.Tensor:
            return x.sin().sin().sin()

    x = X.detach().clone().requires_grad_()
    before = recomputes()
    torch.autograd.grad((Ops.twice(x) + Ops().thrice(x)).sum(), x)
    assert recomputes() - before == 2
    expected = torch.autograd.grad((x.sin().sin() + x.sin().sin().sin()).sum(), x)
    torch.testing.assert_close(torch.autograd.grad((Ops.twice(x) + Ops.thrice(x)).sum(), x), expected)


# -- classes ----------------------------------------------------------------------------------------------
def test_class_decorator_keeps_the_class_and_matches_baseline() -> None:
    Block = remat.remat(type("Block", (TransformerBlock,), {}))
    assert isinstance(Block, type) and issubclass(Block, TransformerBlock)
    assert_same_grads(TransformerBlock, (randn(2, 5, 8, requires_grad=True),), as_class(Block))
    block = Block().double()
    assert isinstance(block, TransformerBlock)
    assert list(block.state_dict()) == list(TransformerBlock().state_dict())
    assert recomputed_in_backward(block, randn(2, 5, 8, requires_grad=True)) == 1


def test_class_decorator_with_options_and_subclassing() -> None:
    Base = remat.remat(name="base", check=False)(type("Base", (MLP,), {}))

    class Child(Base):  # type: ignore[misc, valid-type]
        pass

    assert_same_grads(MLP, (X,), as_class(Child))
    assert recomputed_in_backward(Child().double(), X.detach().clone().requires_grad_()) == 1


def test_class_pickles_by_reference() -> None:
    module = RematClass().double()
    clone = pickle.loads(pickle.dumps(module))
    assert type(clone) is RematClass
    assert recomputed_in_backward(clone, X.detach().clone().requires_grad_()) == 1


@remat.remat
class RematClass(MLP):
    pass


# -- instances --------------------------------------------------------------------------------------------
MODELS = [
    pytest.param(MLP, (randn(4, 8, requires_grad=True),), id="mlp"),
    pytest.param(ConvBN, (randn(2, 3, 5, 5, requires_grad=True),), id="conv-bn"),
    pytest.param(TransformerBlock, (randn(2, 5, 8, requires_grad=True),), id="transformer"),
    pytest.param(
        Unrolled,
        (randn(3, 2, 6, requires_grad=True), (randn(2, 6, requires_grad=True), randn(2, 6, seed=1))),
        id="lstm-cell",
    ),
]


@pytest.mark.parametrize(("make", "inputs"), MODELS)
def test_instance_matches_baseline(make: type[nn.Module], inputs: tuple[torch.Tensor, ...]) -> None:
    assert_same_grads(make, inputs, remat.remat)


@pytest.mark.parametrize(("make", "inputs"), MODELS)
def test_apply_to_submodules_matches_baseline(make: type[nn.Module], inputs: tuple[torch.Tensor, ...]) -> None:
    assert_same_grads(
        make, inputs, lambda model: remat.apply(model, lambda name, module: name.count(".") == 0 and name != ""),
        expect_recompute=make is not MLP,  # an MLP's children are Linears and activations: nothing to rebuild
    )


def test_instance_is_the_same_object_with_the_same_state() -> None:
    torch.manual_seed(0)
    model = MLP()
    keys, params = list(model.state_dict()), list(model.parameters())
    assert remat.remat(model) is model
    assert type(model) is MLP and isinstance(model, MLP)
    assert list(model.state_dict()) == keys
    assert list(model.parameters()) == params
    assert [name for name, _ in model.named_modules()] == ["", "fc1", "fc2", "fc3"]


def test_instance_keeps_user_hooks_and_runs_them_once() -> None:
    model = MLP().double()
    calls: list[str] = []
    model.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    model.register_forward_hook(lambda module, args, out: calls.append("post"))
    remat.remat(model)
    assert recomputed_in_backward(model, X.detach().clone().requires_grad_()) == 1
    assert calls == ["pre", "post"], "recompute must not run the module's hooks again"


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(torch.tanh(self.fc(x)), 0.3) * self.gain


def _scale(module: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, object]) -> object:
    return (args[0] * 1.5,), kwargs


def _exp(module: nn.Module, args: tuple[torch.Tensor, ...]) -> object:
    return (args[0].exp(),)  # its own op saves a tensor: outside the region, as outside torch's checkpoint


def _noise(module: nn.Module, args: tuple[torch.Tensor, ...]) -> object:
    return (args[0] + 0.1 * torch.randn_like(args[0]),)  # draws before the block's dropout does


def _hook_up(model: nn.Module, hook: str) -> None:
    for block in model:
        if hook == "prune":  # pruning's pre-hook sets the masked parameter on the site itself
            prune.random_unstructured(block, "gain", amount=0.5)
        elif hook == "scale":
            block.register_forward_pre_hook(_scale, with_kwargs=True)
        else:
            block.register_forward_pre_hook(_exp if hook == "exp" else _noise)


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["rerun", "replay"])
@pytest.mark.parametrize("hook", ["scale", "exp", "prune", "noise"])
def test_a_pre_hook_registered_after_the_site_is_honoured_by_recompute(hook: str, strategy: str) -> None:
    """NOTE [ Module instances ], rule 2: rerun recomputed with the arguments before a later pre-hook changed them
    (wrong gradients), from the random state before it drew (other dropout masks: the input gradient off by 1.24),
    and packed the hook's own ops as the region's (a RecomputeMismatchError)."""
    grads = []
    for rematerialized in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(Scaled(), Scaled()).double()
        if rematerialized:
            remat.apply(model, Scaled, strategy=strategy)
        torch.manual_seed(1)
        _hook_up(model, hook)  # after the sites
        x = randn(3, 8, requires_grad=True)
        before = recomputes()
        model(x).pow(2).sum().backward()
        assert (recomputes() - before == 2) is rematerialized
        grads.append([x.grad, *(p.grad for p in model.parameters())])
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_instance_with_options() -> None:
    inputs = (randn(2, 5, 8, requires_grad=True),)
    assert_same_grads(TransformerBlock, inputs, remat.remat(name="block", preserve_rng=True))


def test_rematerializing_an_instance_twice_installs_one_site() -> None:
    model = remat.remat(remat.remat(MLP().double()))
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    assert recomputed_in_backward(model, X.detach().clone().requires_grad_()) == 1


def test_instance_of_a_rematerialized_class_is_left_alone() -> None:
    module = RematClass().double()
    assert remat.remat(module) is module
    assert recomputed_in_backward(module, X.detach().clone().requires_grad_()) == 1


def _trained_copy_matches(original: nn.Module, clone: nn.Module) -> None:
    """`clone` is a rematerialized copy: one recompute, and the gradients of the same MLP without remat."""
    assert clone is not original and type(clone) is type(original)
    plain = MLP().double()
    plain.load_state_dict(original.state_dict())
    x1, x2 = X.detach().clone().requires_grad_(), X.detach().clone().requires_grad_()
    assert recomputed_in_backward(plain, x1) == 0
    assert recomputed_in_backward(clone, x2) == 1
    torch.testing.assert_close(x2.grad, x1.grad)
    for (name, p), q in zip(plain.named_parameters(), clone.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_instance_survives_deepcopy() -> None:
    model = remat.remat(MLP().double())
    _trained_copy_matches(model, copy.deepcopy(model))


def test_instance_survives_pickle() -> None:
    model = remat.remat(MLP().double())
    _trained_copy_matches(model, pickle.loads(pickle.dumps(model)))


@pytest.mark.equivalence
def test_an_instance_with_an_op_policy_survives_pickle_and_deepcopy_after_a_step() -> None:
    """A policy's per-op cache holds aten overloads, which do not pickle: it is left out and fills again."""
    model = remat.remat(MLP().double(), policy=remat.policies.save_matmuls)
    model(X.detach().clone().requires_grad_()).sum().backward()
    model.zero_grad(set_to_none=True)
    _trained_copy_matches(model, pickle.loads(pickle.dumps(model)))
    _trained_copy_matches(model, copy.deepcopy(model))


def test_instance_survives_torch_save_and_load_of_the_whole_module() -> None:
    model = remat.remat(MLP().double())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    _trained_copy_matches(model, torch.load(buffer, weights_only=False))


def test_state_dict_loads_into_a_plain_module() -> None:
    model = remat.remat(MLP().double())
    plain = MLP().double()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(plain(X), model(X))


def test_to_returns_the_same_rematerialized_object() -> None:
    model = remat.remat(MLP())
    assert model.to(torch.float64) is model
    assert model.to("cpu") is model
    assert model.fc1.weight.dtype == torch.float64
    assert recomputed_in_backward(model, X.detach().clone().requires_grad_()) == 1


def test_undo_restores_a_plain_module() -> None:
    model = remat.apply(remat.remat(MLP().double()), nn.Linear)
    assert remat.undo(model) is model
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
        assert not module._forward_hooks_always_called and not module._forward_hooks_with_kwargs
    assert recomputed_in_backward(model, X.detach().clone().requires_grad_()) == 0


def test_undo_keeps_user_hooks() -> None:
    model = MLP().double()
    calls: list[int] = []
    model.register_forward_hook(lambda module, args, out: calls.append(1))
    remat.undo(remat.remat(model))
    model(X)
    assert calls == [1]


# -- apply ------------------------------------------------------------------------------------------------
def _mlps(n: int = 3) -> nn.Sequential:
    return nn.Sequential(*[MLP() for _ in range(n)])


def test_apply_with_a_type() -> None:
    model = remat.apply(_mlps().double(), MLP)
    assert recomputed_in_backward(model, X.detach().clone().requires_grad_()) == 3
    assert_same_grads(_mlps, (X,), lambda m: remat.apply(m, MLP))


def test_apply_with_a_tuple_of_types() -> None:
    model = remat.apply(TransformerBlock().double(), (nn.LayerNorm, Attention))
    before = recomputes()
    model(randn(2, 5, 8, requires_grad=True)).sum().backward()
    assert recomputes() - before == 3  # two LayerNorms (mean, rstd) and the attention
    assert_same_grads(
        TransformerBlock, (randn(2, 5, 8, requires_grad=True),), lambda m: remat.apply(m, (nn.LayerNorm, Attention))
    )


def test_a_site_with_nothing_to_rebuild_does_not_recompute() -> None:
    model = remat.apply(MLP().double(), nn.Linear)  # a Linear saves only its input and weight: kept as they are
    assert recomputed_in_backward(model, X.detach().clone().requires_grad_()) == 0
    assert_same_grads(MLP, (X,), lambda m: remat.apply(m, nn.Linear), expect_recompute=False)


def test_apply_with_a_predicate_gets_names() -> None:
    seen: list[str] = []

    def pick(name: str, module: nn.Module) -> bool:
        seen.append(name)
        return name in ("0", "2")

    model = remat.apply(_mlps().double(), pick)
    assert seen[:2] == ["", "0"] and "1.fc1" in seen and "0.fc1" not in seen  # no search inside a match
    assert recomputed_in_backward(model, X.detach().clone().requires_grad_()) == 2


def test_apply_every_second_match() -> None:
    model = remat.apply(_mlps(4).double(), MLP, every=2)
    assert [bool(m._forward_pre_hooks) for m in model] == [True, False, True, False]
    assert recomputed_in_backward(model, X.detach().clone().requires_grad_()) == 2
    assert_same_grads(lambda: _mlps(4), (X,), lambda m: remat.apply(m, MLP, every=2))


def test_apply_does_not_nest_sites() -> None:
    model = remat.apply(_mlps().double(), (nn.Sequential, MLP))  # the outer Sequential matches first
    assert bool(model._forward_pre_hooks)
    assert not any(m._forward_pre_hooks for m in model.modules() if m is not model)
    assert recomputed_in_backward(model, X.detach().clone().requires_grad_()) == 1


def test_apply_keeps_state_dict_keys() -> None:
    keys = list(_mlps().state_dict())
    assert list(remat.apply(_mlps(), MLP).state_dict()) == keys


# -- decoration-time errors -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"policy": 3}, TypeError, "policy"),
        ({"preserve_rng": "yes"}, TypeError, "preserve_rng"),
        ({"strategy": "again"}, ValueError, "strategy"),
        ({"enabled": 1}, TypeError, "enabled"),
        ({"check": None}, TypeError, "check"),
        ({"name": 7}, TypeError, "name"),
        ({"polcy": None}, TypeError, "polcy"),
    ],
)
def test_bad_options_raise_when_decorating(options: dict[str, object], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):  # an unknown keyword raises once the site is known, naming it
        remat.remat(**options)(mlp_fn)  # type: ignore[call-overload]
    with pytest.raises(error, match=words):
        remat(mlp_fn, **options)  # type: ignore[operator]
    with pytest.raises(error, match=words):
        remat.apply(MLP(), nn.Linear, **options)


@pytest.mark.parametrize("target", [3, "fn", None.__class__, object])
def test_bad_targets_raise_type_error(target: object) -> None:
    with pytest.raises(TypeError, match="remat: "):
        remat.remat(target)  # type: ignore[call-overload]


def test_apply_errors() -> None:
    with pytest.raises(ValueError, match="no submodule"):
        remat.apply(MLP(), nn.Conv2d)
    with pytest.raises(ValueError, match="every"):
        remat.apply(MLP(), nn.Linear, every=0)
    with pytest.raises(TypeError, match="where"):
        remat.apply(MLP(), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        remat.apply(mlp_fn, nn.Linear)  # type: ignore[type-var]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        remat.undo(mlp_fn)  # type: ignore[type-var]


def test_cell_with_tuple_state_as_an_instance() -> None:
    inputs = (randn(2, 6, requires_grad=True), (randn(2, 6, requires_grad=True, seed=1), randn(2, 6, seed=2)))
    assert_same_grads(Cell, inputs, remat.remat)


def test_the_decorator_object_carries_the_whole_api() -> None:
    """`from remat import remat` is the whole API, the same objects as `import remat` gives (docs/api.md, its
    opening paragraph)."""
    from remat import remat as decorator

    missing = [name for name in remat.__all__ if not hasattr(decorator, name)]
    assert not missing, f"missing on the decorator object: {missing}"
    for name in remat.__all__:
        assert getattr(decorator, name) is getattr(remat, name), name


_IMPORT_PROBE = """
import sys
import remat
loaded = sorted(m for m in sys.modules if m.startswith(("remat.", "transformers", "peft", "benchmarks", "tests")))
print(" ".join(loaded))
assert {"chain", "Tracker", "estimate"} <= set(dir(remat)) & set(dir(remat.remat))  # listed before they load
used = (remat.chain, remat.Tracker, remat.estimate)
homes = ("remat._chain.chain", "remat._measure.track", "remat._estimate.estimate")
print(*(m for m in homes if m in sys.modules), *{value.__module__ for value in used})
"""


def test_import_remat_loads_the_engine_not_the_planner_the_tools_or_the_benchmark() -> None:
    """The measuring and planning wings, the benchmark and transformers load on first use only (docs/design.md,
    'What remat guarantees' 15)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-800:]
    loaded, used = done.stdout.splitlines()
    assert "remat._engine.region" in loaded.split()  # the probe sees what is imported
    late = ("benchmarks", "tests", "remat._demo", "remat.__main__", "remat._estimate", "remat._budget",
            "remat._chain", "remat._measure", "remat._sites.cross_entropy", "remat._sites.integrations.",
            "transformers", "peft")
    assert not [m for m in loaded.split() if m.startswith(late)], loaded
    assert used.split() == ["remat._chain.chain", "remat._measure.track", "remat._estimate.estimate", "remat"]


class Interrupted(nn.Module):
    """A block whose forward a Ctrl-C stops halfway, once asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)
        self.interrupt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return x + self.outer(h)


def _interrupt_once(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    if getattr(module, "interrupt_hook", False):
        module.interrupt_hook = False
        raise KeyboardInterrupt


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
@pytest.mark.parametrize("entry", ["instance", "apply", "a later pre-hook"])
def test_a_keyboard_interrupt_in_a_sites_forward_leaves_nothing_on(entry: str, strategy: str) -> None:
    """torch runs a module's always-called forward hooks for an `Exception` only: a Ctrl-C in a rematerialized
    instance's forward left its saved-tensor hooks (rerun) or its recorder (replay) on, and every later backward of
    the process raised, that of a model remat never saw included. One in a pre-hook registered after the site left
    the placeholder of a region forward never opened (NOTE [ Module instances ], implementation note 3): the next
    backward's recompute opened a region for it and raised a mismatch."""
    from conftest import dispatch_modes, hooks_installed

    from remat._sites.targets import _open_sites

    torch.manual_seed(0)
    model = nn.Sequential(Interrupted(), Interrupted()).double()
    plain = copy.deepcopy(model)
    if entry == "instance":
        for block in model:
            remat(block, strategy=strategy)
    else:
        remat.apply(model, Interrupted, strategy=strategy)
    for module in (model, plain) if entry == "a later pre-hook" else ():
        module[1].register_forward_pre_hook(_interrupt_once)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    modes = dispatch_modes()
    if entry == "a later pre-hook":
        model[1].interrupt_hook = True
    else:
        model[1].interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    assert not hooks_installed() and dispatch_modes() == modes
    other = nn.Linear(8, 8).double()  # a model remat never saw trains as before
    other(x).tanh().sum().backward()
    assert other.weight.grad is not None
    before = recomputes()
    for module in (model, plain):  # the model trains on, as the same model without remat
        module(x).pow(2).sum().backward()
    assert recomputes() > before
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert not _open_sites.stack
