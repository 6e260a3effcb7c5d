"""`remat.linear_cross_entropy`: a language model's head and its loss, computed over chunks of tokens.

See NOTE [ The head in chunks ].
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .._core import switch as _switch
from .._core.errors import RematError
from .._core.public import claim
from .._engine import stats as _stats
from .._engine.compiled import compiling
from .._engine.once import parts

__all__ = ["ACCELERATOR_ROWS", "CHUNK_BYTES", "MIN_ROWS", "Transform", "chunk_count", "chunked",
           "linear_cross_entropy", "logits_dtype", "min_rows", "softcap_transform"]

Reduction = Literal["mean", "sum", "none"]
Transform = tuple[tuple[str, float], ...]
"""Elementwise steps a model applies to its logits before the loss, in order: ``("div", c)``, ``("mul", c)``,
``("tanh", 0.0)`` (Gemma 2's soft-capping is ``div c, tanh, mul c``)."""

CHUNK_BYTES = 64 * 2**20
"""What `chunks=None` aims at: the bytes of one chunk's logits in the loss's dtype (NOTE [ The head in chunks ],
rule 3)."""

# NOTE [ The head in chunks ]
# The logits of a language model's output projection are batch x seq x vocabulary, made in the projection's dtype,
# copied to float32 for the loss, and matched by a gradient as large: the largest activation of a training step,
# which rematerializing the blocks leaves alone. `linear_cross_entropy` never holds more than one chunk of them.
#
# Rules:
# 1. Value and gradients are those of `F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ...)`
#    (flattened over tokens), with `ignore_index`, `label_smoothing` and every reduction: a mean over no tokens is
#    NaN with zero gradients, as torch's. Under autocast the projection runs in autocast's dtype (the inputs cast as
#    autocast casts them: floating and not float64) and the loss in float32; the loss's dtype is never below
#    float32 and never below the projection's (float64 stays float64: `.float()` would round it).
# 2. Tokens go through in chunks: a chunk's logits are made, turned into its loss and, where a gradient is needed,
#    into the gradient of the logits, and then into the chunk's share of the gradients of `hidden`, `weight` and
#    `bias`, before the next chunk starts. For "mean" and "sum" this happens in forward (as Liger's fused linear
#    cross-entropy does): backward only scales the gradients forward kept by the loss's gradient, a scalar, so
#    the step does the projection's three matmuls once, as without remat. What is kept between forward and
#    backward is the size of `hidden`, `weight` and `bias` (their gradients), never of the logits. For "none" the
#    loss's gradient differs per token and cannot scale a sum already made, so forward keeps only the inputs and
#    backward makes each chunk's logits again: the rematerialization proper, one more matmul per chunk.
# 3. `chunks=None` sizes a chunk in rows (tokens): as many as make `CHUNK_BYTES` of logits in the loss's dtype, and
#    never fewer than the device's floor (`min_rows`: `MIN_ROWS` per device type, `ACCELERATOR_ROWS` on the others),
#    the tokens spread evenly over the chunks (each with the floor's rows at least, where there are that many).
#    Memory: what a chunk holds at its peak is its logits in the loss's dtype plus, under autocast, one copy in the
#    projection's dtype, a constant whatever the batch and sequence, where the full logits grow with both
#    (gigabytes at real sizes). Speed: each chunk's three matmuls read the whole weight (V x H) and add into the
#    whole of its gradient, a cost per chunk that only the chunk's rows pay off: a matmul of M rows against the
#    weight does 2M flops per weight element it reads, so it runs at the device's full speed only from M of the
#    order of the device's flops per byte of memory traffic, tens on a CPU and about a thousand on a GPU of the
#    H100's class. Where the vocabulary is large the floor wins and a chunk holds more than `CHUNK_BYTES` (the
#    floor's rows times the vocabulary): still a constant, and a small part of the logits it replaces at the
#    sequences where they matter. The step times behind both numbers are in docs/benchmarks.md
#    ("Figures behind the design notes").
# 4. The result does not depend on the chunk count beyond the order of float sums.
# 5. `REMAT=0` (the switch) makes it the plain composition of rule 1 (the full logits), as every site.
# 6. A chunk's elementwise work (the loss, the softmax, the gradient of its logits) goes over its logits in as few
#    passes as eager kernels allow: their maximum; the logits less it, made in the loss's dtype (under autocast this
#    pass is the upcast, into the chunk's one float32 buffer); exp and sum in place; and the softmax divided by the
#    sum straight into the projection's dtype for the matmuls that follow (over the projection's own output, which
#    is no longer needed). Each token's weight in the loss (1 / tokens for "mean", the loss's gradient for "none",
#    0 for an ignored token) never touches the chunk: it scales rows of `hidden` and of `hidden`'s gradient, H
#    wide, instead of rows of the logits, V wide.
# 7. Where an estimate counts a step's bytes on fake tensors, the head runs its first, second and last chunks only
#    (NOTE [ Counted once ] in remat/_engine/once.py), the first two where every chunk has one size: every chunk of
#    one size holds the same bytes at its peak and leaves alive what the one before it left (the loss per token and
#    the gradients are made before the first).
# 8. A chunk's matmuls in a half precision add their partial sums in float32, whatever cuBLAS's
#    `allow_bf16_reduced_precision_reduction` (and fp16's) says: a chunk's few rows against the whole vocabulary
#    (an inner dimension of tens of thousands) is the shape for which cuBLAS splits the sum and adds the parts in
#    the half precision, where one matmul over every token does not: the gradients then strayed from float32's far
#    beyond the plain composition's rounding (docs/benchmarks.md).
#
# Implementation notes:
# 1. (rules 2, 6) The gradient of the loss for the logits z of one token with label y, smoothing e and V classes
#    is softmax(z) - (1 - e) onehot(y) - e / V, times the token's weight w. The loss reads the label's logit and,
#    with smoothing, the logits' mean, from the shifted logits before exp. The softmax less the label's share is
#    made for every token (an ignored token's w is 0); the label's entry is set once (`scatter_`) from the label's
#    logit, computed in the loss's dtype, so that softmax(z)_y - 1 does not lose its digits to the projection's
#    dtype. w goes to the matmuls' small side: the gradient for `hidden` is (g @ W) * w, the weight's is
#    g^T @ (hidden * w), the bias's (w @ g) times a factor shared by all tokens (1 / tokens for "mean") in float32.
# 2. (rule 1) Under autocast the gradient of the logits is cast to the projection's dtype and the matmuls of the
#    gradients run in it, as autograd runs them there; each chunk's share of the weight's (and bias's) gradient is
#    added in float32 at least, then given the weight's dtype. A model's elementwise steps on its logits
#    (`Transform`: Gemma 2's soft-capping) run in the projection's dtype before the upcast, and their gradients
#    the same way, as autograd's would.
# 3. In eager code the chunks run in an autograd function, whose ops every dispatch mode sees (`remat.track` counts
#    each chunk's logits; a budget's fake profile prices them). In compiled code they run in two custom operators
#    (`remat::linear_cross_entropy`, and its backward for "none") with their autograd formula registered
#    (`torch.library`): the compiler keeps an operator whole, so a compiled step holds one chunk as the eager one
#    does (inlined, inductor would be free to make every chunk's logits first). Backward raises under
#    `create_graph=True`: there is no second derivative through the head (torch's cross-entropy has one; no
#    training loop uses it), and a silent zero would be wrong.


@dataclass(frozen=True)
class _Spec:
    """What the autograd function needs besides tensors (a constant under torch.compile)."""

    ignore_index: int
    reduction: Reduction
    smoothing: float
    size: int  # tokens per chunk
    cast: torch.dtype | None  # autocast's dtype for the projection, or None
    transform: Transform


def softcap_transform(cap: float) -> Transform:
    """The `Transform` of logit soft-capping, ``cap * tanh(logits / cap)`` (Gemma 2).

    >>> softcap_transform(30.0)
    (('div', 30.0), ('tanh', 0.0), ('mul', 30.0))
    """
    return (("div", float(cap)), ("tanh", 0.0), ("mul", float(cap)))


MIN_ROWS = {"cpu": 64}
"""The fewest rows (tokens) of a chunk per device type, where a chunk of `CHUNK_BYTES` would hold fewer (NOTE [ The
head in chunks ], rule 3); device types not named take `ACCELERATOR_ROWS`."""

ACCELERATOR_ROWS = 1024
"""The fewest rows of a chunk on an accelerator (CUDA, XPU, ...): rule 3."""


def min_rows(device: str | torch.device) -> int:
    """The fewest rows of a chunk that `chunks=None` takes on `device` (a device or its type).

    >>> min_rows("cpu"), min_rows("cuda:0")
    (64, 1024)
    """
    kind = device.partition(":")[0] if isinstance(device, str) else device.type
    return MIN_ROWS.get(kind, ACCELERATOR_ROWS)


def chunk_count(tokens: int, vocabulary: int, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> int:
    """How many chunks `chunks=None` takes for `tokens` rows of `vocabulary` logits in the loss's `dtype` on
    `device` (NOTE [ The head in chunks ], rule 3).

    >>> chunk_count(16384, 50257), chunk_count(16384, 50257, device="cuda"), chunk_count(16, 50257)
    (50, 16, 1)
    """
    floor = min_rows(device)
    rows = max(floor, CHUNK_BYTES // max(1, vocabulary * dtype.itemsize))
    count = math.ceil(tokens / rows)
    if tokens >= floor:  # every chunk has at least `floor` rows
        count = min(count, tokens // floor)
    return max(1, count)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    chunks: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Compute ``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)`` one chunk of tokens at a time.

    A language model's logits (tokens x vocabulary, and their gradient) are never all alive: each chunk's are made,
    turned into its loss and its share of the gradients, and freed before the next. Value and gradients are those
    of the plain composition (the class dimension last, as the projection makes it); under autocast the
    projection runs in autocast's dtype and the loss in float32, as Hugging Face models compute their loss.

    Args:
        hidden: the head's input, ``(..., H)``: every leading index is a token.
        weight: the projection's weight, ``(V, H)`` (a tied embedding works: it is the same tensor).
        labels: integer class per token, ``hidden.shape[:-1]``; `ignore_index` marks tokens left out.
        bias: the projection's bias, ``(V,)``, or None.
        ignore_index: label of tokens that add nothing to the loss or to the mean's count.
        reduction: ``"mean"`` over tokens not ignored (NaN when there are none, as torch's), ``"sum"``, or
            ``"none"``: one loss per token, shaped as `labels`.
        label_smoothing: as `torch.nn.functional.cross_entropy`'s, in [0, 1].
        chunks: how many chunks of tokens; None picks it so that one chunk's logits are about `CHUNK_BYTES` in the
            loss's dtype (the guide "The head and the loss" says why).
        softcap: logits become ``softcap * tanh(logits / softcap)`` before the loss, as Gemma 2's do.

    Returns:
        The loss: a scalar, or per token for ``reduction="none"``; float32, or the projection's dtype where wider.

    Raises:
        ValueError, TypeError: for shapes, dtypes or options that do not fit, naming what came.

    With "mean" and "sum" the gradients are made in forward, chunk by chunk, and kept until backward scales them
    (no matmul is done twice); with "none" backward makes each chunk's logits again. A second derivative through
    it is not supported.

    >>> import torch, remat
    >>> hidden = torch.randn(4, 16, 32, requires_grad=True)
    >>> head = torch.nn.Linear(32, 1000, bias=False)
    >>> labels = torch.randint(0, 1000, (4, 16))
    >>> loss = remat.linear_cross_entropy(hidden, head.weight, labels, chunks=4)
    >>> plain = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
    >>> torch.testing.assert_close(loss, plain)
    >>> loss.backward()
    """
    transform = () if softcap is None else softcap_transform(_positive("softcap", softcap))
    return chunked(
        hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, chunks=chunks, transform=transform,
    )


def chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    chunks: int | None = None,
    transform: Transform = (),
) -> torch.Tensor:
    """`linear_cross_entropy` with the model's elementwise steps on its logits as a `Transform`."""
    tokens, vocabulary = _check_args(hidden, weight, labels, bias, reduction, label_smoothing, chunks)
    cast = _autocast_dtype(hidden.device.type)
    if not _switch._state[0]:  # rule 5
        return _plain(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, transform)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and _projected(tensor.dtype, cast) != _projected(hidden.dtype, cast):
            raise TypeError(f"remat: linear_cross_entropy's `hidden` and `{name}` must have one dtype (autocast "
                            f"off), as for F.linear, but got {hidden.dtype} and {tensor.dtype}.")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).long()  # gather's indices, and F.cross_entropy's targets, are int64
    loss_dtype = torch.promote_types(_projected(hidden.dtype, cast), torch.float32)
    count = (chunk_count(tokens, vocabulary, loss_dtype, hidden.device) if chunks is None
             else min(chunks, max(tokens, 1)))
    size = max(1, math.ceil(tokens / count))
    grad = torch.is_grad_enabled()
    wanted = (grad and hidden.requires_grad, grad and weight.requires_grad,
              grad and bias is not None and bias.requires_grad)
    options: HeadArgs = (int(ignore_index), reduction, float(label_smoothing), size, cast,
                        ",".join(step for step, _ in transform), [value for _, value in transform])
    losses: torch.Tensor
    if compiling():  # implementation note 3
        losses = _operator(flat_hidden, weight, bias, flat_labels, *options, list(wanted))[0]
    elif any(wanted):
        losses = _Eager.apply(flat_hidden, weight, bias, flat_labels, options, wanted)  # type: ignore[no-untyped-call, unused-ignore]
    else:
        losses = _forward(flat_hidden, weight, bias, flat_labels, options, wanted)[0]
    return losses.view(labels.shape) if reduction == "none" else losses  # reduced by `_forward`


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"remat: linear_cross_entropy's `{name}` must be a positive number, but got {value!r}.")
    return float(value)


def _check_args(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
    reduction: str, label_smoothing: float, chunks: int | None,
) -> tuple[int, int]:
    """The number of tokens and of classes, after checking every argument (a ValueError or TypeError naming it)."""
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"remat: linear_cross_entropy's `{name}` must be a tensor, but got "
                            f"`{type(value).__name__}`.")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"remat: linear_cross_entropy's `reduction` must be 'mean', 'sum' or 'none', but got "
                         f"{reduction!r}.")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not (
        0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"remat: linear_cross_entropy's `label_smoothing` must be in [0, 1], but got "
                         f"{label_smoothing!r}.")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"remat: linear_cross_entropy's `chunks` must be a positive int or None, but got "
                         f"{chunks!r}.")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            "remat: linear_cross_entropy needs `hidden` (..., H) and `weight` (V, H), but got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}."
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            "remat: linear_cross_entropy needs one label per token, `labels` shaped as `hidden.shape[:-1]` "
            f"{tuple(hidden.shape[:-1])}, but got {tuple(labels.shape)}."
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"remat: linear_cross_entropy's `labels` must be class indices (an integer tensor), but "
                        f"got {labels.dtype}.")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"remat: linear_cross_entropy's `bias` must be None or ({weight.shape[0]},), but got "
                         f"{shape}.")
    return math.prod(labels.shape), weight.shape[0]


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype for `device_type` where it is on, else None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know
        return None
    return None


