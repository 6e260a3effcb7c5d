"""`remat.apply(model)` with no `where` (docs/guides/sites.md, 'A whole model'; NOTE [ Picking blocks ]): the blocks
a user would pick, and `remat.plan`."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_grads, randn
from models import MLP, TransformerBlock
from torch import nn

import remat
from remat._sites.blocks import find_blocks, is_hf_layer


class Stack(nn.Module):
    """Embedding-ish head, a long ModuleList of blocks, and a short Sequential of mixed layers."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # two children, two classes: not a stack
        self.blocks = nn.ModuleList(TransformerBlock() for _ in range(depth))
        self.pair = nn.ModuleList([MLP(), MLP()])  # shorter than `blocks`
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        for block in self.blocks:
            x = block(x)
        for mlp in self.pair:
            x = mlp(x)
        return self.out(x)


def test_picks_the_longest_container_of_one_class() -> None:
    names = [name for name, _ in find_blocks(Stack())]
    assert names == ["blocks.0", "blocks.1", "blocks.2"]


class Stages(nn.Module):
    """Stages, each a list of blocks (transformers' Funnel), and a layer under weight norm."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(TransformerBlock() for _ in range(2)) for _ in range(2))
        self.out = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return self.out(x)


def test_blocks_inside_lists_of_lists_not_the_lists_nor_a_parametrization() -> None:
    """NOTE [ Picking blocks ], rule 2: the lists were picked (no forward calls a list) and so was weight norm's
    parametrization, so apply rematerialized nothing and said nothing."""
    names = [name for name, _ in find_blocks(Stages())]
    assert names == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]
    _, ours = assert_same_grads(Stages, (randn(2, 5, 8, requires_grad=True),), remat.apply)
    assert [site.name for site in remat.plan(ours.target)] == names


class Residual(nn.Module):
    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc(x).tanh()
        return x if self.inner is None else self.inner(x)


class Branches(nn.Module):
    """Res2Net's block: a list of lone convolutions inside each block."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = x + conv(x).tanh()
        return x


class Expert(Residual):
    pass


