"""`remat.apply(model, head=True)` on Hugging Face causal LMs (docs/guides/head.md, NOTE [ A causal LM's head ]):
the loss through `remat.linear_cross_entropy`, gradients equal to no remat's in float64 on each model family.

The baseline is the same model without remat, its loss taken in float64 from its logits as its own `ForCausalLMLoss`
takes it (labels shifted, -100 ignored); the model's own loss upcasts float64 logits to float32 (`.float()`), which
`linear_cross_entropy` does not. Needs the `hf` extra; skipped without transformers.
"""

from __future__ import annotations

import copy
import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import garbage_collector_off
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


def opt() -> nn.Module:  # tied embeddings; `self.lm_head(hidden).contiguous()` before the loss
    config = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2,
                                    vocab_size=VOCAB, max_position_embeddings=SEQ, word_embed_proj_dim=32)
    return transformers.OPTForCausalLM(config)


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "gpt2": gpt2, "llama": llama, "llama-tied": lambda: llama(tie_word_embeddings=True), "mistral": mistral,
    "qwen2": qwen2, "gemma": gemma, "gemma2": gemma2, "granite": granite, "cohere": cohere, "opt": opt,
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
    """Chunks of 4 KiB of logits (a few tokens each), so that the tiny models' heads run in many chunks (the CPU's
    floor of rows a chunk lowered to one: NOTE [ The head in chunks ], rule 3)."""
    monkeypatch.setattr(_cross_entropy, "CHUNK_BYTES", 4096)
    monkeypatch.setitem(_cross_entropy.MIN_ROWS, "cpu", 1)
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
    if family in ("gpt2", "llama-tied", "gemma", "gemma2", "cohere", "opt"):
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
    try:
        with garbage_collector_off():
            out = model(**batch())
            assert out.logits is None and _stats.head_chunks > made  # the head was routed
            out.loss.backward()
            del out
            assert seen and seen[0]() is None, "the hidden states outlived the step without the garbage collector"
    finally:
        handle.remove()


def test_a_routed_model_is_freed_when_its_last_reference_goes() -> None:
    """The route (the model's forward pre-hook) held the model: the cycle kept the model, its gradients and its
    optimizer's state until the garbage collector ran, so on an accelerator a loop that makes a model per run had
    the last one's bytes still allocated when the next one planned or trained."""
    model = remat.apply(fresh(gpt2), head=True)
    routed_step(model, batch())
    ref = weakref.ref(model)
    with garbage_collector_off():
        del model
        assert ref() is None, "a cycle through the head's route kept the model"
    twin = pickle.loads(pickle.dumps(remat.apply(fresh(gpt2), head=True)))
    routed_step(twin, batch())  # a copy's route holds the copy


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


# Reads of the logits that change no value (NOTE [ A causal LM's head ], rule 2): each is answered as the logits would
# answer it, and the loss still goes through the chunks. `seen` holds what the read gave, to compare with the
# model's own logits.
READS: dict[str, Callable[[Any, list[Any]], Any]] = {
    "contiguous": lambda logits, seen: logits.contiguous(),  # OPT
    "shape": lambda logits, seen: seen.append(logits.shape) or logits,  # Inkling's `logits.shape[-1]`
    "size()": lambda logits, seen: seen.append(logits.size()) or logits,
    "size(dim)": lambda logits, seen: seen.append((logits.size(-1), logits.size(0))) or logits,
    "dtype": lambda logits, seen: seen.append(logits.dtype) or logits,
    "device": lambda logits, seen: seen.append(logits.device) or logits,
    "dim()": lambda logits, seen: seen.append((logits.dim(), logits.ndim)) or logits,
    "float().dtype": lambda logits, seen: seen.append(logits.float().dtype) or logits,
}


class _ReadingLlama(transformers.LlamaForCausalLM):  # type: ignore[misc]
    """A model that reads its logits before its loss, as Inkling does (`vocab_size=logits.shape[-1]`)."""

    read = "contiguous"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = READS[self.read](self.lm_head(hidden), self.seen)
        if logits.shape[-1] > VOCAB:  # Inkling's test of its unpadded vocabulary
            raise AssertionError("the logits' shape was read wrong")
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=logits.shape[-1])
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("read", list(READS))
def test_reads_that_change_no_value_pass(read: str) -> None:
    base = fresh(llama)
    reading = _ReadingLlama(base.config).double().train()
    reading.load_state_dict(base.state_dict())
    reading.read, reading.seen = read, []
    twin = copy.deepcopy(reading)
    expected = baseline(twin, batch())
    model = remat.apply(copy.deepcopy(reading), head=True)
    out, grads = routed_step(model, batch())
    assert_same(expected, out.loss, grads)
    assert model.seen == twin.seen and len(model.seen) == (0 if read == "contiguous" else 1)


