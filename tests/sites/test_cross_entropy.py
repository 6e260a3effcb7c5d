"""`remat.linear_cross_entropy` (docs/guides/head.md, NOTE [ The head in chunks ]): the value and gradients of
`F.cross_entropy(F.linear(...).float(), ...)` over chunks of tokens, never all the logits at once."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._core.torch_compat import host_bytes
from remat._engine import stats as _stats
from remat._sites import cross_entropy as _cross_entropy
from remat._sites.cross_entropy import ACCELERATOR_ROWS, CHUNK_BYTES, MIN_ROWS, chunk_count, min_rows

EQUIVALENCE_HELPERS = ("chunks_made(",)


def reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None, *,
    softcap: float | None = None, **keywords: Any,
) -> torch.Tensor:
    """The plain composition, every logit at once, as a Hugging Face model computes its loss."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    flat = logits.reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(flat.to(torch.promote_types(flat.dtype, torch.float32)), labels.reshape(-1), **keywords)
    return loss.view(labels.shape) if keywords.get("reduction") == "none" else loss


class chunks_made:
    """How many chunks of logits `linear_cross_entropy` made inside the block (`.count`)."""

    def __enter__(self) -> chunks_made:
        self.before = _stats.head_chunks
        return self

    def __exit__(self, *exc: object) -> None:
        self.count = _stats.head_chunks - self.before


def inputs(
    batch: int = 2, seq: int = 9, hidden: int = 6, vocabulary: int = 13, *, bias: bool = False, seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=generator, dtype=dtype).requires_grad_()
    w = torch.randn(vocabulary, hidden, generator=generator, dtype=dtype).requires_grad_()
    b = torch.randn(vocabulary, generator=generator, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocabulary, (batch, seq), generator=generator)
    labels[0, :6] = -100  # with chunks of 3 tokens, the first two chunks are all ignored
    labels[-1, 4] = -100
    return h, w, labels, b


def grads_of(loss: torch.Tensor, tensors: list[torch.Tensor], seed: int = 3) -> tuple[torch.Tensor, ...]:
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=loss.dtype)
    return torch.autograd.grad(loss, tensors, upstream)


@pytest.mark.parametrize(
    ("reduction", "smoothing", "bias"), list(itertools.product(("mean", "sum", "none"), (0.0, 0.25), (False, True)))
)
@pytest.mark.parametrize("chunks", [1, 6, 18, 100])
def test_value_and_gradients_equal_the_plain_composition_in_float64(
    reduction: str, smoothing: float, bias: bool, chunks: int
) -> None:
    h, w, labels, b = inputs(bias=bias)
    tensors = [t for t in (h, w, b) if t is not None]
    keywords: dict[str, Any] = {"reduction": reduction, "label_smoothing": smoothing}
    expected = reference(h, w, labels, b, **keywords)
    with chunks_made() as made:
        loss = remat.linear_cross_entropy(h, w, labels, b, chunks=chunks, **keywords)
        grads = grads_of(loss, tensors)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, grads_of(expected, tensors), strict=True):
        torch.testing.assert_close(got, want)
    passes = 2 if reduction == "none" else 1  # "none" makes each chunk's logits again in backward
    assert made.count == passes * min(chunks, 18)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_every_token_ignored_gives_torchs_value_and_zero_gradients(reduction: str, smoothing: float) -> None:
    h, w, labels, _ = inputs()
    labels.fill_(-100)
    keywords: dict[str, Any] = {"reduction": reduction, "label_smoothing": smoothing}
    with chunks_made() as made:
        loss = remat.linear_cross_entropy(h, w, labels, chunks=3, **keywords)
        grads = grads_of(loss, [h, w])
    expected = reference(h, w, labels, **keywords)
    torch.testing.assert_close(loss, expected, equal_nan=True)  # "mean" over no token: NaN, as torch's
    for got, want in zip(grads, grads_of(expected, [h, w]), strict=True):
        torch.testing.assert_close(got, want)
        assert not got.any()
    assert made.count >= 3