def logits_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype of `F.linear(hidden, weight)` here and now: autocast's where it casts `hidden`, else its own.

    >>> logits_dtype(torch.zeros(2, 3, dtype=torch.float64))
    torch.float64
    """
    return _projected(hidden.dtype, _autocast_dtype(hidden.device.type))


def _projected(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The dtype autocast gives a tensor of `dtype` for a matmul: floating and not float64 are cast."""
    return cast if cast is not None and dtype.is_floating_point and dtype != torch.float64 else dtype


@contextlib.contextmanager
def _without_autocast(device_type: str) -> Iterator[None]:
    """Autocast off for `device_type` (the casts are explicit here), where it is on."""
    if _autocast_dtype(device_type) is None:
        yield
        return
    with torch.autocast(device_type, enabled=False):
        yield


def _plain(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
    ignore_index: int, reduction: Reduction, label_smoothing: float, transform: Transform,
) -> torch.Tensor:
    """The composition `linear_cross_entropy` computes, with all logits at once (rule 5)."""
    logits = F.linear(hidden, weight, bias)
    for step, value in transform:
        logits = torch.tanh(logits) if step == "tanh" else logits * value if step == "mul" else logits / value
    logits = logits.reshape(-1, logits.shape[-1])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    return loss.view(labels.shape) if reduction == "none" else loss


