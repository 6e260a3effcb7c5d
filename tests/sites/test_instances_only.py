"""`remat(module)`, `remat.apply` and budget plans change the instances they are given and nothing else (issue 37):
no class attribute of the user's classes is replaced or added, and `remat.undo` leaves the instance as it was.

The first tests are the issue's scenario: transformers checkpoints a layer only while `type(layer).forward` is its
own wrapper, so a class changed by remat stopped transformers' own gradient checkpointing in every other model of
that layer class in the process, silently.
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import io
import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same_grads, garbage_collector_off, randn
from models import MLP, TransformerBlock, stack
from torch import nn

import remat
from remat._engine import stats as _stats

X = randn(4, 8, requires_grad=True)


def _classes(model: nn.Module) -> set[type]:
    """Every class in the MRO of every submodule of `model`, `nn.Module` included."""
    return {kind for module in model.modules() for kind in type(module).__mro__ if kind is not object}


def _snapshot(model: nn.Module) -> dict[type, dict[str, Any]]:
    """Each of `model`'s classes' own attributes, by name (values compared by identity)."""
    return {kind: dict(vars(kind)) for kind in _classes(model)}


def _assert_same_classes(before: dict[type, dict[str, Any]]) -> None:
    for kind, attributes in before.items():
        now = dict(vars(kind))
        assert now.keys() == attributes.keys(), (kind.__qualname__, now.keys() ^ attributes.keys())
        changed = [name for name, value in attributes.items() if now[name] is not value]
        assert not changed, f"{kind.__qualname__}: {changed} replaced"


def _instances(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each submodule's own attributes by name, hook tables as their items (values compared by identity)."""
    out = {}
    for name, module in model.named_modules():
        out[name] = {key: list(value.items()) if key.endswith("hooks") else value
                     for key, value in vars(module).items()}
    return out


def _assert_same_instances(before: dict[str, dict[str, Any]], model: nn.Module) -> None:
    now = _instances(model)
    assert now.keys() == before.keys()
    for name, attributes in before.items():
        assert now[name].keys() == attributes.keys(), (name, now[name].keys() ^ attributes.keys())
        for key, value in attributes.items():
            if key.endswith("hooks"):
                assert [(k, id(h)) for k, h in now[name][key]] == [(k, id(h)) for k, h in value], (name, key)
            else:
                assert now[name][key] is value, (name, key)


def _recomputed(module: nn.Module, x: torch.Tensor) -> int:
    before = _stats.recomputes
    module(x).sum().backward()
    return _stats.recomputes - before


# -- transformers' own gradient checkpointing, next to a rematerialized model of the same layer class -------------

def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    return transformers.LlamaForCausalLM(config).double().train()  # type: ignore[no-any-return]