def test_ignore_index_other_than_the_default() -> None:
    h, w, labels, _ = inputs()
    labels[labels == -100] = 5  # a real class becomes the ignored one
    with chunks_made() as made:
        loss = remat.linear_cross_entropy(h, w, labels, ignore_index=5, chunks=4)
        grads = grads_of(loss, [h, w])
    expected = reference(h, w, labels, ignore_index=5)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, grads_of(expected, [h, w]), strict=True):
        torch.testing.assert_close(got, want)
    assert made.count == 4


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softcap_is_gemma2s_soft_capping(reduction: str) -> None:
    h, w, labels, b = inputs(bias=True)
    with chunks_made() as made:
        loss = remat.linear_cross_entropy(h, w, labels, b, softcap=1.5, reduction=reduction, chunks=5)
        grads = grads_of(loss, [h, w, b])  # type: ignore[list-item]
    expected = reference(h, w, labels, b, softcap=1.5, reduction=reduction)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, grads_of(expected, [h, w, b]), strict=True):  # type: ignore[list-item]
        torch.testing.assert_close(got, want)
    assert made.count >= 5


def test_int32_labels_are_class_indices_too() -> None:
    h, w, labels, _ = inputs()
    with chunks_made() as made:
        loss = remat.linear_cross_entropy(h, w, labels.int(), chunks=3)
    torch.testing.assert_close(loss, reference(h, w, labels))
    assert made.count == 3


def test_2d_tokens_and_one_dimensional_labels() -> None:
    h, w, labels, _ = inputs()
    flat_h, flat_labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    with chunks_made() as made:
        loss = remat.linear_cross_entropy(flat_h, w, flat_labels, reduction="none", chunks=2)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(flat_h, w), flat_labels, reduction="none"))
    assert loss.shape == (18,) and made.count == 2


def test_only_the_gradients_asked_for_are_made() -> None:
    h, w, labels, _ = inputs()
    w.requires_grad_(False)  # a frozen head (LoRA): no weight gradient, and none is made
    with chunks_made() as made:
        loss = remat.linear_cross_entropy(h, w, labels, chunks=3)
    loss.backward()
    assert h.grad is not None and w.grad is None
    (expected,) = torch.autograd.grad(reference(h, w, labels), [h])
    torch.testing.assert_close(h.grad, expected)
    assert made.count == 3


def test_without_gradients_only_the_loss_is_made() -> None:
    h, w, labels, _ = inputs()
    with torch.no_grad(), chunks_made() as made:
        loss = remat.linear_cross_entropy(h, w, labels, chunks=3)
    assert loss.grad_fn is None and made.count == 3
    torch.testing.assert_close(loss, reference(h, w, labels))


def test_retain_graph_twice_and_grad_of_a_subset() -> None:
    h, w, labels, _ = inputs()
    for reduction in ("mean", "none"):
        with chunks_made() as made:
            loss = remat.linear_cross_entropy(h, w, labels, chunks=3, reduction=reduction).sum()
            first = torch.autograd.grad(loss, [h, w], retain_graph=True)
            second = torch.autograd.grad(loss * 1.0, [w])  # a subset, through the same graph again
        expected = torch.autograd.grad(reference(h, w, labels, reduction=reduction).sum(), [h, w])
        torch.testing.assert_close(first, expected)
        torch.testing.assert_close(second[0], expected[1])
        assert made.count >= 3


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_second_derivative_is_refused_not_silently_zero(reduction: str) -> None:
    h, w, labels, _ = inputs()
    loss = remat.linear_cross_entropy(h, w, labels, chunks=3, reduction=reduction).sum()
    with pytest.raises(remat.RematError, match="no second derivative"):
        torch.autograd.grad(loss, [h], create_graph=True)


def test_a_scalar_loss_used_again_gets_its_gradient_scaled() -> None:
    h, w, labels, _ = inputs()
    with chunks_made() as made:
        loss = remat.linear_cross_entropy(h, w, labels, chunks=3)
        got = torch.autograd.grad(loss.square() * 3, [h, w])
    plain = reference(h, w, labels)
    torch.testing.assert_close(got, torch.autograd.grad(plain.square() * 3, [h, w]))
    assert made.count == 3