def test_the_dtype_read_is_autocasts_where_autocast_casts_the_head() -> None:
    reading = _ReadingLlama(transformers.LlamaConfig(**SMALL)).train()
    reading.read, reading.seen = "dtype", []
    model = remat.apply(reading, head=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routed_step(model, batch())
        remat.undo(model)
        model(**batch())
    assert reading.seen == [torch.bfloat16, torch.bfloat16]


USES: dict[str, tuple[Callable[[Any], Any], str]] = {
    "slice": (lambda logits: logits[..., :VOCAB], r"`logits\[...\]`"),
    "add": (lambda logits: logits + 1.0, r"`logits \+ ...`"),
    "view": (lambda logits: logits.view(-1, VOCAB), r"`logits\.view`"),
    "cast down": (lambda logits: logits.to(torch.bfloat16), r"`logits\.to\(...\)`"),
    "softmax": (lambda logits: torch.softmax(logits, -1), "`softmax`"),
    "channels_last": (lambda logits: logits.contiguous(memory_format=torch.channels_last), "channels_last"),
    "size of a name": (lambda logits: logits.size("vocab"), r"`logits\.size\('vocab'\)`"),
}


class _UsingLlama(transformers.LlamaForCausalLM):  # type: ignore[misc]
    """A model that changes its logits' values before its loss in a way remat does not apply to chunks."""

    use = "slice"

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        logits = USES[self.use][0](self.lm_head(self.model(input_ids=input_ids).last_hidden_state))
        loss = None if labels is None else self.loss_function(logits, labels, VOCAB)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("use", list(USES))
def test_uses_that_change_values_are_still_refused(use: str) -> None:
    model = _UsingLlama(transformers.LlamaConfig(**SMALL)).train()
    model.use = use
    remat.apply(model, head=True)
    ids = batch()["input_ids"]
    with pytest.raises(remat.RematError, match=r"_UsingLlama.*" + USES[use][1] + r".*needs the logits' values"):
        model(input_ids=ids, labels=ids)
    assert causal_lm._calls.stack == []


class _AdapterHead(nn.Module):
    """A PEFT-like adapter on the head: the base layer inside, and more computed beside it."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) * 2


class _OwnLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).clamp(max=1.0)


@pytest.mark.parametrize(
    ("replace", "words"),
    [
        (lambda head: nn.ModuleList([head, copy.deepcopy(head)]),
         r"a list of 2 heads \(`ModuleList` of `Linear`\), where remat routes the loss of one projection"),
        (lambda head: _OwnLinear(32, VOCAB), r"`_OwnLinear`, a subclass of nn.Linear with a forward of its own"),
        (lambda head: _AdapterHead(head), r"`_AdapterHead`, an adapter around an nn.Linear"),
        (lambda head: nn.Identity(), r"`Identity` \(from `torch.nn.modules.linear`\), not an nn.Linear"),
        (lambda head: None, "None: the model has no output projection"),
    ],
    ids=["list", "subclass", "adapter", "other", "none"],
)
def test_a_head_that_is_not_a_plain_linear_is_refused_saying_what_it_is(replace: Callable[[Any], Any],
                                                                        words: str) -> None:
    model = fresh(llama)
    model.lm_head = replace(model.lm_head)
    with pytest.raises(ValueError, match=r"`LlamaForCausalLM`'s output embeddings are " + words):
        remat.apply(model, head=True)
    assert not model._forward_pre_hooks


def test_musicgens_heads_are_refused_as_a_list() -> None:
    config = transformers.MusicgenDecoderConfig(num_hidden_layers=1, hidden_size=32, ffn_dim=32,
                                                num_attention_heads=2, vocab_size=50, num_codebooks=4,
                                                pad_token_id=0, bos_token_id=0)
    with pytest.raises(ValueError, match=r"a list of 4 heads \(`ModuleList` of `Linear`\)"):
        remat.apply(transformers.MusicgenForCausalLM(config), head=True)


@pytest.mark.ignores_switch  # sets the switch itself
def test_the_switch_off_runs_the_models_own_loss() -> None:
    model = remat.apply(fresh(llama), head=True)
    with remat.enabled(False):
        out = model(**batch())
    assert out.logits is not None


def test_a_keyboard_interrupt_after_the_heads_call_leaves_no_call_open() -> None:
    """torch runs no always-called hook for a `KeyboardInterrupt`: the call stayed open, its placeholder holding
    the head's input (the last hidden states) for the rest of the process. The model's next forward ends it."""
    expected = baseline(fresh(llama), batch())
    model = remat.apply(fresh(llama), head=True)
    held: list[weakref.ref[torch.Tensor]] = []

    def interrupt(module: nn.Module, args: Any, output: Any) -> None:
        held.append(weakref.ref(output.hidden))
        raise KeyboardInterrupt

    handle = model.lm_head.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(**batch())
    handle.remove()
    out, grads = routed_step(model, batch())
    assert_same(expected, out.loss, grads)
    assert held[0]() is None, "the interrupted call's hidden states outlived the next step"
    assert causal_lm._calls.stack == []
