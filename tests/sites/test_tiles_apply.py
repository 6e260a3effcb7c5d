"""`remat.apply(model, tiles=...)`: the chosen blocks' token-wise modules in tiles (NOTE [ What is tiled ] in
remat/_sites/tiles.py), with the head and per-block offload, shown by `remat.plan`, taken off by `remat.undo`, and
the request's errors. Needs the `hf` extra.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._engine import stats as _stats

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, WIDTH, LAYERS = 96, 64, 32, 2
TILED = ("mlp", "input_layernorm", "post_attention_layernorm")


def make() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=WIDTH, intermediate_size=3 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0.0,
    )
    return transformers.LlamaForCausalLM(config).double().train()


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def grads_of(model: nn.Module, head: bool) -> dict[str, torch.Tensor]:
    """One backward: the model's loss through its (routed) head, or, for no remat, the loss from its logits (its own
    loss upcasts float64 logits to float32)."""
    batch = ids()
    if head:
        model(input_ids=batch, labels=batch).loss.backward()
    else:
        logits = model(input_ids=batch).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.equivalence
@pytest.mark.parametrize("options", [{}, {"head": True}, {"head": True, "offload": True}])
def test_apply_with_tiles_keeps_no_remats_gradients_and_runs_in_tiles(options: dict[str, bool]) -> None:
    base = make()
    expected = grads_of(copy.deepcopy(base), head=False)
    model = remat.apply(copy.deepcopy(base), tiles=4, **options)
    tiles, recomputes = _stats.tiles, _stats.recomputes
    grads = grads_of(model, head=bool(options))
    # every tiled module in 4 tiles in backward, the MLP with the norm before it (NOTE [ Tiles ], rule 7)
    assert _stats.tiles - tiles == LAYERS * (len(TILED) - 1) * 4
    assert _stats.recomputes > recomputes
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, k=name: f"gradient of {k}: {m}")


@pytest.mark.equivalence
@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward after the region", "backward in the region"])
def test_apply_with_tiles_under_autocast_keeps_no_remats_gradients(backward_inside: bool) -> None:
    """A training step under bf16 autocast, its backward inside the region or after it: with the backward inside,
    every tiled module's weights got twice their gradient (NOTE [ Tiles ], implementation note 5)."""
    base = make().float()
    batch = ids()

    def grads(model: nn.Module) -> dict[str, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    expected = grads(copy.deepcopy(base))
    tiles, recomputes = _stats.tiles, _stats.recomputes
    got = grads(remat.apply(copy.deepcopy(base), tiles=4))
    assert _stats.tiles - tiles == LAYERS * (len(TILED) - 1) * 4
    assert _stats.recomputes > recomputes
    for name, grad in expected.items():  # bfloat16's rounding, of the largest gradient
        torch.testing.assert_close(got[name], grad, atol=2e-2 * grad.abs().max().item(), rtol=0,
                                   msg=lambda m, k=name: f"gradient of {k}: {m}")


def test_plan_shows_the_tiles_and_undo_takes_them_off() -> None:
    model = remat.apply(make(), tiles=True)
    shown = str(remat.plan(model))
    assert [(t.name, t.tiles, t.chosen_by) for t in remat.plan(model).tiles] == [
        (f"model.layers.{i}.{name}", 8, None)
        for i in range(LAYERS) for name in TILED]
    assert "tiles: model.layers.0.mlp" in shown and "in 8 tiles" in shown
    remat.undo(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not remat.plan(model).tiles and "tiles" not in str(remat.plan(model))


def test_where_picks_the_blocks_whose_modules_are_tiled() -> None:
    model = make()
    remat.apply(model, lambda name, _: name == "model.layers.1", tiles=2)
    assert [t.name for t in remat.plan(model).tiles] == [f"model.layers.1.{name}" for name in TILED]


def test_tiles_errors_name_what_was_expected_and_leave_the_model_alone() -> None:
    model = make()
    with pytest.raises(ValueError, match=r"at least 1.*got 0"):
        remat.apply(model, tiles=0)
    for wrong in ("8", 2.0):
        with pytest.raises(TypeError, match="`tiles` must be a count"):
            remat.apply(model, tiles=wrong)  # type: ignore[arg-type]
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no token-wise module.*looks for.*`mlp`.*RMSNorm"):
        remat.apply(plain, tiles=4)
    assert not any(m._forward_pre_hooks or "forward" in m.__dict__ for m in plain.modules())
    with pytest.raises(ValueError, match="no token-wise module"):  # the blocks are the attentions: nothing to tile
        remat.apply(model, transformers.models.llama.modeling_llama.LlamaAttention, tiles=4)
    assert not remat.plan(model).tiles and not remat.plan(model).sites


@pytest.mark.equivalence
def test_gpt2s_mlp_which_flattens_its_input_with_view_runs_in_tiles_of_a_batch() -> None:
    """A tile along the positions of a batch of several sequences is not contiguous; GPT-2's `Conv1D` flattens its
    input with `view`, so each tile is handed over contiguous, as untiled."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    _, tiles = tiled_like_untiled(transformers.GPT2LMHeadModel(config))
    assert tiles == 2 * 2 * 4  # per layer: ln_1, then ln_2 with the mlp after it (chained)


def tiled_like_untiled(base: nn.Module) -> tuple[nn.Module, int]:
    """`remat.apply(base, tiles=4)` in float64: gradients equal no remat's and remat recomputed; the model and how
    many tiles its backward ran."""
    base = base.double().train()
    expected = grads_of(copy.deepcopy(base), head=False)
    model = remat.apply(copy.deepcopy(base), tiles=4)
    tiles, recomputes = _stats.tiles, _stats.recomputes
    grads = grads_of(model, head=False)
    assert _stats.recomputes > recomputes
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, k=name: f"gradient of {k}: {m}")
    return model, _stats.tiles - tiles


@pytest.mark.equivalence
def test_a_post_norm_model_whose_norms_input_is_a_temporary_keeps_no_remats_gradients() -> None:
    """openai-gpt's block is post-norm, `ln_1(x + a)` then `ln_2(n + mlp(n))`: the norm's input is a temporary that
    forward lets go and the recompute keeps, and the MLP chained onto the norm in the recompute only (NOTE [ Tiles ],
    implementation note 4): gradients were off by more than 100% (relative) before."""
    torch.manual_seed(0)
    config = transformers.OpenAIGPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    _, tiles = tiled_like_untiled(transformers.OpenAIGPTLMHeadModel(config))
    assert tiles == 2 * 3 * 4  # per layer: ln_1 chained with the mlp and on its own (also the residual), then ln_2


@pytest.mark.equivalence
def test_a_mixture_of_experts_models_norms_are_tiled_and_its_experts_skipped(caplog: pytest.LogCaptureFixture
                                                                              ) -> None:
    """Qwen2-MoE names every class after its family (`Qwen2MoeRMSNorm`): the family's name is not the module's, so the
    norms are tiled and only the sparse block is skipped. Before, `apply(tiles=...)` refused the model: every norm
    was taken for a mixture of experts. The skip is said, in one line."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        hidden_size=WIDTH, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ,
        experts_implementation="eager")  # the grouped matmul takes no float64 on the CPU
    model, tiles = tiled_like_untiled(transformers.Qwen2MoeForCausalLM(config))
    assert [t.name for t in remat.plan(model).tiles] == [
        f"model.layers.{i}.{name}" for i in range(LAYERS) for name in ("input_layernorm", "post_attention_layernorm")]
    assert tiles == LAYERS * 2 * 4
    said = [r.getMessage() for r in caplog.records if "untiled" in r.getMessage()]
    assert len(said) == 1 and "`model.layers.0.mlp` and 1 more like it untiled" in said[0], said
    assert "mixture of experts" in said[0]
