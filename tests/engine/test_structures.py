"""Tensors anywhere in args, kwargs and outputs (docs/design.md, 'What remat guarantees' 5); outputs keep their
requires_grad (4)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from conftest import assert_same_grads, randn
from hypothesis import given, settings
from hypothesis import strategies as st
from models import Cell, Unrolled

import remat
from remat._engine.tree import tensors_in


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor | None
    scale: float = 1.0


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


def busy(t: torch.Tensor) -> torch.Tensor:
    """Ops that save activations made inside the site."""
    return t.sin().exp() * t.cos()


def test_dataclass_namedtuple_dict_list_and_none_inputs() -> None:
    def fn(batch: Batch, pair: Pair, extra: dict[str, Any], items: list[Any], nothing: None) -> torch.Tensor:
        h = busy(batch.x) * batch.scale
        if batch.mask is not None:
            h = h.masked_fill(batch.mask, 0.0)
        h = h + busy(pair.left) @ busy(pair.right)
        return h * extra["w"].tanh() + items[0] * items[1] + len(extra["tag"])

    inputs = (
        Batch(randn(3, 4, requires_grad=True), torch.tensor([[True, False, False, True]] * 3), 0.5),
        Pair(randn(3, 2, requires_grad=True, seed=1), randn(2, 4, requires_grad=True, seed=2)),
        {"w": randn(4, requires_grad=True, seed=3), "tag": "abc"},
        [randn(3, 4, requires_grad=True, seed=4), 3],
        None,
    )
    assert_same_grads(lambda: fn, inputs)


def test_tensors_in_keyword_arguments() -> None:
    def fn(x: torch.Tensor, *, bias: torch.Tensor, options: dict[str, Any], pair: Pair | None = None) -> torch.Tensor:
        assert pair is not None
        return busy(x + bias) * options["gain"].exp() + busy(pair.left).sum() * options["k"]

    kwargs = {
        "bias": randn(4, requires_grad=True, seed=1),
        "options": {"gain": randn(4, requires_grad=True, seed=2), "k": 2},
        "pair": Pair(randn(2, requires_grad=True, seed=3), randn(2, seed=4)),
    }
    assert_same_grads(lambda: fn, (randn(3, 4, requires_grad=True),), kwargs=kwargs)


def test_structured_outputs() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        h = busy(x)
        return {
            "pair": Pair(h, busy(y)),
            "list": [h.sum(), None, "text", 7],
            "batch": Batch(h * y, None, 2.0),
            "tuple": (h.argmax(), h.detach() * 2, torch.zeros(2)),
        }

    _, ours = assert_same_grads(lambda: fn, (randn(3, 4, requires_grad=True), randn(3, 4, seed=1)))
    assert type(ours.out["pair"]) is Pair and type(ours.out["batch"]) is Batch
    assert ours.out["list"][1:] == [None, "text", 7] and ours.out["batch"].scale == 2.0
    assert ours.out["tuple"][0].dtype == torch.int64


def test_outputs_keep_requires_grad() -> None:
    def fn(x: torch.Tensor, frozen: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            stats = busy(x)
        return busy(x), busy(frozen), stats, x.detach().exp(), (x > 0).sum(), busy(x).round().long()

    x, frozen = randn(3, 4, requires_grad=True), randn(4, seed=1)
    plain = fn(x, frozen)
    ours = remat.remat(fn)(x, frozen)
    assert [t.requires_grad for t in ours] == [t.requires_grad for t in plain] == [True] + [False] * 5
    assert_same_grads(lambda: fn, (x, frozen))


def test_lstm_cell_tuple_state_over_steps() -> None:
    """An LSTM-style cell returning `(activation, (h, c))`, each step rematerialized."""
    inputs = (randn(4, 2, 6, requires_grad=True), (randn(2, 6, requires_grad=True, seed=1), randn(2, 6, seed=2)))
    _, ours = assert_same_grads(Unrolled, inputs, lambda model: (remat.remat(model.cell), model)[1])
    assert ours.grads["parameter cell.hidden.weight"] is not None
    h, (h_again, c) = remat.remat(Cell().double())(inputs[0][0], inputs[1])
    assert h is h_again and c.requires_grad


# -- any tree of arguments --------------------------------------------------------------------------------
_LEAVES = st.one_of(
    st.tuples(st.integers(1, 3), st.booleans()).map(lambda spec: ("tensor", *spec)),
    st.sampled_from([None, 3, "s", 1.5]),
)


def _trees(depth: int = 2) -> st.SearchStrategy[Any]:
    return st.recursive(
        _LEAVES,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.sampled_from("abc"), children, max_size=3),
            st.tuples(children, children).map(lambda pair: Pair(*pair)),
        ),
        max_leaves=6,
    )


def _build(spec: Any, counter: list[int]) -> Any:
    if isinstance(spec, tuple) and len(spec) == 3 and spec[0] == "tensor":
        counter[0] += 1
        return randn(spec[1], 2, requires_grad=spec[2], seed=counter[0])
    if isinstance(spec, Pair):
        return Pair(_build(spec.left, counter), _build(spec.right, counter))
    if isinstance(spec, tuple):
        return tuple(_build(item, counter) for item in spec)
    if isinstance(spec, list):
        return [_build(item, counter) for item in spec]
    if isinstance(spec, dict):
        return {key: _build(item, counter) for key, item in spec.items()}
    return spec


def _transform(tree: Any) -> Any:
    """The same structure back, every tensor through ops that save activations."""
    if isinstance(tree, torch.Tensor):
        return busy(tree)
    if isinstance(tree, Pair):
        return Pair(_transform(tree.left), _transform(tree.right))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_transform(item) for item in tree)
    if isinstance(tree, dict):
        return {key: _transform(item) for key, item in tree.items()}
    return tree


@settings(max_examples=25, deadline=None)
@given(args=_trees(), kwargs=_trees())
def test_any_tree_of_arguments_and_outputs(args: Any, kwargs: Any) -> None:
    built_args, built_kwargs = _build(args, [0]), _build(kwargs, [100])

    def fn(first: Any, *, second: Any) -> Any:
        return _transform(first), [_transform(second)]

    grads = any(t.requires_grad for t in tensors_in((built_args, built_kwargs), []))
    base, ours = assert_same_grads(lambda: fn, (built_args,), kwargs={"second": built_kwargs}, expect_recompute=grads)
    assert repr(ours.out) == repr(base.out)  # same structure, same non-tensor values
