"""Hugging Face transformers and PEFT (docs/guides/huggingface.md, issue 11): `remat.apply(model)` with the models'
default arguments, in training, on a padded batch.

Models are tiny configs built in float64 (every model here supports it), so gradients are compared with
`torch.testing.assert_close` at its default float64 tolerances, dropout on (remat restores the RNG).
Needs the `hf` extra (`pip install -e '.[test,hf]'`); skipped without transformers.
"""

from __future__ import annotations

import copy
import logging
import pickle
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat._engine import stats as _stats
from remat._sites.integrations.transformers import CacheOff

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 100, 12, 3


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=SEQ,
    )
    return transformers.LlamaForCausalLM(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        num_layers=2, d_model=32, d_ff=64, d_kv=16, num_heads=2, vocab_size=VOCAB, decoder_start_token_id=0
    )
    return transformers.T5ForConditionalGeneration(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return transformers.BertForMaskedLM(config)


MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "gpt2": (gpt2, "GPT2Block"),
    "llama": (llama, "LlamaDecoderLayer"),
    "t5": (t5, "T5Block"),
    "bert": (bert, "BertLayer"),
}


def batch(name: str = "llama") -> dict[str, torch.Tensor]:
    """A padded batch: the last row has four padding positions (attention_mask 0, labels -100)."""
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if name == "t5":
        inputs["decoder_attention_mask"] = mask
    return inputs


def _step(make: Callable[[], nn.Module], name: str, how: str) -> dict[str, Any]:
    """One tracked forward and backward of a fresh float64 model in training, rematerialized `how`."""
    torch.manual_seed(0)
    model = make().double().train()
    if how == "named":
        remat.apply(model, next(type(m) for m in model.modules() if type(m).__name__ == MODELS[name][1]))
    elif how == "budget":
        remat.apply(model, budget=0.8, sample=batch(name))
    elif how != "none":
        remat.apply(model, strategy=how)  # type: ignore[arg-type]
    torch.manual_seed(1)
    with remat.track() as tracker:
        out = model(**batch(name))
        cache = out.get("past_key_values")
        before = _cache_state(cache)
        out.loss.backward()
    grads = {key: p.grad for key, p in model.named_parameters()}
    return {"peak": tracker.peak_bytes, "out": out, "grads": grads, "rng": torch.get_rng_state(),
            "cache": cache, "before": before, "after": _cache_state(cache), "plan": remat.plan(model)}


def _cache_state(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of every layer's keys and values in a cache (both halves of an encoder-decoder cache)."""
    if cache is None:
        return []
    parts = [cache.self_attention_cache, cache.cross_attention_cache] if hasattr(cache, "self_attention_cache") \
        else [cache]
    return [(layer.keys.clone(), layer.values.clone()) for part in parts for layer in part.layers
            if getattr(layer, "keys", None) is not None and layer.keys.numel()]


def _assert_same(expected: dict[str, Any], got: dict[str, Any]) -> None:
    torch.testing.assert_close(got["out"].loss, expected["out"].loss)
    torch.testing.assert_close(got["out"].logits, expected["out"].logits)
    assert got["grads"].keys() == expected["grads"].keys()
    for key, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][key], grad, msg=lambda m, k=key: f"gradient of {k}: {m}")
    assert torch.equal(got["rng"], expected["rng"]), "the RNG state after backward differs"


@pytest.mark.parametrize("name", list(MODELS))
def test_apply_on_a_padded_batch_gradients_memory_and_cache(name: str) -> None:
    make, _ = MODELS[name]
    none, picked, named = (_step(make, name, how) for how in ("none", "rerun", "named"))
    _assert_same(none, picked)
    assert picked["peak"] == named["peak"]  # remat.apply(model) picks what naming the class picks
    assert picked["peak"] < none["peak"]
    if name != "bert":  # BERT as a masked LM builds no cache
        assert none["cache"].get_seq_length() == SEQ
        # Rerun switched the cache off in the rematerialized layers: the model returns the cache it made,
        # which no layer wrote to, before and after backward.
        assert picked["cache"] is not None and picked["cache"].get_seq_length() == 0
        assert picked["before"] == picked["after"] == []


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_replay_keeps_the_cache_and_backward_leaves_it_unchanged(name: str) -> None:
    make, _ = MODELS[name]
    none, replay = _step(make, name, "none"), _step(make, name, "replay")
    _assert_same(none, replay)
    assert replay["cache"].get_seq_length() == SEQ
    assert len(replay["before"]) == len(replay["after"]) == len(none["after"]) > 0
    for (keys, values), (keys_after, values_after) in zip(replay["before"], replay["after"], strict=True):
        assert torch.equal(keys, keys_after) and torch.equal(values, values_after)


