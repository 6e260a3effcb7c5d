"""Tiles with the chunked head and per-block offload on a device that is not the CPU (tests/pydevice.py), where
host memory is not the device's: `remat.apply(model, head=True, offload=True)` with the decoder layers' MLPs and
norms in tiles keeps each block's input on the host, gradients and every generator after backward equal a run
without remat (float64), and the device's peak falls by the block inputs that went to the host.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pydevice
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_on_device
from torch import nn

import remat
from remat._engine import stats as _stats
from remat._engine import transfer as _transfer
from remat._sites.blocks import find_blocks
from remat._sites.tiles import tile_blocks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("test_device")

D0 = "remat_test:0"
VOCAB, SEQ, WIDTH, LAYERS, TILES = 96, 128, 32, 5, 4
EQUIVALENCE_HELPERS = ("assert_same_on_device(",)


class Loss(nn.Module):
    """A causal LM's loss: its own (routed through the chunked head) or, as a baseline in float64, from its logits
    (its own loss would upcast float64 logits to float32)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            hidden_size=WIDTH, intermediate_size=3 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0.0,
            attn_implementation=pydevice.fused_attention(),  # attention's own memory per token, as on a GPU
        )
        self.model = transformers.LlamaForCausalLM(config).double()
        self.routed = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.routed:
            loss: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
            return loss
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def make() -> nn.Module:
    return Loss().to(D0)


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(5)).to(D0)


def configure(offload: bool) -> Callable[[Any], Any]:
    def variant(target: Loss) -> Loss:
        remat.apply(target.model, head=True, offload=offload)
        report = tile_blocks(find_blocks(target.model), TILES)
        assert len(report.tiled) == 3 * LAYERS  # each layer's MLP and its two norms
        target.routed = True
        return target

    return variant


@pytest.fixture(autouse=True)
def _nothing_left_on_the_host() -> Iterator[None]:
    yield
    gc.collect()
    assert _transfer.live_parcels() == 0, "a host copy outlived its graph"


@pytest.mark.parametrize("offload", [False, True], ids=["tiles-head", "tiles-head-offload"])
def test_tiles_head_and_per_block_offload_give_no_remats_gradients(offload: bool) -> None:
    before, tiles = _transfer.traffic(), _stats.tiles
    assert_same_on_device(make, (ids(),), configure(offload))
    after = _transfer.traffic()
    # the attention's norm, and the MLP chained onto the norm before it (NOTE [ Tiles ], rule 7): two tiled calls
    assert _stats.tiles - tiles == 2 * LAYERS * TILES, "every MLP and norm ran its backward in tiles"
    crossed = after.out_bytes - before.out_bytes
    block_input = SEQ * WIDTH * 8
    if offload:  # each block's input went to the host and came back once, and nothing the block rebuilds did
        assert crossed >= LAYERS * block_input and after.back_bytes - before.back_bytes == crossed
        assert crossed - LAYERS * block_input < block_input  # what every block shares (rotary tables) crosses once
    else:
        assert crossed == 0


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_per_block_offload_takes_the_block_inputs_off_the_device() -> None:
    """Measured as the activations' peak (the gradients exist before the step), which comes early in backward, when
    every block's input is kept. With offload the device holds at most two blocks' inputs at its peak (the
    block's whose backward runs and the one brought back ahead of its use: one block ahead, NOTE [ Offload
    lifecycle ], note 3); the others are on the host."""

    def peak(offload: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        target = configure(offload)(make())
        for param in target.parameters():
            param.grad = torch.zeros_like(param)
        tokens = ids()
        with remat.track() as tracker:
            target(tokens).backward()
        return tracker.peak(D0), tracker.peak("cpu")

    kept_on_device, _ = peak(False)
    offloaded, host = peak(True)
    block_input = SEQ * WIDTH * 8
    assert kept_on_device - offloaded >= (LAYERS - 2) * block_input, (kept_on_device, offloaded)
    assert host == 0, "the host copies are not the device's memory"


class BloomLoss(Loss):
    """Bloom, whose MLP takes the residual as a second tensor of the same positions (tiled with its input:
    NOTE [ Tiles ], rule 8)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        config = transformers.BloomConfig(n_layer=LAYERS, hidden_size=WIDTH, n_head=4, vocab_size=VOCAB,
                                          hidden_dropout=0.0, attention_dropout=0.0)
        self.model = transformers.BloomForCausalLM(config).double()
        self.routed = False


def test_an_mlp_that_takes_the_residual_runs_in_tiles_with_the_head_and_per_block_offload() -> None:
    before, tiles = _transfer.traffic(), _stats.tiles

    def variant(target: Loss) -> Loss:
        remat.apply(target.model, head=True, offload=True)
        assert tile_blocks(find_blocks(target.model), TILES).tiled[:3] == (
            "transformer.h.0.input_layernorm", "transformer.h.0.post_attention_layernorm", "transformer.h.0.mlp")
        target.routed = True
        return target

    assert_same_on_device(lambda: BloomLoss().to(D0), (ids(),), variant)
    # per layer: the two norms, and the MLP with its residual (which does not chain onto the norm)
    assert _stats.tiles - tiles == 3 * LAYERS * TILES
    assert _transfer.traffic().out_bytes - before.out_bytes >= LAYERS * SEQ * WIDTH * 8