def test_what_forward_keeps_goes_with_backward() -> None:
    """The gradients forward kept are freed by backward, not when the loss is dropped."""
    h, w, labels, _ = inputs(seq=64, hidden=32, vocabulary=200)
    loss = remat.linear_cross_entropy(h, w, labels, chunks=4)
    grad_fn = loss.grad_fn
    assert grad_fn is not None
    kept = [weakref.ref(t) for t in grad_fn.saved_tensors if t is not None]  # type: ignore[attr-defined]
    assert len(kept) == 2  # the gradients of hidden and weight
    loss.backward()
    assert all(ref() is None for ref in kept)


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_the_step_peaks_at_one_chunk_of_logits_not_all() -> None:
    """Forward and backward of 4,096 tokens x 8,000 classes: 125 MiB of float32 logits at once without remat."""
    h, w, labels, _ = inputs(batch=4, seq=1024, hidden=32, vocabulary=8000, dtype=torch.float32)
    logits_bytes = 4 * 1024 * 8000 * 4
    parameters = w.numel() * 4 + h.numel() * 4  # the gradients of the weight and of the hidden states
    for reduction in ("mean", "none"):
        h.grad = w.grad = None
        with remat.track() as plain:
            reference(h, w, labels, reduction=reduction).sum().backward()
        h.grad = w.grad = None
        with remat.track() as tracked, chunks_made() as made:
            remat.linear_cross_entropy(h, w, labels, reduction=reduction, chunks=16).sum().backward()
        assert plain.peak_bytes > 2 * logits_bytes
        assert tracked.peak_bytes <= logits_bytes / 16 * 1.5 + 2 * parameters, (reduction, tracked.peak_bytes)
        assert tracked.peak_bytes >= logits_bytes / 16  # the tracker sees each chunk's logits
        assert made.count == (32 if reduction == "none" else 16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_soft_capping_holds_two_chunks_of_logits_at_most(reduction: str) -> None:
    """Soft-capped logits (Gemma 2's, Beam's: div, tanh, mul) hold the chunk's tanh for its gradient beside the
    chunk the loss works in, and no chunk-sized temporary more: the step peaks at two chunks of logits, not four
    (where the logits are one chunk, the head in chunks then peaks below the plain composition)."""
    h, w, labels, _ = inputs(batch=1, seq=512, hidden=16, vocabulary=4000, dtype=torch.float32)
    chunk = 512 // 4 * 4000 * 4
    parameters = w.numel() * 4 + h.numel() * 4
    with remat.track() as tracked:
        remat.linear_cross_entropy(h, w, labels, softcap=30.0, reduction=reduction, chunks=4).sum().backward()
    assert chunk * 2 <= tracked.peak_bytes <= chunk * 2.25 + 2 * parameters, (tracked.peak_bytes, chunk)


def test_chunks_none_aims_at_64_mib_of_logits_per_chunk() -> None:
    assert CHUNK_BYTES == 64 * 2**20
    assert chunk_count(16384, 50257) == 50  # GPT-2 at batch 16 x 1024: 3.1 GiB of float32 logits
    assert chunk_count(2048, 50257) == 7
    assert chunk_count(100, 1000) == 1
    assert chunk_count(2048, 50257, torch.float64) == 13
    h, w, labels, _ = inputs(batch=2, seq=350, hidden=4, vocabulary=50000, dtype=torch.float32)
    with chunks_made() as made:
        remat.linear_cross_entropy(h, w, labels).backward()
    assert made.count == chunk_count(700, 50000) == 3


@pytest.mark.parametrize(
    ("tokens", "vocabulary", "device", "count"),
    [
        (16384, 50257, "cpu", 50),  # GPT-2, batch 16 x 1024: 64 MiB of logits a chunk (328 rows) is above 64 rows
        (16384, 50257, "cuda", 16),  # on a GPU, 1,024 rows a chunk: 196 MiB of float32 logits
        (8192, 32000, "cuda", 8),  # a TinyLlama-shaped 1.1B, batch 4 x 2048
        (8192, 32000, "cpu", 16),  # 524 rows of 32,000 classes: 64 MiB
        (8192, 262144, "cpu", 128),  # a 256k vocabulary: the CPU's floor of 64 rows wins over 64 MiB's 64 rows
        (8192, 262144, "cuda", 8),  # the GPU's floor: 1 GiB of float32 logits a chunk
        (1000, 50257, "cuda", 1),  # fewer tokens than the floor: one chunk
        (1500, 50257, "cuda", 1),  # one chunk of 1,500 rows rather than two of 750
        (2048, 8, "cpu", 1),  # a tiny vocabulary: every token in one chunk of 64 KiB
    ],
)
def test_chunks_none_takes_the_rows_the_device_needs(tokens: int, vocabulary: int, device: str, count: int) -> None:
    """NOTE [ The head in chunks ], rule 3: rows for `CHUNK_BYTES` of logits, never fewer than the device's floor."""
    assert min_rows("cpu") == 64 and min_rows("cuda") == min_rows("xpu:1") == 1024
    assert chunk_count(tokens, vocabulary, torch.float32, device) == count
    assert chunk_count(tokens, vocabulary, torch.float32, torch.device(device)) == count


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200_000), st.integers(2, 300_000), st.sampled_from(["cpu", "cuda", "remat_test"]),
       st.sampled_from([torch.float32, torch.float64]))