def test_the_class_form_switches_the_cache_off_too() -> None:
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    forward = layer.forward
    none = _step(llama, "llama", "none")
    try:
        remat(layer)  # every instance, the same rule
        ours = _step(llama, "llama", "none")
    finally:
        layer.forward = forward
    _assert_same(none, ours)
    assert ours["peak"] < none["peak"]
    assert ours["cache"].get_seq_length() == 0


def test_an_applied_model_survives_deepcopy_and_pickle() -> None:
    model = remat.apply(llama().double().train())
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        out = clone(**batch())
        out.loss.backward()
        assert out.past_key_values.get_seq_length() == 0
        assert len(remat.plan(clone)) == 2


def test_each_model_picks_its_layers() -> None:
    for name, (make, kind) in MODELS.items():
        sites = list(remat.plan(remat.apply(make())))
        expected = 4 if name == "t5" else 2  # T5: two encoder and two decoder blocks
        assert [site.kind for site in sites] == [kind] * expected, name


def test_cache_is_kept_in_eval_and_without_grad_and_off_in_training_without_a_mask() -> None:
    model = remat.apply(llama().double())
    ids = batch()["input_ids"]
    model.eval()
    assert model(input_ids=ids).past_key_values.get_seq_length() == SEQ
    model.train()
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values.get_seq_length() == SEQ
    out = model(input_ids=ids, labels=ids)  # no mask: without the rule, backward would double the cache
    assert out.past_key_values.get_seq_length() == 0
    out.loss.backward()
    assert out.past_key_values.get_seq_length() == 0


@pytest.mark.parametrize("request_", [{}, {"head": True, "tiles": 4}, {"budget": 0.9}],
                         ids=["full", "head and tiles", "budget"])
def test_after_training_steps_generate_and_eval_give_the_plain_models_tokens_and_logits(
        request_: dict[str, Any]) -> None:
    """Train, then evaluate or generate, on the same model: remat stays out of the way once gradients are off (the
    cache kept, the head's logits whole, the tiles' output that of the untiled modules)."""
    base = llama().double()
    ids = batch()["input_ids"]
    if "budget" in request_:
        request_ = {**request_, "sample": {"input_ids": ids, "labels": ids}}
    plain, model = copy.deepcopy(base), remat.apply(copy.deepcopy(base), **request_)
    recomputes = _stats.recomputes
    for trained in (plain, model):
        for _ in range(2):  # a training step, then another with the gradients of the first in place
            trained(input_ids=ids, labels=ids).loss.backward()
    assert _stats.recomputes > recomputes, "remat ran in training"
    for trained in (plain, model):
        trained.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    prompt = ids[:, :4]
    expected = plain.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False), expected)
    model.train()
    with torch.no_grad():  # an evaluation left in training mode
        torch.testing.assert_close(model(input_ids=ids).logits, plain.train()(input_ids=ids).logits)


def test_one_log_line_per_model(caplog: pytest.LogCaptureFixture) -> None:
    models = [remat.apply(llama().double().train()) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="remat"):
        for model in models:
            for _ in range(2):
                model(**batch())
    lines = [record.getMessage() for record in caplog.records if record.name == "remat"]
    assert len(lines) == 2
    assert "LlamaDecoderLayer" in lines[0] and "`use_cache=False`" in lines[0] and "`past_key_values=None`" in lines[0]


def test_one_log_line_per_model_across_applies_and_a_budget_profile(caplog: pytest.LogCaptureFixture) -> None:
    """Re-applying to a model, and the profiling rounds of a budget, log the model's line once."""
    model = llama().double().train()
    with caplog.at_level(logging.WARNING, logger="remat"):
        remat.apply(model)
        model(**batch())
        remat.apply(remat.undo(model))
        model(**batch())
        remat.apply(remat.undo(model), budget=0.9, sample=batch())
        model(**batch())
    assert len([record for record in caplog.records if record.name == "remat"]) == 1