def _hf_step(model: nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
    """Calls of layer 0's MLP in one training step (2: forward and its recompute; 1: nothing recomputed), and the
    parameters' gradients. Counted when the call starts: a recompute that stops early (torch's, remat's) stops
    inside the MLP, the last part of the layer, so a forward hook would not see it."""
    calls = [0]
    handle = model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        handle.remove()
    return calls[0], {name: p.grad for name, p in model.named_parameters()}


def _checkpointed(model: nn.Module) -> nn.Module:
    """`model` under transformers' own checkpointing (`activation_checkpointing_enable` since transformers 5.23,
    which deprecates `gradient_checkpointing_enable`)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _assert_grads(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, k=name: f"gradient of {k}: {m}")


@pytest.mark.equivalence
@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers: `use_cache=True` is incompatible with ...
@pytest.mark.parametrize("order", ["checkpointing first", "remat first"])
def test_transformers_checkpointing_recomputes_next_to_a_rematerialized_model(order: str) -> None:
    plain_calls, expected = _hf_step(_llama())
    assert plain_calls == 1  # nothing recomputes in a plain step
    if order == "checkpointing first":
        theirs = _checkpointed(_llama())
        assert _hf_step(theirs)[0] == 2  # transformers' checkpoint recomputes the layer
        ours = remat.apply(_llama())
    else:
        ours = remat.apply(_llama())
        theirs = _checkpointed(_llama())
    calls, grads = _hf_step(theirs)
    assert calls == 2, "transformers' own checkpointing stopped recomputing next to a rematerialized model"
    _assert_grads(grads, expected)
    before = _stats.recomputes
    calls, grads = _hf_step(ours)
    assert calls == 2 and _stats.recomputes > before  # remat recomputes its own model
    _assert_grads(grads, expected)

    remat.undo(ours)
    calls, grads = _hf_step(theirs)
    assert calls == 2, "transformers' own checkpointing stopped recomputing after `remat.undo` of another model"
    _assert_grads(grads, expected)
    assert _hf_step(ours)[0] == 1  # undone: nothing recomputes


def test_a_transformers_layer_class_is_untouched_by_apply_and_undo() -> None:
    model = _llama()
    classes = _snapshot(model)
    instances = _instances(model)
    remat.apply(model)
    _hf_step(model)
    _assert_same_classes(classes)
    remat.undo(model)
    _assert_same_classes(classes)
    _assert_same_instances(instances, model)


# -- classes stay as they were; undo gives each instance back what it had -----------------------------------------

def _stack() -> nn.Module:
    return stack(3)


MARKS: dict[str, Callable[[nn.Module], object]] = {
    "remat(instance)": lambda model: [remat(block) for block in model.blocks],
    "remat(model)": remat,
    "apply": remat.apply,
    "apply with a policy": lambda model: remat.apply(model, policy=remat.policies.save_matmuls),
    "apply replay": lambda model: remat.apply(model, strategy="replay"),
    "budget plan": lambda model: remat.apply(model, budget=0.9, sample=randn(2, 8, 16, seed=3)),
}


@pytest.mark.parametrize("mark", list(MARKS))
def test_no_class_attribute_changes_and_undo_restores_the_instances(mark: str) -> None:
    model = _stack()
    forward = TransformerBlock.forward
    classes = _snapshot(model)
    instances = _instances(model)
    MARKS[mark](model)
    assert remat.plan(model).sites
    _assert_same_classes(classes)
    x = randn(2, 8, 16, requires_grad=True)
    assert _recomputed(model, x) > 0
    _assert_same_classes(classes)
    assert TransformerBlock.forward is forward
    remat.undo(model)
    _assert_same_classes(classes)
    _assert_same_instances(instances, model)
    assert _recomputed(model, x) == 0


def test_a_class_forward_is_the_same_object_before_and_after_remat_and_undo() -> None:
    forward = MLP.forward
    module = MLP().double()
    remat(module)
    assert MLP.forward is forward
    assert _recomputed(module, X.detach().clone().requires_grad_()) == 1
    assert MLP.forward is forward
    remat.undo(module)
    assert MLP.forward is forward and "forward" not in vars(module)


def test_another_instance_of_the_class_is_untouched() -> None:
    ours, other = remat(MLP().double()), MLP().double()
    assert "forward" not in vars(other)
    assert _recomputed(ours, X.detach().clone().requires_grad_()) == 1
    assert _recomputed(other, X.detach().clone().requires_grad_()) == 0


class Patched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _patched_forward(self: Patched, x: torch.Tensor) -> torch.Tensor:
    """A user's monkeypatch: a different function than the class defines."""
    _patched_forward.calls += 1  # type: ignore[attr-defined]
    return torch.tanh(self.fc(x)).sin()


@pytest.fixture
def patched() -> Iterator[Callable[..., torch.Tensor]]:
    original = Patched.forward
    Patched.forward = _patched_forward  # type: ignore[method-assign]
    _patched_forward.calls = 0  # type: ignore[attr-defined]
    yield _patched_forward
    Patched.forward = original  # type: ignore[method-assign]


@pytest.mark.equivalence
def test_a_users_monkeypatched_class_forward_is_kept(patched: Callable[..., torch.Tensor]) -> None:
    assert_same_grads(Patched, (X,), remat)
    assert _patched_forward.calls == 3  # type: ignore[attr-defined]  # plain, remat's forward, its recompute
    module = remat(Patched().double())
    assert Patched.forward is patched
    remat.undo(module)
    assert Patched.forward is patched and "forward" not in vars(module)


@pytest.mark.equivalence
def test_a_class_forward_patched_after_remat_is_what_the_instance_runs() -> None:
    """The instance's forward reads its class's `forward` at each call: a patch made after `remat` runs, in forward
    and in recompute, with the gradients of a plain module under the same patch."""
    original = Patched.forward
    torch.manual_seed(0)
    module, plain = remat(Patched().double()), Patched().double()
    plain.load_state_dict(module.state_dict())
    Patched.forward = _patched_forward  # type: ignore[method-assign]
    _patched_forward.calls = 0  # type: ignore[attr-defined]
    try:
        x1, x2 = X.detach().clone().requires_grad_(), X.detach().clone().requires_grad_()
        assert _recomputed(plain, x1) == 0
        assert _recomputed(module, x2) == 1
        assert _patched_forward.calls == 3  # type: ignore[attr-defined]  # plain, remat's forward, its recompute
    finally:
        Patched.forward = original  # type: ignore[method-assign]
    torch.testing.assert_close(x2.grad, x1.grad)
    torch.testing.assert_close(module.fc.weight.grad, plain.fc.weight.grad)


# -- an instance's own forward (a library's hook, a user's) --------------------------------------------------------

def _own_forward(module: MLP, x: torch.Tensor) -> torch.Tensor:
    return type(module).forward(module, x) * 2


@pytest.mark.equivalence
def test_an_instance_forward_of_its_own_is_called_and_put_back() -> None:
    own: list[Any] = []

    def make() -> nn.Module:
        module = MLP()
        module.forward = functools.partial(_own_forward, module)  # type: ignore[method-assign]  # as accelerate does
        own.append(module.forward)
        return module

    _, run = assert_same_grads(make, (X,), remat)
    module = run.target
    assert module.forward.own is own[-1]
    remat.undo(module)
    assert vars(module)["forward"] is own[-1]


# -- the instance's forward travels with it, answers as a method, and keeps nothing alive -------------------------

COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda module: pickle.loads(pickle.dumps(module)),
    "torch.save": lambda module: _saved_and_loaded(module),
}