def test_every_chunk_has_the_floors_rows_and_no_more_than_it_needs(
    tokens: int, vocabulary: int, device: str, dtype: torch.dtype,
) -> None:
    floor = MIN_ROWS.get(device, ACCELERATOR_ROWS)
    count = chunk_count(tokens, vocabulary, dtype, device)
    size = -(-tokens // count)  # rows of a chunk, as `linear_cross_entropy` spreads them
    assert 1 <= count <= max(1, tokens)
    assert size >= min(floor, tokens)
    enough = max(floor, CHUNK_BYTES // (vocabulary * dtype.itemsize), 1)  # the rows rule 3 aims at
    assert size <= max(2 * enough, 1) and (count == 1 or size <= 2 * enough)


def test_on_another_device_chunks_none_takes_the_accelerators_rows(test_device: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MIN_ROWS, test_device, 40)  # the floor of this device type, as CUDA's is 1,024
    monkeypatch.setattr(_cross_entropy, "CHUNK_BYTES", 1)  # the floor decides
    h, w, labels, _ = inputs(batch=2, seq=100, hidden=8, vocabulary=50, dtype=torch.float32)
    moved = [t.detach().to(test_device).requires_grad_() for t in (h, w)]
    with chunks_made() as made:
        remat.linear_cross_entropy(moved[0], moved[1], labels.to(test_device)).backward()
    assert made.count == chunk_count(200, 50, torch.float32, test_device) == 5  # 200 tokens, 40 rows a chunk
    assert chunk_count(200, 50, torch.float32, "cpu") == 3  # the CPU's floor: 64 rows


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_where_the_floor_wins_the_step_still_peaks_at_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A floor of 256 rows over 1 MiB's 32 rows: 16 chunks of 256 rows, and the peak is one chunk's logits."""
    monkeypatch.setattr(_cross_entropy, "CHUNK_BYTES", 2**20)
    monkeypatch.setitem(MIN_ROWS, "cpu", 256)
    h, w, labels, _ = inputs(batch=4, seq=1024, hidden=32, vocabulary=8000, dtype=torch.float32)
    chunk_bytes = 256 * 8000 * 4
    parameters = w.numel() * 4 + h.numel() * 4  # the gradients of the weight and of the hidden states
    for reduction in ("mean", "none"):
        h.grad = w.grad = None
        with remat.track() as tracked, chunks_made() as made:
            remat.linear_cross_entropy(h, w, labels, reduction=reduction).sum().backward()
        assert made.count == (32 if reduction == "none" else 16)
        assert chunk_bytes <= tracked.peak_bytes <= 1.5 * chunk_bytes + 2 * parameters, tracked.peak_bytes
    with torch.autocast("cpu", dtype=torch.bfloat16), remat.track() as tracked:  # and a copy in bfloat16
        remat.linear_cross_entropy(h, w, labels).backward()
    assert tracked.peak_bytes <= 1.5 * chunk_bytes + chunk_bytes / 2 + 2 * parameters, tracked.peak_bytes


class _Passes(TorchDispatchMode):
    """The aten ops that read or write a whole chunk of logits (a tensor shaped `chunk`), matmuls and the label's
    entries (`gather`, `scatter_`) left out: the passes over the chunk that rule 6 counts."""

    NOT_PASSES = ("mm", "addmm", "gather", "scatter_", "t", "view", "_unsafe_view", "detach", "empty", "empty_like",
                  "slice", "expand", "transpose", "alias", "as_strided")

    def __init__(self, chunk: tuple[int, int]) -> None:
        super().__init__()
        self.chunk, self.names = chunk, []  # type: list[str]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = [t for t in (*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple) else (out,)))
                if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        if name not in self.NOT_PASSES and any(tuple(t.shape) == self.chunk for t in seen):
            self.names.append(name)
        return out


@pytest.mark.parametrize(
    ("autocast", "smoothing", "passes"),
    [
        (False, 0.0, ["amax", "sub_", "exp_", "sum", "mul_"]),
        (True, 0.0, ["amax", "sub", "exp_", "sum", "mul"]),  # the upcast and the downcast are passes it makes anyway
        (False, 0.1, ["amax", "sub_", "mean", "exp_", "sum", "mul_", "sub_"]),
    ],
    ids=["float32", "bf16 autocast", "label smoothing"],
)
def test_a_chunk_goes_over_its_logits_in_few_passes(autocast: bool, smoothing: float, passes: list[str]) -> None:
    """NOTE [ The head in chunks ], rule 6: max, shift, exp, sum, and the normalisation into the matmuls' dtype; the
    tokens' weights and the label's entries never take a pass of their own."""
    h, w, labels, _ = inputs(batch=2, seq=24, hidden=16, vocabulary=300, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), _Passes((12, 300)) as seen:
        loss = remat.linear_cross_entropy(h, w, labels, chunks=4, label_smoothing=smoothing)
    assert seen.names == passes * 4, seen.names
    expected = reference(h, w, labels, label_smoothing=smoothing)
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if autocast else {}
    torch.testing.assert_close(loss, expected, **tolerance)


def test_under_autocast_the_projection_runs_in_autocasts_dtype_and_the_loss_in_float32() -> None:
    h, w, labels, b = inputs(batch=2, seq=48, hidden=16, vocabulary=300, bias=True, dtype=torch.float32)
    tensors: list[torch.Tensor] = [h, w, b]  # type: ignore[list-item]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with chunks_made() as made:
            loss = remat.linear_cross_entropy(h, w, labels, b, chunks=4)
        expected = reference(h, w, labels, b)
    assert loss.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-2, atol=1e-2)
    grads, wanted = grads_of(loss, tensors), grads_of(expected, tensors)
    for got, want in zip(grads, wanted, strict=True):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert made.count == 4
    # the projection ran in bfloat16: its hidden gradient is that of bfloat16 matmuls, not float32's
    (full,) = grads_of(reference(h, w, labels, b), [h])
    assert not torch.equal(grads[0], full)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_under_torch_compile(reduction: str) -> None:
    h, w, labels, b = inputs(bias=True)
    tensors: list[torch.Tensor] = [h, w, b]  # type: ignore[list-item]

    def step(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        loss = remat.linear_cross_entropy(h, w, labels, b, reduction=reduction, label_smoothing=0.1, chunks=4)
        return loss.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(h, w, labels, b)
    expected = reference(h, w, labels, b, reduction=reduction, label_smoothing=0.1).sum()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, tensors), torch.autograd.grad(expected, tensors))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own imports
def test_under_torch_compile_the_compiled_step_holds_one_chunk() -> None:
    """Inductor's code keeps the chunks: a compiled step peaks near one chunk's logits too."""
    h, w, labels, _ = inputs(batch=2, seq=512, hidden=32, vocabulary=4000, dtype=torch.float32)
    logits_bytes = 2 * 512 * 4000 * 4

    def step(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return remat.linear_cross_entropy(h, w, labels, chunks=8)

    compiled = torch.compile(step, fullgraph=True)

    def run() -> None:
        h.grad = w.grad = None
        compiled(h, w, labels).backward()

    run()  # compiles
    found = host_bytes(run)  # the CPU allocator's records: a tracker's dispatch mode would stop dynamo
    if found is None:
        pytest.skip("this torch cannot record the CPU allocator")
    assert found[0] < logits_bytes / 2, found


def test_on_another_device(accelerator: str) -> None:
    h, w, labels, b = inputs(bias=True)
    moved = [t.detach().to(accelerator).requires_grad_() for t in (h, w, b)]  # type: ignore[union-attr]
    for reduction in ("mean", "none"):
        with chunks_made() as made:
            loss = remat.linear_cross_entropy(moved[0], moved[1], labels.to(accelerator), moved[2],
                                              reduction=reduction, label_smoothing=0.1, chunks=3)
            grads = grads_of(loss.cpu(), moved)  # type: ignore[arg-type]
        assert loss.device.type == accelerator
        expected = reference(h, w, labels, b, reduction=reduction, label_smoothing=0.1)
        torch.testing.assert_close(loss.cpu(), expected)
        for got, want in zip(grads, grads_of(expected, [h, w, b]), strict=True):  # type: ignore[list-item]
            torch.testing.assert_close(got.cpu(), want)
        assert made.count >= 3


@pytest.mark.ignores_switch  # sets the switch itself
def test_the_switch_off_makes_it_the_plain_composition() -> None:
    h, w, labels, _ = inputs()
    with remat.enabled(False), chunks_made() as made:
        loss = remat.linear_cross_entropy(h, w, labels, chunks=3)
    assert made.count == 0
    torch.testing.assert_close(loss, reference(h, w, labels))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda h, w, y: remat.linear_cross_entropy(h, w, y, reduction="avg"), "'mean', 'sum' or 'none'"),
        (lambda h, w, y: remat.linear_cross_entropy(h, w, y, chunks=0), "positive int or None"),
        (lambda h, w, y: remat.linear_cross_entropy(h, w, y, label_smoothing=1.5), r"in \[0, 1\]"),
        (lambda h, w, y: remat.linear_cross_entropy(h, w.t(), y), r"`weight` \(V, H\)"),
        (lambda h, w, y: remat.linear_cross_entropy(h, w, y[:, 1:]), "one label per token"),
        (lambda h, w, y: remat.linear_cross_entropy(h, w, y.double()), "integer tensor"),
        (lambda h, w, y: remat.linear_cross_entropy(h, w, y, torch.zeros(3)), r"None or \(13,\)"),
        (lambda h, w, y: remat.linear_cross_entropy(h, w, y, softcap=0), "positive number"),
        (lambda h, w, y: remat.linear_cross_entropy(h, w.float(), y), "one dtype"),
    ],
)
def test_bad_arguments_are_named(call: Callable[..., Any], message: str) -> None:
    h, w, labels, _ = inputs()
    with pytest.raises((ValueError, TypeError), match=message):
        call(h, w, labels)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_under_autocast_chunks_of_the_accelerators_rows_give_the_plain_value_and_gradients() -> None:
    """NOTE [ The head in chunks ], rules 3 and 6 on a GPU: 4,096 tokens of GPT-2's head in chunks of 1,024 rows,
    the shift made in float32 from bfloat16 logits and the softmax written back into them."""
    h, w, labels, b = inputs(batch=4, seq=1024, hidden=768, vocabulary=50257, bias=True, dtype=torch.float32)
    moved = [t.detach().cuda().requires_grad_() for t in (h, w, b)]  # type: ignore[union-attr]
    labels = labels.cuda()
    assert chunk_count(4096, 50257, torch.float32, "cuda") == 4
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with chunks_made() as made:
            loss = remat.linear_cross_entropy(moved[0] * 0.05, moved[1], labels, moved[2])
        expected = reference(moved[0] * 0.05, moved[1], labels, moved[2])
    assert made.count == 4 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-2, atol=1e-2)
    for got, want in zip(grads_of(loss.cpu(), moved), grads_of(expected.cpu(), moved), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_the_chunks_matmuls_add_their_partial_sums_in_float32() -> None:
    """NOTE [ The head in chunks ], rule 8: cuBLAS added a chunk's split sums over the vocabulary in bf16 (a GPT-2's
    gradients under bf16 autocast strayed far from float32's on an H200); the flag is off for the chunks' matmuls
    and back as it was after."""
    matmul = torch.backends.cuda.matmul
    seen: list[tuple[bool, bool]] = []

    class Flags(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                seen.append((matmul.allow_bf16_reduced_precision_reduction,
                             matmul.allow_fp16_reduced_precision_reduction))
            return func(*args, **(kwargs or {}))

    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    labels = torch.randint(0, 30, (12,))
    before = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    with Flags():
        remat.linear_cross_entropy(hidden, weight, labels, chunks=3).backward()
    assert seen and set(seen) == {(False, False)}
    assert (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction) == before
    torch.testing.assert_close(hidden.grad, torch.func.grad(
        lambda h: F.cross_entropy(F.linear(h, weight.detach()), labels))(hidden.detach()))