class Experts(nn.Module):
    """A layer of a mixture of experts written with a list: more experts than layers."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((expert(x) for expert in self.experts), torch.zeros_like(x))


def test_the_repeated_blocks_of_a_class_over_every_container() -> None:
    """NOTE [ Picking blocks ], rules 2 and 3: the longest single container was one ResNet stage (2 of 8 blocks), a
    Res2Net block's list of lone convolutions (nothing to rebuild), a mixture's experts rather than its layers."""
    stages = nn.Module()
    for index in range(3):
        stages.add_module(f"layer{index}", nn.Sequential(Residual(), Residual()))
    assert [name for name, _ in find_blocks(stages)] == [f"layer{i}.{j}" for i in range(3) for j in range(2)]
    res2 = nn.Module()  # a stage of blocks with lists of lone layers, then one of plain blocks
    res2.add_module("layer0", nn.Sequential(*(Residual(Branches()) for _ in range(2))))
    res2.add_module("layer1", nn.Sequential(*(Residual() for _ in range(2))))
    res2.forward = lambda x: res2.layer1(res2.layer0(x))  # type: ignore[method-assign]
    assert [name for name, _ in find_blocks(res2)] == ["layer0.0", "layer0.1", "layer1.0", "layer1.1"]
    moe = nn.ModuleList(Residual(Experts()) for _ in range(3))
    assert [name for name, _ in find_blocks(moe)] == ["0", "1", "2"]
    staged = nn.Module()  # stages in a list, each a list of blocks, and one more block of that class outside them
    staged.add_module("stages", nn.Sequential(*(Residual(nn.Sequential(Expert(), Expert())) for _ in range(3))))
    staged.add_module("final", nn.Sequential(Expert()))
    assert [name for name, _ in find_blocks(staged)] == ["stages.0", "stages.1", "stages.2"]  # not 6 + 1 experts
    _, ours = assert_same_grads(lambda: res2, (randn(3, 8, requires_grad=True),), remat.apply)
    assert len(list(remat.plan(ours.target))) == 4


def test_a_sequential_model_is_its_own_container() -> None:
    model = nn.Sequential(MLP(), MLP(), MLP())
    assert [name for name, _ in find_blocks(model)] == ["0", "1", "2"]


def test_apply_without_where_equals_naming_the_class() -> None:
    x = randn(2, 5, 8, requires_grad=True)
    assert_same_grads(Stack, (x,), remat.apply)
    named = remat.plan(remat.apply(Stack(), TransformerBlock))
    picked = remat.plan(remat.apply(Stack()))
    assert [site.name for site in picked] == [site.name for site in named] == ["blocks.0", "blocks.1", "blocks.2"]


def test_apply_without_where_on_a_model_with_no_stack_names_what_it_looked_for() -> None:
    with pytest.raises(ValueError, match=r"GradientCheckpointingLayer.*ModuleList or nn\.Sequential"):
        remat.apply(MLP())


def test_hf_layers_are_found_by_class_name_without_importing_transformers() -> None:
    # A stand-in with the same module and name as transformers' class: detection reads the MRO only.
    layer_type = type("GradientCheckpointingLayer", (nn.Module,), {"__module__": "transformers.modeling_layers"})
    decoder_layer = type("DecoderLayer", (layer_type,), {"forward": lambda self, x: x})
    model = nn.Module()
    model.layers = nn.ModuleList(decoder_layer() for _ in range(2))  # type: ignore[assignment]
    model.longer = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))  # type: ignore[assignment]
    assert is_hf_layer(model.layers[0]) and not is_hf_layer(model.longer[0])  # type: ignore[index]
    assert [name for name, _ in find_blocks(model)] == ["layers.0", "layers.1"]


def test_plan_lists_sites_and_choices() -> None:
    model = remat.apply(Stack(), TransformerBlock, policy=remat.policies.save_matmuls)
    remat(model.out)
    plan = remat.plan(model)
    assert [(site.name, site.kind, site.choice) for site in plan] == [
        ("blocks.0", "TransformerBlock", "matmuls"),
        ("blocks.1", "TransformerBlock", "matmuls"),
        ("blocks.2", "TransformerBlock", "matmuls"),
        ("out", "Linear", "full"),
    ]
    text = str(plan)
    assert text.splitlines()[0] == "remat plan for Stack: 4 rematerialized sites"
    assert "blocks.2" in text and "matmuls" in text
    assert len(remat.plan(remat.undo(model))) == 0


def test_plan_sees_decorated_classes() -> None:
    @remat
    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sin()

    model = nn.Sequential(Block(), nn.ReLU())
    assert [(site.name, site.choice) for site in remat.plan(model)] == [("0", "full")]



class Body(nn.Module):
    """A module whose `forward` calls a method decorated with `@remat` (a site of every instance)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    @remat(name="body", policy=remat.policies.save_matmuls)
    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class PlainBody(Body):
    """A subclass that defines `body` again without `@remat`: not a site."""

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sin()


def test_plan_lists_decorated_methods_and_site_names() -> None:
    """A method other than `forward` decorated inside a module class is a site of every instance, and a site's
    `name=` (what its errors call it) shows in the table."""
    model = nn.Sequential(Body(), PlainBody(), remat(nn.Linear(4, 4), name="last"))
    plan = remat.plan(model)
    assert [(site.name, site.kind, site.method, site.label, site.choice) for site in plan] == [
        ("0", "Body", "body", "body", "matmuls"),
        ("2", "Linear", "forward", "last", "full"),
    ]
    lines = str(plan).splitlines()
    assert lines[1].split() == ["block", "class", "method", "name", "choice"]
    assert lines[2].split() == ["0", "Body", "body", "body", "matmuls"]
    # Without methods or names, the table keeps its three columns.
    assert str(remat.plan(remat.apply(nn.Sequential(nn.Linear(2, 2))))).splitlines()[1].split() == [
        "block", "class", "choice"]