def _saved_and_loaded(module: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_runs_its_own_parameters_and_outlives_the_original(how: str) -> None:
    original = remat(MLP().double())
    keys = list(MLP().state_dict())
    clone = COPIES[how](original)
    assert list(clone.state_dict()) == list(original.state_dict()) == keys
    assert vars(clone)["forward"].__self__ is clone
    with torch.no_grad():
        clone.fc1.weight.mul_(2)
    x = X.detach().clone()
    expected = MLP().double()
    expected.load_state_dict(clone.state_dict())
    del original
    gc.collect()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.testing.assert_close(clone(x2), expected(x1))
    assert _recomputed(clone, x2) == 1
    remat.undo(clone)
    assert "forward" not in vars(clone) and type(clone) is MLP


def test_a_rematerialized_model_is_freed_when_its_last_reference_goes() -> None:
    """The instance's forward holds the model weakly: no cycle keeps it until the next garbage collection."""
    model = remat.apply(_stack())
    _recomputed(model, randn(2, 8, 16, requires_grad=True))
    ref = weakref.ref(model)
    with garbage_collector_off():
        del model
        assert ref() is None


def test_the_instance_forward_answers_as_the_method_it_calls() -> None:
    module = remat(MLP())
    plain = MLP()
    assert inspect.signature(module.forward) == inspect.signature(plain.forward)
    assert module.forward.__name__ == "forward" and module.forward.__qualname__ == "MLP.forward"
    assert module.forward.__func__ is MLP.forward and module.forward.__self__ is module
    with pytest.raises(AttributeError):
        module.forward.not_an_attribute  # noqa: B018


def test_a_shallow_copy_whose_original_is_gone_says_so() -> None:
    original = remat(MLP().double())
    clone = copy.copy(original)
    torch.testing.assert_close(clone(X), original(X))  # the same parameters, through the original's forward
    del original
    gc.collect()
    with pytest.raises(remat.RematError, match="shallow copy"):
        clone(X)


# -- under torch.compile: every rematerialized instance still lowers to torch's checkpoint operator ----------------

def _checkpoints_in_graph(model: nn.Module, x: torch.Tensor) -> tuple[int, Any]:
    """How many checkpoint operators dynamo's graph of `model` holds, and the compiled input gradient."""
    found: list[int] = []

    def backend(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        found.append(sum(node.op == "call_function" and "checkpoint" in str(node.target)
                         for node in graph.graph.nodes))
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(graph, inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    (grad,) = torch.autograd.grad(compiled(x).sum(), x)
    torch._dynamo.reset()
    assert len(found) == 1, found
    return found[0], grad


@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's notes about C builtins
@pytest.mark.parametrize("own", [False, True], ids=["class forward", "own forward"])
def test_compiled_instances_lower_to_the_checkpoint_operator_without_touching_the_class(own: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), MLP(), MLP()).double()
    if own:
        for block in model:
            block.forward = functools.partial(_own_forward, block)  # type: ignore[arg-type]
    x = X.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(model(x).sum(), x)
    assert _checkpoints_in_graph(model, x)[0] == 0
    classes = _snapshot(model)  # after a first compile: dynamo marks `nn.Module` itself then
    remat.apply(model, MLP)
    count, got = _checkpoints_in_graph(model, x)
    assert count == 3
    torch.testing.assert_close(got, expected)
    _assert_same_classes(classes)
    remat.undo(model)
    assert _checkpoints_in_graph(model, x)[0] == 0
