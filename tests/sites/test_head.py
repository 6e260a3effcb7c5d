"""`remat.apply(model, head=True)` on Hugging Face causal LMs (docs/guides/head.md, NOTE [ A causal LM's head ]):
the loss through `remat.linear_cross_entropy`, gradients equal to no remat's in float64 on each model family.

The baseline is the same model without remat, its loss taken in float64 from its logits as its own `ForCausalLMLoss`
takes it (labels shifted, -100 ignored); the model's own loss upcasts float64 logits to float32 (`.float()`), which
`linear_cross_entropy` does not. Needs the `hf` extra; skipped without transformers.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._engine import stats as _stats
from remat._sites import cross_entropy as _cross_entropy
from remat._sites.integrations import causal_lm

transformers = pytest.importorskip("transformers")

EQUIVALENCE_HELPERS = ("routed_step(",)
VOCAB, SEQ, BATCH = 120, 12, 3
SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": VOCAB, "max_position_embeddings": SEQ}


def gpt2() -> nn.Module:  # tied embeddings, dropout on
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def llama(**extra: Any) -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, **extra))


def mistral() -> nn.Module:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, head_dim=16))


def qwen2() -> nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))


def gemma() -> nn.Module:  # tied embeddings, no soft-capping
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, head_dim=16))


def gemma2() -> nn.Module:  # tied embeddings, final logit soft-capping (30.0)
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, head_dim=16))


def granite() -> nn.Module:  # logits divided by `logits_scaling` before the loss
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(**SMALL, logits_scaling=3.0))


def cohere() -> nn.Module:  # logits times `logit_scale` before the loss
    return transformers.CohereForCausalLM(transformers.CohereConfig(**SMALL, logit_scale=0.5))


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "gpt2": gpt2, "llama": llama, "llama-tied": lambda: llama(tie_word_embeddings=True), "mistral": mistral,
    "qwen2": qwen2, "gemma": gemma, "gemma2": gemma2, "granite": granite, "cohere": cohere,
}


def batch() -> dict[str, torch.Tensor]:
    """A padded batch: the last row has four padding positions (attention_mask 0, labels -100)."""
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def fresh(make: Callable[[], nn.Module]) -> nn.Module:
    """A float64 model in training, from a fixed seed, its weights large enough that the logits differ."""
    torch.manual_seed(0)
    model = make().double().train()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.2)
    return model


def baseline(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """No remat: the loss in float64 from the model's logits, and every gradient."""
    torch.manual_seed(1)
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    labels = F.pad(inputs["labels"], (0, 1), value=-100)[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def routed_step(model: nn.Module, inputs: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """One step of a model applied with head=True; asserts that its loss went through the chunks."""
    before = _stats.head_chunks
    torch.manual_seed(1)
    out = model(**inputs)
    out.loss.backward()
    assert out.logits is None and "logits" not in out, "the loss did not go through linear_cross_entropy"
    assert _stats.head_chunks > before
    return out, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_same(expected: tuple[torch.Tensor, dict[str, torch.Tensor]], loss: torch.Tensor,
                grads: dict[str, torch.Tensor]) -> None:
    torch.testing.assert_close(loss, expected[0])
    assert grads.keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, k=name: f"gradient of {k}: {m}")


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Chunks of 4 KiB of logits (a few tokens each), so that the tiny models' heads run in many chunks."""
    monkeypatch.setattr(_cross_entropy, "CHUNK_BYTES", 4096)
    yield


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gradients_equal_no_remat_in_float64(family: str, small_chunks: None) -> None:
    base = fresh(FAMILIES[family])
    expected = baseline(copy.deepcopy(base), batch())
    model = remat.apply(copy.deepcopy(base), head=True)
    before = _stats.head_chunks
    out, grads = routed_step(model, batch())
    assert _stats.head_chunks - before >= 8  # 36 tokens x 120 classes x 8 bytes, in chunks of 4 KiB
    assert_same(expected, out.loss, grads)
    if family in ("gpt2", "llama-tied", "gemma", "gemma2", "cohere"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_the_model_own_loss_agrees_at_its_own_precision() -> None:
    """The model's own loss (`ForCausalLMLoss`) upcasts to float32: the routed one agrees with it there."""
    base = fresh(llama)
    own = copy.deepcopy(base)(**batch()).loss
    out, _ = routed_step(remat.apply(copy.deepcopy(base), head=True), batch())
    torch.testing.assert_close(out.loss.float(), own.float())


@pytest.mark.parametrize(
    "options",
    [
        {"policy": remat.policies.save_matmuls},
        {"strategy": "replay"},
        {"offload": True},
        {"every": 2},
        {"budget": 0.9, "sample": batch()},
        {"memory": "1GiB", "optimizer": "adamw", "sample": batch()},
    ],
    ids=["save_matmuls", "replay", "offload", "every-2", "budget", "memory"],
)
def test_combines_with_every_option(options: dict[str, Any]) -> None:
    base = fresh(llama)
    expected = baseline(copy.deepcopy(base), batch())
    model = remat.apply(copy.deepcopy(base), head=True, **options)
    out, grads = routed_step(model, batch())
    assert_same(expected, out.loss, grads)
    assert remat.plan(model).head is not None


def test_plan_shows_the_head_and_that_logits_are_none() -> None:
    model = remat.apply(fresh(gpt2), head=True)
    text = str(remat.plan(model))
    assert "head: lm_head (Linear)" in text and "output.logits is None" in text
    assert len(remat.plan(model)) == 2  # the two blocks; the head is its own line
    budgeted = remat.apply(fresh(llama), head=True, budget=0.9, sample=batch())
    assert "head: lm_head (Linear)" in str(remat.plan(budgeted))


def test_a_forward_without_labels_or_in_eval_is_unchanged() -> None:
    base = fresh(llama)
    model = remat.apply(copy.deepcopy(base), head=True)
    inputs = {key: value for key, value in batch().items() if key != "labels"}
    torch.manual_seed(1)
    expected = copy.deepcopy(base)(**inputs).logits
    torch.manual_seed(1)
    got = model(**inputs).logits
    torch.testing.assert_close(got, expected)
    model.eval()
    out = model(**batch())
    assert out.logits is not None and out.logits.shape == (BATCH, SEQ, VOCAB)
    torch.testing.assert_close(out.loss, copy.deepcopy(base).eval()(**batch()).loss)


def test_undo_gives_the_head_and_the_loss_back() -> None:
    model = fresh(gpt2)
    classes = (type(model), type(model.lm_head))
    remat.apply(model, head=True)
    assert isinstance(model.lm_head.__dict__.get("forward"), causal_lm.HeadForward)
    remat.undo(model)
    assert "forward" not in model.lm_head.__dict__ and "_loss_function" not in model.__dict__
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert remat.plan(model).head is None
    out = model(**batch())
    assert out.logits is not None
    assert (type(model), type(model.lm_head)) == classes  # classes are never changed


def test_applied_twice_it_routes_once() -> None:
    base = fresh(llama)
    expected = baseline(copy.deepcopy(base), batch())
    model = remat.apply(remat.apply(copy.deepcopy(base), head=True), head=True)
    assert sum(isinstance(h, causal_lm.HeadRoute) for h in model._forward_pre_hooks.values()) == 1
    out, grads = routed_step(model, batch())
    assert_same(expected, out.loss, grads)


def test_num_items_in_batch_and_shift_labels_as_the_models_loss() -> None:
    base = fresh(llama)
    inputs = batch()
    count = torch.tensor(17)
    own = copy.deepcopy(base)(**inputs, num_items_in_batch=count).loss
    out, _ = routed_step(remat.apply(copy.deepcopy(base), head=True), {**inputs, "num_items_in_batch": count})
    torch.testing.assert_close(out.loss.float(), own.float())
    shift = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    own = copy.deepcopy(base)(**inputs, shift_labels=shift).loss
    out, _ = routed_step(remat.apply(copy.deepcopy(base), head=True), {**inputs, "shift_labels": shift})
    torch.testing.assert_close(out.loss.float(), own.float())


def test_a_tuple_output_leaves_the_logits_out() -> None:
    base = fresh(llama)
    own = copy.deepcopy(base)(**batch(), return_dict=False)
    model = remat.apply(copy.deepcopy(base), head=True)
    out = model(**batch(), return_dict=False)
    assert len(out) == len(own) - 1 and all(not isinstance(x, causal_lm.DeferredLogits) for x in out)
    torch.testing.assert_close(out[0].float(), own[0].float())


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # from peft
def test_peft_lora_with_the_head_routed() -> None:
    peft = pytest.importorskip("peft")
    base = fresh(llama)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)

    def make() -> nn.Module:
        torch.manual_seed(1)
        return peft.get_peft_model(copy.deepcopy(base), lora).train()  # type: ignore[no-any-return]

    expected = baseline(make(), batch())
    model = remat.apply(make(), head=True)
    out, grads = routed_step(model, batch())
    assert len(grads) == 8  # the LoRA matrices: the frozen head makes no weight gradient
    assert_same(expected, out.loss, grads)
    assert "lm_head" in str(remat.plan(model))


def test_a_routed_model_survives_deepcopy_and_pickle() -> None:
    base = fresh(gpt2)
    expected = baseline(copy.deepcopy(base), batch())
    model = remat.apply(copy.deepcopy(base), head=True)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        out, grads = routed_step(twin, batch())
        assert_same(expected, out.loss, grads)
        assert twin.lm_head.__dict__["forward"]._module() is twin.lm_head


def test_the_step_peaks_far_below_full_remat(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vocabulary of 16,000 at 4 x 128 tokens: 31 MiB of float32 logits (and as much again for the loss), in
    chunks of 4 MiB."""
    monkeypatch.setattr(_cross_entropy, "CHUNK_BYTES", 4 * 2**20)

    def make() -> nn.Module:
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=16000, n_positions=128,
                                          bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).train()

    torch.manual_seed(0)
    base = make()
    ids = torch.randint(0, 16000, (4, 128), generator=torch.Generator().manual_seed(0))
    peaks = []
    for head in (False, True):
        model = remat.apply(copy.deepcopy(base), head=head)
        with remat.track() as tracker:
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        assert (out.logits is None) == head
        peaks.append(tracker.peak_bytes)
    logits = 4 * 128 * 16000 * 4
    assert peaks[0] > 2 * logits and peaks[1] < peaks[0] / 4, peaks


def test_a_routed_step_leaves_no_cycle_holding_the_hidden_states() -> None:
    """The head's placeholder and its call referred to each other: the last hidden states stayed alive after the
    step until the garbage collector ran (a budget's measured step read 0.5 MiB more on a 4-layer GPT-2)."""
    model = remat.apply(fresh(gpt2), head=True)
    seen: list[weakref.ref[torch.Tensor]] = []
    handle = model.transformer.ln_f.register_forward_hook(  # type: ignore[union-attr,operator]
        lambda module, args, out: seen.append(weakref.ref(out)))
    made = _stats.head_chunks
    gc.disable()
    try:
        out = model(**batch())
        assert out.logits is None and _stats.head_chunks > made  # the head was routed
        out.loss.backward()
        del out
        assert seen and seen[0]() is None, "the hidden states outlived the step without the garbage collector"
    finally:
        gc.enable()
        handle.remove()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # dynamo's and inductor's own
@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo reads a non-leaf's .grad while tracing (as test_compile_hf)
def test_under_torch_compile() -> None:
    base = fresh(llama)
    expected = baseline(copy.deepcopy(base), batch())
    model = remat.apply(copy.deepcopy(base), head=True)
    compiled = torch.compile(model, backend="aot_eager")
    out, _ = routed_step(compiled, batch())
    assert_same(expected, out.loss, {name: p.grad for name, p in model.named_parameters() if p.grad is not None})


def test_a_model_without_a_head_is_refused_naming_what_was_looked_for() -> None:
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"Hugging Face causal LM.*get_output_embeddings.*self\.loss_function"):
        remat.apply(plain, head=True)
    assert not any(m._forward_pre_hooks for m in plain.modules())
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="BertForMaskedLM"):
        remat.apply(bert, head=True)
    assert not any(m._forward_pre_hooks for m in bert.modules())
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, d_model=32, d_ff=64, d_kv=16, num_heads=2, vocab_size=VOCAB, decoder_start_token_id=0))
    with pytest.raises(ValueError, match=r"does not call `self\.loss_function`"):
        remat.apply(t5, head=True)
    with pytest.raises(TypeError, match="`head` must be a bool"):
        remat.apply(fresh(gpt2), head="yes")  # type: ignore[arg-type]