@contextlib.contextmanager
def _full_precision_sums() -> Iterator[None]:
    """cuBLAS's half-precision matmuls with their partial sums added in float32 (rule 8): off, torch's default, a
    matmul may add the partial sums of a long inner dimension (split-K) in the half precision."""
    matmul = torch.backends.cuda.matmul
    was = matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = was


class _Chunk:
    """One pass over the chunks of tokens: each chunk's loss and, with `scale`, its share of the gradients."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 labels: torch.Tensor, spec: _Spec) -> None:
        self.spec = spec
        self.compute = _projected(hidden.dtype, spec.cast)
        self.loss_dtype = torch.promote_types(self.compute, torch.float32)
        self.hidden = hidden
        self.weight = weight.to(_projected(weight.dtype, spec.cast))
        self.bias = None if bias is None else bias.to(_projected(bias.dtype, spec.cast))
        # the weight's and bias's gradients are summed over chunks in at least float32, then given their dtype
        self.sums = torch.promote_types(weight.dtype, torch.float32)
        self.valid = labels != spec.ignore_index
        self.safe = labels.masked_fill(~self.valid, 0)  # a class index for every token; ignored ones weigh 0

    def logits(self, start: int, end: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The chunk's logits after the model's steps, in the projection's dtype, and the outputs of its `tanh`
        steps (what their gradients need)."""
        logits = F.linear(self.hidden[start:end].to(self.compute), self.weight, self.bias)
        if not compiling():  # a counter changed in traced code would be a guard that fails on every call
            _stats.add_head_chunk()
        kept: list[torch.Tensor] = []
        for step, value in self.spec.transform:
            if step == "tanh":
                logits = logits.tanh() if kept and logits is kept[-1] else logits.tanh_()
                kept.append(logits)
            elif kept and logits is kept[-1]:  # a kept output is not changed in place
                logits = logits * value if step == "mul" else logits / value
            else:
                logits = logits.mul_(value) if step == "mul" else logits.div_(value)
        return logits, kept

    def run(
        self, scale: tuple[torch.Tensor, torch.Tensor | float] | None, wanted: tuple[bool, bool, bool],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The loss per token; with `scale` (each token's weight in the loss: a vector in the loss's dtype, times a
        factor that applies to all), the gradients of hidden, weight and bias that `wanted` asks for."""
        spec, hidden, weight = self.spec, self.hidden, self.weight
        tokens = self.safe.shape[0]
        losses = torch.empty(tokens, dtype=self.loss_dtype, device=hidden.device)
        grad_hidden = grad_weight = grad_bias = None
        if scale is not None:
            weights, factor = scale
            scaled = weights * factor
            if wanted[0]:
                grad_hidden = torch.empty_like(hidden)
            if wanted[1]:
                grad_weight = torch.zeros(weight.shape, dtype=self.sums, device=weight.device)
            if wanted[2] and self.bias is not None:
                grad_bias = torch.zeros(weight.shape[0], dtype=self.sums, device=self.bias.device)
        starts = parts(range(0, tokens, spec.size), hidden, even=tokens % spec.size == 0)  # rule 7
        with _full_precision_sums():  # rule 8
            for start in starts:
                end = min(start + spec.size, tokens)
                logits, kept = self.logits(start, end)
                loss, grad = self._loss_and_gradient(logits, kept, self.safe[start:end], scale is not None)
                losses[start:end] = torch.where(self.valid[start:end], loss, 0.0)
                del logits  # before the next chunk's logits are made
                if grad is None or scale is None:
                    del kept  # a tanh's output too
                    continue
                grad = self._through_steps(grad, kept)
                del kept
                # implementation note 1: each token's weight applied on the side of `hidden`, not of the vocabulary
                rows = scaled[start:end, None]
                if grad_hidden is not None:
                    grad_hidden[start:end] = torch.mul(grad @ weight, rows)
                if grad_weight is not None:
                    chunk = torch.mul(hidden[start:end], rows).to(self.compute)
                    if grad.dtype == grad_weight.dtype:
                        grad_weight.addmm_(grad.t(), chunk)
                    else:
                        grad_weight += grad.t() @ chunk
                    del chunk
                if grad_bias is not None:  # the shared factor in float32, not rounded to the projection's dtype
                    grad_bias += (weights[start:end].to(grad.dtype) @ grad).to(grad_bias.dtype) * factor
                del grad  # before the next chunk's logits are made
        return losses, grad_hidden, grad_weight, grad_bias

    def _loss_and_gradient(
        self, logits: torch.Tensor, kept: list[torch.Tensor], safe: torch.Tensor, gradient: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chunk's loss per token and, with `gradient`, the gradient of its loss for the logits before the
        token's weight, in the projection's dtype: softmax less the (smoothed) label (implementation note 1)."""
        smooth, classes = self.spec.smoothing, logits.shape[1]
        owned = not (kept and logits is kept[-1])  # the logits' memory may be written (a kept tanh may not)
        top = logits.amax(dim=1, keepdim=True)
        if logits.dtype == self.loss_dtype and owned:
            shifted = logits.sub_(top)
        else:  # the logits less their largest, made in the loss's dtype: the upcast is this pass
            shifted = torch.sub(logits, top.to(self.loss_dtype))
        picked = shifted.gather(1, safe[:, None]).squeeze(1)
        loss = picked * (smooth - 1.0)
        if smooth:
            loss = loss - smooth * shifted.mean(dim=1)
        probs = shifted.exp_()
        total = probs.sum(dim=1)
        loss = loss + total.log()
        if not gradient:
            return loss, None
        label = picked.exp_().div_(total).sub_(1.0 - smooth + smooth / classes)  # softmax less label, at the label
        inverse = total.reciprocal_()[:, None]
        if logits.dtype != probs.dtype and owned and not smooth:  # normalised straight into the projection's dtype
            grad = torch.mul(probs, inverse, out=logits)
        else:
            grad = probs.mul_(inverse)
            if smooth:
                grad.sub_(smooth / classes)
        del probs, shifted
        grad.scatter_(1, safe[:, None], label[:, None].to(grad.dtype))
        return loss, grad.to(self.compute)

    def _through_steps(self, grad: torch.Tensor, kept: list[torch.Tensor]) -> torch.Tensor:
        """The gradient for the projection's output from that for the logits (implementation note 2), in place."""
        tanhs = iter(reversed(kept))
        for step, value in reversed(self.spec.transform):
            if step == "tanh":  # 1 - out * out made in the kept output, needed no more: no chunk-sized temporary
                grad.mul_(next(tanhs).square_().neg_().add_(1.0))
            elif step == "mul":
                grad.mul_(value)
            else:
                grad.div_(value)
        return grad


# The chunks run in an autograd function in eager code and in custom operators in compiled code (implementation
# note 3); both run `_forward` and `_backward` below.

HeadArgs = tuple[int, str, float, int, "torch.dtype | None", str, list[float]]
"""`(ignore_index, reduction, smoothing, size, cast, steps, values)`: a `_Spec` as an operator's arguments."""


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, options: HeadArgs,
    wanted: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The loss (reduced, or per token for "none") and, for "mean" and "sum", the gradients `wanted` asks for."""
    spec = _spec(options)
    with _without_autocast(hidden.device.type):
        chunk = _Chunk(hidden, weight, bias, labels, spec)
        scale = None
        if spec.reduction != "none" and any(wanted):
            # "mean" over no token: a NaN loss, zero gradients (rule 1)
            factor = 1.0 / chunk.valid.sum().clamp(min=1).to(chunk.loss_dtype) if spec.reduction == "mean" else 1.0
            scale = (chunk.valid.to(chunk.loss_dtype), factor)
        losses, *grads = chunk.run(scale, wanted)
        if spec.reduction != "none":
            total = losses.sum()
            losses = total / chunk.valid.sum() if spec.reduction == "mean" else total
    return losses, _in_dtypes(grads, (hidden, weight, bias))


def _save(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], options: HeadArgs,
          wanted: tuple[bool, bool, bool], grads: list[torch.Tensor | None]) -> None:
    """What backward needs: the gradients forward made, or (for "none") the inputs to make them again."""
    ctx.set_materialize_grads(False)
    ctx.options, ctx.wanted = options, wanted
    ctx.save_for_backward(*(inputs if options[1] == "none" else grads))


def _backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                             torch.Tensor | None]:
    """The gradients of hidden, weight and bias for the loss's gradient `grad`."""
    if grad is None:
        return None, None, None
    if torch.is_grad_enabled() and not compiling():  # create_graph=True (implementation note 3)
        raise RematError(
            "remat: linear_cross_entropy has no second derivative (backward with create_graph=True through it); "
            "compute that loss with torch.nn.functional.cross_entropy instead."
        )
    options, wanted = ctx.options, ctx.wanted
    if options[1] != "none":  # rule 2: scale what forward made
        made = [None if g is None or not g.numel() else g * grad.to(g.dtype) for g in ctx.saved_tensors]
        return made[0], made[1], made[2]
    hidden, weight, bias, labels = ctx.saved_tensors
    spec = _spec(options)
    with _without_autocast(hidden.device.type):
        chunk = _Chunk(hidden, weight, bias, labels, spec)
        _, *grads = chunk.run((torch.where(chunk.valid, grad, 0.0).to(chunk.loss_dtype), 1.0), wanted)
    out = _in_dtypes(grads, (hidden, weight, bias))
    return out[0], out[1], out[2]


class _Eager(torch.autograd.Function):
    """`_forward` and `_backward` in eager code, where dispatch modes (`remat.track`, fake tensors) see each op."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
        options: HeadArgs, wanted: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        losses, grads = _forward(hidden, weight, bias, labels, options, wanted)
        _save(ctx, (hidden, weight, bias, labels), options, wanted, grads)
        return losses

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (*_backward(ctx, grad), None, None, None)


# In compiled code a custom operator keeps the chunks whole: inlined, inductor could make every chunk's logits first.


@torch.library.custom_op("remat::linear_cross_entropy", mutates_args=())
def _operator(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, ignore_index: int,
    reduction: str, smoothing: float, size: int, cast: torch.dtype | None, steps: str, values: list[float],
    wanted: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_forward` as an operator: the gradients it did not make are empty tensors (an operator returns tensors)."""
    options = (ignore_index, reduction, smoothing, size, cast, steps, values)
    losses, grads = _forward(hidden, weight, bias, labels, options, (wanted[0], wanted[1], wanted[2]))
    empty = [hidden.new_empty(0) if g is None else g for g in grads]
    return losses, empty[0], empty[1], empty[2]


@_operator.register_fake
def _(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, ignore_index: int,
    reduction: str, smoothing: float, size: int, cast: torch.dtype | None, steps: str, values: list[float],
    wanted: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(_projected(hidden.dtype, cast), torch.float32)
    losses = hidden.new_empty(labels.shape if reduction == "none" else (), dtype=dtype)
    made = [t.new_empty(t.shape) if t is not None and want and reduction != "none" else hidden.new_empty(0)
            for t, want in zip((hidden, weight, bias), wanted, strict=True)]
    return losses, made[0], made[1], made[2]


@torch.library.custom_op("remat::linear_cross_entropy_backward", mutates_args=())
def _operator_backward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, grad: torch.Tensor,
    ignore_index: int, smoothing: float, size: int, cast: torch.dtype | None, steps: str, values: list[float],
    wanted: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_backward` for reduction "none" as an operator: each chunk's logits made again (rule 2)."""
    ctx = _Saved((hidden, weight, bias, labels), (ignore_index, "none", smoothing, size, cast, steps, values),
                 (wanted[0], wanted[1], wanted[2]))
    made = [hidden.new_empty(0) if g is None else g for g in _backward(ctx, grad)]
    return made[0], made[1], made[2]


@_operator_backward.register_fake
def _(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, grad: torch.Tensor,
    ignore_index: int, smoothing: float, size: int, cast: torch.dtype | None, steps: str, values: list[float],
    wanted: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    made = [t.new_empty(t.shape) if t is not None and want else hidden.new_empty(0)
            for t, want in zip((hidden, weight, bias), wanted, strict=True)]
    return made[0], made[1], made[2]


class _Saved:
    """What `_backward` reads of a context, for the backward operator."""

    def __init__(self, saved: tuple[torch.Tensor | None, ...], options: HeadArgs,
                 wanted: tuple[bool, bool, bool]) -> None:
        self.saved_tensors, self.options, self.wanted = saved, options, wanted


def _operator_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, bias, labels, *rest = inputs
    options: HeadArgs = tuple(rest[:7])
    wanted: list[bool] = rest[7]
    ctx.mark_non_differentiable(*output[1:])
    grads = [None if not g.numel() else g for g in output[1:]]
    _save(ctx, (hidden, weight, bias, labels), options, (wanted[0], wanted[1], wanted[2]), grads)


def _operator_gradients(ctx: Any, grad: torch.Tensor | None, *unused: torch.Tensor | None) -> tuple[Any, ...]:
    options, wanted = ctx.options, ctx.wanted
    if grad is not None and options[1] == "none" and not torch.is_grad_enabled():
        ignore_index, _, smoothing, size, cast, steps, values = options
        hidden, weight, bias, labels = ctx.saved_tensors
        made: tuple[torch.Tensor | None, ...] = _operator_backward(
            hidden, weight, bias, labels, grad, ignore_index, smoothing, size, cast, steps, values, list(wanted))
        made = tuple(g if want else None for g, want in zip(made, wanted, strict=True))
    else:
        made = _backward(ctx, grad)
    return (*made, *(None,) * 9)  # nothing for labels and the options


_operator.register_autograd(_operator_gradients, setup_context=_operator_setup)


def _spec(options: HeadArgs) -> _Spec:
    ignore_index, reduction, smoothing, size, cast, steps, values = options
    names = steps.split(",") if steps else []
    return _Spec(ignore_index, reduction, smoothing, size, cast,  # type: ignore[arg-type]
                 tuple(zip(names, values, strict=True)))


def _in_dtypes(
    grads: list[torch.Tensor | None], like: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> list[torch.Tensor | None]:
    """Each gradient in its input's dtype (under autocast they were made in the projection's)."""
    return [None if g is None or x is None else g if g.dtype == x.dtype else g.to(x.dtype)
            for g, x in zip(grads, like, strict=True)]


claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