def test_one_log_line_for_layers_rematerialized_one_by_one(caplog: pytest.LogCaptureFixture) -> None:
    """`remat(layer)` in a loop over a model's layers logs the model's line once, not once per layer."""
    model = llama().double().train()
    layers = list(model.model.layers)
    assert len(layers) == 2
    with caplog.at_level(logging.WARNING, logger="remat"):
        for layer in layers:
            remat.remat(layer)
        for _ in range(2):
            out = model(**batch())
            out.loss.backward()
            assert out.past_key_values.get_seq_length() == 0  # the rule ran in every layer
    lines = [record.getMessage() for record in caplog.records if record.name == "remat"]
    assert len(lines) == 1 and "LlamaDecoderLayer" in lines[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_budget_on_a_padded_batch_keeps_gradients_and_peaks_below_no_remat(name: str) -> None:
    """`remat.apply(model, budget=...)` (docs/guides/budget.md) on transformers models with their default arguments."""
    make, _ = MODELS[name]
    none, got = _step(make, name, "none"), _step(make, name, "budget")
    plan = got["plan"].budget
    assert plan is not None and len(plan.cost) == 2 * (2 if name == "t5" else 1)
    _assert_same(none, got)
    assert got["peak"] < none["peak"]
    before, after = got["before"], got["after"]  # backward leaves the cache the model returned as it was
    assert len(before) == len(after) and all(map(torch.equal, sum(before, ()), sum(after, ())))


class StandIn(nn.Module):
    """A layer with transformers' argument names (CacheOff reads names, not types)."""

    def forward(self, x: Any, layer_past: Any = None, use_cache: bool = False, **kwargs: Any) -> Any:
        return x


def test_cache_off_by_keyword_and_by_position_and_only_in_training() -> None:
    rule, layer = CacheOff(), StandIn()
    assert rule(layer, (1, "cache", True), {}) == ((1, None, False), {})
    assert rule(layer, (1,), {"layer_past": "c", "cache_params": "d", "use_cache": True}) == (
        (1,), {"layer_past": None, "cache_params": None, "use_cache": False}
    )
    assert rule(layer, (1, None), {"use_cache": False}) is None  # nothing to change
    layer.eval()
    assert rule(layer, (1, "cache", True), {}) is None


def test_a_layer_that_may_checkpoint_with_its_cache_keeps_it() -> None:
    layer = StandIn()
    layer._can_checkpoint_with_cache = True  # type: ignore[assignment]
    assert CacheOff()(layer, (1, "cache"), {"use_cache": True}) == ((1, "cache"), {"use_cache": False})


def lora_models() -> Callable[[], nn.Module]:
    """Fresh LoRA models (PEFT) on copies of one tiny float64 Llama, each built from the same seed."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = llama().double()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)

    def make() -> nn.Module:
        torch.manual_seed(1)
        return peft.get_peft_model(copy.deepcopy(base), lora).train()  # type: ignore[no-any-return]

    return make


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # from peft
def test_peft_lora_trains_without_enable_input_require_grads() -> None:
    make = lora_models()
    grads = []
    for use_remat in (False, True):
        model = make()
        if use_remat:
            remat.apply(model)
            assert len(remat.plan(model)) == 2
        embedded: list[bool] = []
        model.get_input_embeddings().register_forward_hook(
            lambda m, a, out, seen=embedded: seen.append(out.requires_grad)
        )
        model(**batch()).loss.backward()
        assert embedded == [False]  # no input of the layers requires grad; only LoRA parameters inside do
        grads.append({name: p.grad for name, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 8
    for key, expected in grads[0].items():
        torch.testing.assert_close(grads[1][key], expected, msg=lambda m, k=key: f"{k}: {m}")


def test_import_remat_imports_neither_transformers_nor_the_integration() -> None:
    code = (
        "import sys, torch, remat\n"
        "remat.apply(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))\n"
        "loaded = [m for m in ('transformers', 'peft', 'remat._sites.integrations.transformers') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # from peft
def test_a_budget_on_a_peft_lora_model_keeps_its_gradients_and_lowers_its_peak() -> None:
    make = lora_models()
    runs = []
    for budget in (None, 0.8):
        model = make()
        if budget is not None:
            remat.apply(model, budget=budget, sample=batch())
            plan = remat.plan(model).budget
            assert plan is not None and len(plan.cost) == 2  # both layers planned
        with remat.track() as tracker:
            model(**batch()).loss.backward()
        runs.append(({name: p.grad for name, p in model.named_parameters() if p.requires_grad}, tracker.peak_bytes))
    (expected, none_peak), (got, peak) = runs
    assert expected.keys() == got.keys() and len(got) == 8
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, k=name: f"gradient of {k}: {m}")
    assert peak < none_peak