def test_a_failed_apply_leaves_the_head_as_it_was() -> None:
    model = fresh(gpt2)
    with pytest.raises(ValueError, match="found no submodule"):
        remat.apply(model, nn.Conv2d, head=True)
    assert "forward" not in model.lm_head.__dict__ and "_loss_function" not in model.__dict__
    assert not model._forward_pre_hooks


class _SlicedLlama(transformers.LlamaForCausalLM):  # type: ignore[misc]
    """A model that uses its logits before its loss in a way remat does not apply to chunks."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden)[..., :VOCAB]
        loss = None if labels is None else self.loss_function(logits, labels, VOCAB)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_an_unsupported_use_of_the_logits_is_a_clear_error_and_leaves_nothing_behind() -> None:
    model = remat.apply(_SlicedLlama(transformers.LlamaConfig(**SMALL)).train(), head=True)
    ids = batch()["input_ids"]
    with pytest.raises(remat.RematError, match=r"_SlicedLlama.*`logits\[...\]`.*head=False"):
        model(input_ids=ids, labels=ids)
    assert causal_lm._calls.stack == []
    assert model(input_ids=ids).logits.shape == (BATCH, SEQ, VOCAB)  # without labels it runs as its own code


@pytest.mark.ignores_switch  # sets the switch itself
def test_the_switch_off_runs_the_models_own_loss() -> None:
    model = remat.apply(fresh(llama), head=True)
    with remat.enabled(False):
        out = model(**batch())
    assert out.logits is not None
