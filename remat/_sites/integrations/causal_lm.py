"""`remat.apply(model, head=True)` on a Hugging Face causal LM: its loss through `linear_cross_entropy`.

Imported only when a model comes from transformers; it reads classes, attributes and arguments by name and never
imports transformers itself. See NOTE [ A causal LM's head ].
"""

from __future__ import annotations

import collections
import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import torch
from torch import nn

from ..._core import switch as _switch
from ..._core.errors import RematError, alive
from ..._core.torch_compat import fsdp_group
from ..cross_entropy import Transform, chunked, logits_dtype
from . import comes_from

__all__ = ["HeadRoute", "check", "find_causal_lm", "route", "unroute"]

# NOTE [ A causal LM's head ]
# A transformers causal LM makes its logits with `self.lm_head(hidden_states)`, may scale or soft-cap them, and
# hands them to `self.loss_function(logits, labels, vocab_size, **kwargs)` (transformers' `ForCausalLMLoss`:
# upcast to float32, labels shifted left with `ignore_index` padding, mean over tokens not ignored, or a sum over
# `num_items_in_batch`). remat changes that one call path on the model's instances, never its classes.
#
# Rules:
# 1. In training mode, with `labels` given and the switch on, the loss is `linear_cross_entropy` of the head's
#    input, the head's weight and bias, and the labels shifted and ignored as `ForCausalLMLoss` does (or the
#    `shift_labels` given), with its reduction; the output's `logits` is then None (left out of a tuple output, as
#    transformers leaves out None fields). Anything else (eval, no labels, the switch off) runs the model's own code.
# 2. A model's own elementwise steps on the logits before the loss (Gemma 2's soft-capping, a logit scale or
#    divisor, `.float()`) are applied to each chunk. Reads that change no value pass, answered as the logits
#    would answer them without being made: `shape`, `size()`, `dim()`, `ndim`, `dtype`, `device`, and
#    `contiguous()` (OPT's `self.lm_head(h).contiguous()`: the projection's output is contiguous already). Any
#    other use of the logits before the loss (slicing, adding, a function of them) is a RematError that names
#    it, raised on the first training step (no state is left behind).
# 3. `route` refuses, naming what it looked for and what it found instead, a model without such a head: a
#    transformers model whose `get_output_embeddings()` is an `nn.Linear` and whose class's forward computes its
#    loss with `self.loss_function`, which is transformers' `ForCausalLMLoss`.
# 4. `remat.undo` (through the hooks' `close`) gives the head its forward and the model its `loss_function` back.
# 5. The head's parameters are read only inside a call of the head: the loss is the head's second call in the
#    forward, with its input and the labels, so that whatever gathers the head's parameters around its calls
#    (FSDP2's `fully_shard` on the head or on a group with it, DeepSpeed ZeRO-3, an offload hook) has them there,
#    and its hooks see the loss among the head's outputs and its input among the head's inputs, as they would
#    see the logits and the input of the model's own head (gathered again for backward, gradients reduced after
#    it). Its forward hooks run for both calls.
#
# Implementation notes:
# 1. (rule 1) A forward pre-hook on the causal LM opens a call when the rule applies (a thread-local stack, so two
#    threads and nested calls keep theirs); the head's own `forward` (an instance attribute, as `remat(module)`
#    sets one) returns `DeferredLogits` (the head and its input) instead of the logits for an open call; the
#    model's `_loss_function` (the instance attribute transformers' `loss_function` property reads first) calls
#    the head again with its input and a `_HeadLoss`, for which the head's `forward` returns the chunked loss
#    (rule 5); a forward hook closes the call and takes the placeholder out of the output. The placeholder knows
#    the logits' shape, dtype and device without making them (rule 2): `F.linear`'s output has the input's
#    leading dimensions and the head's `out_features`, autocast's dtype where autocast casts the input, and the
#    input's device.
# 2. (rule 1) Under torch.compile the same happens in traced code: dynamo traces the hooks, the stack and the
#    placeholder (a call is pushed and popped within one forward), and `linear_cross_entropy`'s operator stays
#    whole in the graph, so a compiled step holds one chunk of logits too.
# 3. (rule 5) The placeholder has no `__slots__`: DeepSpeed's hook after the head's first call looks for
#    parameters among the attributes of an output it does not know (`vars`), and finds none there (it holds the
#    head, not its weight). DeepSpeed logs once that it cannot see the tensors inside it; the second call's loss
#    is a tensor it sees. Under ZeRO-3 and FSDP2 on the head, the first call gathers the head's parameters and
#    uses none of them: one gather of the head more per forward than the model's own head.

_FORWARDS_LOSS = "self.loss_function("
_LOSS = ("transformers.loss.loss_utils", "ForCausalLMLoss")


@dataclass
class _RoutedCall:
    """One training forward of a routed model with labels: its route and the placeholders its head returned (and
    the model's steps on them made)."""

    route: HeadRoute
    deferred: list[DeferredLogits] = field(default_factory=list)


class _Calls(threading.local):
    def __init__(self) -> None:
        self.stack: list[_RoutedCall | None] = []


_calls = _Calls()


def _open_call() -> _RoutedCall | None:
    stack = _calls.stack
    return stack[-1] if stack else None


class DeferredLogits:
    """What a routed head returns instead of its logits: its input and parameters, and the model's elementwise steps
    on them so far (NOTE [ A causal LM's head ], rule 2)."""

    # no __slots__: implementation note 3

    def __init__(self, hidden: torch.Tensor, head: nn.Linear, call: _RoutedCall, steps: Transform = (),
                 dtype: torch.dtype | None = None) -> None:
        self.hidden, self.head, self.call, self.steps = hidden, head, call, steps
        self.dtype: torch.dtype = logits_dtype(hidden) if dtype is None else dtype
        """The dtype the logits would have (rule 2: a read that changes nothing)."""

    def _then(self, step: str | None, value: float = 0.0, dtype: torch.dtype | None = None) -> DeferredLogits:
        if step not in (None, "tanh") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            self._refuse(f"`logits {'*' if step == 'mul' else '/'} {type(value).__name__}`")
        steps = self.steps if step is None else (*self.steps, (step, float(value)))
        out = DeferredLogits(self.hidden, self.head, self.call, steps, dtype or self.dtype)
        self.call.deferred.append(out)
        return out

    # -- reads that change no value (rule 2) --------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        """The logits' shape: the head's input's leading dimensions, then one logit per class."""
        return torch.Size((*self.hidden.shape[:-1], self.head.out_features))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    @property
    def ndim(self) -> int:
        return self.hidden.dim()

    def dim(self) -> int:
        return self.hidden.dim()

    def size(self, dim: int | None = None) -> Any:
        """`Tensor.size`: the shape, or one dimension of it (negative counts from the end)."""
        shape = self.shape
        if dim is None:
            return shape
        if isinstance(dim, bool) or not isinstance(dim, int):
            self._refuse(f"`logits.size({dim!r})`")
        if not -len(shape) <= dim < len(shape):
            raise IndexError(f"Dimension out of range (expected to be in range of [{-len(shape)}, "
                             f"{len(shape) - 1}], but got {dim})")
        return shape[dim]

    def contiguous(self, memory_format: torch.memory_format = torch.contiguous_format) -> DeferredLogits:
        """The logits themselves: the projection makes them contiguous."""
        if memory_format not in (torch.contiguous_format, torch.preserve_format):
            self._refuse(f"`logits.contiguous(memory_format={memory_format})`")
        return self

    # -- steps applied to each chunk (rule 2) -------------------------------------------------------------------
    def __mul__(self, other: Any) -> DeferredLogits:
        return self._then("mul", other)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> DeferredLogits:
        return self._then("div", other)

    def tanh(self) -> DeferredLogits:
        return self._then("tanh")

    def float(self) -> DeferredLogits:
        # the loss is computed in float32 at least; what the model reads of the result says float32
        return self if self.dtype == torch.float32 else self._then(None, dtype=torch.float32)

    def to(self, *args: Any, **kwargs: Any) -> DeferredLogits:
        if (args == (torch.float32,) and not kwargs) or (not args and kwargs == {"dtype": torch.float32}):
            return self.float()
        self._refuse("`logits.to(...)`")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.tanh, torch.Tensor.tanh, torch.nn.functional.tanh) and len(args) == 1 and not kwargs:
            return args[0].tanh()
        if func is torch.Tensor.float and len(args) == 1 and not kwargs:
            return args[0].float()
        found = [arg for arg in (*args, *(kwargs or {}).values()) if isinstance(arg, DeferredLogits)]
        if not found:
            return NotImplemented
        found[0]._refuse(f"`{getattr(func, '__name__', func)}`")

    # -- anything else changes values, or cannot be answered without the logits ----------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._refuse(f"`logits.{name}`")

    def __getitem__(self, index: Any) -> Any:
        return self._refuse("`logits[...]`")

    def _operator(self, symbol: str) -> Callable[..., NoReturn]:
        def refuse(*args: Any) -> NoReturn:
            self._refuse(f"`{symbol}`")

        return refuse

    def __add__(self, other: Any) -> NoReturn:
        self._operator("logits + ...")()

    __radd__ = __add__

    def __sub__(self, other: Any) -> NoReturn:
        self._operator("logits - ...")()

    def __rsub__(self, other: Any) -> NoReturn:
        self._operator("... - logits")()

    def __rtruediv__(self, other: Any) -> NoReturn:
        self._operator("... / logits")()

    def __neg__(self) -> NoReturn:
        self._operator("-logits")()

    def _refuse(self, what: str) -> NoReturn:
        model = self.call.route.model_name
        raise RematError(
            f"remat: head=True cannot compute `{model}`'s loss in chunks: its forward uses {what} on the logits "
            "before its loss, which needs the logits' values; remat applies only scaling, soft-capping (tanh) and "
            "`.float()` to each chunk, and answers reads that change nothing (shape, size(), dim(), dtype, device, "
            "contiguous()). Pass head=False to remat.apply for this model (or `remat.undo(model)` first)."
        )


class HeadForward:
    """The head's own `forward` while routed: `DeferredLogits` for an open call of its model, else what it had."""

    __slots__ = ("_module", "own")
    _remat_owned = True  # NOTE [ A model set aside ] in remat/_sites/targets.py

    def __init__(self, module: nn.Module, own: Callable[..., Any] | None) -> None:
        self._module = weakref.ref(module)
        self.own = own  # the instance's forward before remat (a library's or the user's), or None: its class's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = alive(self._module, "a routed head's `forward`")
        call = _open_call()
        if call is not None and call.route.head is module and not kwargs:
            assert isinstance(module, nn.Linear)  # `route` checked it
            if len(args) == 2 and isinstance(args[1], _HeadLoss):  # the loss, inside the head's call: rule 5
                return args[1].of(args[0], module.weight, module.bias)
            if len(args) == 1:
                placeholder = DeferredLogits(args[0], module, call)
                call.deferred.append(placeholder)
                return placeholder
        if self.own is not None:
            return self.own(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        if self.own is not None:
            return self.own
        module = self._module()
        assert module is not None
        return type(module).forward.__get__(module, type(module))  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[Any, ...]:
        return (HeadForward, (self._module(), self.own))


class _ChunkedLoss:
    """The model's `_loss_function` while routed: `ForCausalLMLoss` computed in chunks from `DeferredLogits`, the
    model's own loss function for real logits."""

    _remat_owned = True  # NOTE [ A model set aside ] in remat/_sites/targets.py

    def __init__(self, own: Callable[..., Any]) -> None:
        self.own = own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        logits = args[0] if args else kwargs.get("logits")
        if not isinstance(logits, DeferredLogits):
            return self.own(*args, **kwargs)
        return _causal_lm_loss(*args, **kwargs)


def _causal_lm_loss(
    logits: DeferredLogits, labels: torch.Tensor, vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None, **kwargs: Any,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` (loss/loss_utils.py), on the chunks of `linear_cross_entropy`."""
    del kwargs  # as `ForCausalLMLoss`, which takes and ignores the model's other keywords
    hidden = logits.hidden
    classes = logits.head.out_features
    if vocab_size is not None and vocab_size != classes:
        raise RematError(
            f"remat: head=True: `{logits.call.route.model_name}`'s head makes {classes} logits per token but its "
            f"loss is told vocab_size={vocab_size}; remat cannot tell which logits the loss reads."
        )
    if shift_labels is None:
        padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    reduction: Literal["mean", "sum"] = "sum" if num_items_in_batch is not None else "mean"
    _one_head_call_at_a_time(logits)
    loss: torch.Tensor = logits.head(hidden, _HeadLoss(shift_labels.reshape(hidden.shape[:-1]), ignore_index, reduction,
                                         logits.steps))
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _one_head_call_at_a_time(logits: DeferredLogits) -> None:
    """Refuse a head that FSDP2 shards in one group with other modules (rule 5): the group ends its forward after
    each of its modules ran once, so the head's second call would open one that never ends."""
    group = fsdp_group(logits.head)
    if len(group) > 1:
        route = logits.call.route
        names = {module: name for name, module in route.model.named_modules()}
        others = ", ".join(f"`{names.get(module, type(module).__qualname__)}`" for module in group
                           if module is not logits.head)
        raise RematError(
            f"remat: head=True cannot compute `{route.model_name}`'s loss in chunks: its head `{route.head_name}` "
            f"is sharded by FSDP2 in one group with {others} (one `fully_shard` call on a list), and the loss runs "
            "in a second call of the head, which FSDP2 would take for the group's next forward. Shard the head "
            "alone (`fully_shard(model.lm_head)`) or with the model's root, or pass head=False to remat.apply."
        )


@dataclass(frozen=True)
class _HeadLoss:
    """What the head's second call is asked for: the loss of its input's logits against `labels` (rule 5)."""

    labels: torch.Tensor
    ignore_index: int
    reduction: Literal["mean", "sum"]
    steps: Transform

    def of(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return chunked(hidden, weight, self.labels, bias, ignore_index=self.ignore_index, reduction=self.reduction,
                       transform=self.steps)


class HeadRoute:
    """The causal LM's forward pre-hook while routed: opens a call when NOTE [ A causal LM's head ]'s rule 1
    applies; `close` puts back what routing changed (`remat.undo`)."""

    _remat_owned = True  # `remat.undo` removes it (see `_targets._is_ours`)
    remat_head = True  # what remat/_sites/head.py looks for

    chosen_by: str | None = None  # who routed it, where not the user (a budget: NOTE [ The head as a choice ])
    on = True  # off: the model's own head and loss, the route left in place (a budget's re-plan: `switch`)
    closed = False  # taken off the model (`close`)

    def __init__(self, model: nn.Module, head: nn.Module, head_name: str, labels_at: int | None) -> None:
        # Held weakly: the model holds this hook, and a strong reference back would keep the model, its gradients
        # and its optimizer's state alive after its last reference went, until the garbage collector ran.
        self._model = weakref.ref(model)
        self._head = weakref.ref(head)
        self.head_name = head_name
        self.model_name = type(model).__qualname__
        self.labels_at = labels_at  # `labels`' index among forward's positional arguments (self excluded)

    @property
    def model(self) -> nn.Module:
        return alive(self._model, "a routed head's hook")

    @property
    def head(self) -> nn.Module:
        return alive(self._head, "a routed head's hook")

    def __getstate__(self) -> dict[str, Any]:  # `deepcopy` and pickle: the copy's own model and head
        return {**self.__dict__, "_model": self.model, "_head": self.head}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _model=weakref.ref(state["_model"]), _head=weakref.ref(state["_head"]))

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        if self.closed:
            # Taken off inside this very forward (a budget's hook, which runs first, planned again and did not keep
            # the route): the forward's hooks were read before, and torch calls this one without its keyword
            # arguments; its forward hook, gone too, will not close a call, so none is opened.
            return
        stack = _calls.stack
        while stack and (stale := stack[-1]) is not None and stale.route is self:
            # a call of this model that never closed: its forward raised what torch runs no hook for (a
            # KeyboardInterrupt); a model does not call itself, so it is over, and its placeholders hold its input
            stack.pop()
            stale.deferred.clear()
        labels = (kwargs or {}).get("labels")
        if labels is None and self.labels_at is not None and self.labels_at < len(args):
            labels = args[self.labels_at]
        on = self.on and module.training and labels is not None and _switch._state[0]
        stack.append(_RoutedCall(self) if on else None)

    def install(self) -> None:
        head, model = self.head, self.model
        head.__dict__["forward"] = HeadForward(head, head.__dict__.get("forward"))
        own = model.__dict__.get("_loss_function", _MISSING)
        model.__dict__["_loss_function"] = _ChunkedLoss(model.loss_function)  # type: ignore[arg-type]
        self.own_loss = own

    def close(self) -> None:
        self.closed = True
        forward = self.head.__dict__.get("forward")
        if isinstance(forward, HeadForward):
            if forward.own is None:
                del self.head.__dict__["forward"]
            else:
                self.head.__dict__["forward"] = forward.own
        if isinstance(self.model.__dict__.get("_loss_function"), _ChunkedLoss):
            if self.own_loss is _MISSING:
                del self.model.__dict__["_loss_function"]
            else:
                self.model.__dict__["_loss_function"] = self.own_loss

    def describe(self) -> str:
        chosen = f", chosen by {self.chosen_by}" if self.chosen_by else ""
        return (f"{self.head_name or '(model)'} ({type(self.head).__qualname__}): with labels in training, the loss "
                f"in chunks (remat.linear_cross_entropy{chosen}); output.logits is None")


class _HeadClose:
    """The causal LM's forward hook while routed: closes the call and takes the placeholder out of the output."""

    _remat_owned = True

    def __call__(self, module: nn.Module, args: Any, *rest: Any) -> Any:
        # Called as (module, args, kwargs, output) after forward, as (module, args, None) when it raised.
        stack = _calls.stack
        call = stack.pop() if stack else None
        if call is None:
            return None
        # A placeholder holds its call and the call its placeholders: the cycle would keep the head's input (the
        # last hidden states) alive until the garbage collector runs, into the next step. Broken here.
        deferred, call.deferred = call.deferred, []
        if len(rest) != 2 or not deferred:
            return None
        return _without_placeholders(rest[1], deferred)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING: Any = _Missing()


def _without_placeholders(output: Any, deferred: list[DeferredLogits]) -> Any:
    """`output` with `logits` None (a `ModelOutput`) or left out (a tuple), where it is a placeholder."""
    def placeholder(value: Any) -> bool:
        return isinstance(value, DeferredLogits) and any(value is d for d in deferred)

    if isinstance(output, collections.OrderedDict):  # transformers' ModelOutput
        for key in [key for key, value in output.items() if placeholder(value)]:
            collections.OrderedDict.__delitem__(output, key)  # ModelOutput forbids `del`; a None field has no key
            object.__setattr__(output, key, None)
        return output
    if isinstance(output, tuple) and any(placeholder(value) for value in output):
        return type(output)(value for value in output if not placeholder(value)) if type(output) is tuple \
            else output
    return None


def _is_causal_lm_loss(function: Any) -> bool:
    return (getattr(function, "__module__", None), getattr(function, "__name__", None)) == _LOSS


def _defines_loss_function(kind: type) -> bool:
    return any("loss_function" in vars(base) for base in kind.__mro__)


def find_causal_lm(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost transformers model inside `model` (itself included) that has a `loss_function` of its class
    and `get_output_embeddings()`, with its qualified name; None when there is none."""
    for name, module in model.named_modules():
        kind = type(module)
        if comes_from(kind, "transformers") and _defines_loss_function(kind) and callable(
            getattr(module, "get_output_embeddings", None)
        ):
            return name, module
    return None


LOOKED_FOR = (
    "a Hugging Face causal LM: a transformers model whose `get_output_embeddings()` is an nn.Linear and whose "
    "forward computes its loss with `self.loss_function` (transformers' ForCausalLMLoss)"
)


def route(model: nn.Module, chosen_by: str | None = None) -> HeadRoute:
    """Route the loss of the causal LM inside `model` through `linear_cross_entropy` (NOTE [ A causal LM's head ]);
    `chosen_by` says who chose it, where not the user.

    Raises:
        ValueError: naming what was looked for and what was found instead, when there is no such model or head.
    """
    lm, head = check(model)
    head_name = next(n for n, m in model.named_modules() if m is head)
    unroute(lm)
    signature = inspect.signature(type(lm).forward)
    positional = [p.name for p in signature.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)][1:]
    hook = HeadRoute(lm, head, head_name, positional.index("labels") if "labels" in positional else None)
    hook.chosen_by = chosen_by
    hook.install()
    lm.register_forward_pre_hook(hook, with_kwargs=True)
    lm.register_forward_hook(_HeadClose(), with_kwargs=True, always_call=True, prepend=True)  # before others'
    return hook


def check(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """The causal LM inside `model` and its head, where `route` can route them (rule 3).

    Raises:
        ValueError: naming what was looked for and what was found instead, when there is no such model or head.
    """
    found = find_causal_lm(model)
    if found is None:
        raise ValueError(f"remat: apply(head=True) found no language-model head in `{type(model).__qualname__}`: "
                         f"it looks for {LOOKED_FOR}. For another model, compute its loss with "
                         "remat.linear_cross_entropy(hidden, head.weight, labels).")
    _, lm = found
    kind = type(lm).__qualname__
    head = lm.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise ValueError(f"remat: apply(head=True) needs {LOOKED_FOR}, but `{kind}`'s output embeddings are "
                         f"{_what_head(head)}.")
    if len(fsdp_group(head)) > 1:
        raise ValueError(f"remat: apply(head=True) cannot route `{kind}`'s head: FSDP2 shards it in one group with "
                         "other modules (one `fully_shard` call on a list), and the loss runs in a second call of "
                         "the head (NOTE [ A causal LM's head ], rule 5). Shard the head alone or with the model's "
                         "root.")
    try:
        source = inspect.getsource(type(lm).forward)
    except (OSError, TypeError):
        source = ""
    loss_function = lm.loss_function
    if _FORWARDS_LOSS not in source or not _is_causal_lm_loss(getattr(loss_function, "own", loss_function)):
        raise ValueError(
            f"remat: apply(head=True) needs {LOOKED_FOR}, but `{kind}`'s forward "
            + ("does not call `self.loss_function`" if _FORWARDS_LOSS not in source
               else f"computes its loss with {getattr(loss_function, '__name__', loss_function)!r}")
            + ", so remat cannot tell how its loss reads the logits."
        )
    return lm, head


def _what_head(head: Any) -> str:
    """What a model's output embeddings are, where they are not a plain `nn.Linear` (for `check`'s refusal)."""
    name = f"`{type(head).__qualname__}`"
    if head is None:
        return "None: the model has no output projection"
    if isinstance(head, (nn.ModuleList, nn.ModuleDict, list, tuple)):
        inner = sorted({type(m).__qualname__ for m in (head.values() if isinstance(head, nn.ModuleDict) else head)})
        return (f"a list of {len(head)} heads ({name} of {', '.join(f'`{k}`' for k in inner) or 'nothing'}), "
                "where remat routes the loss of one projection")
    if isinstance(head, nn.Linear):
        return (f"{name}, a subclass of nn.Linear with a forward of its own, which may compute something other "
                "than `F.linear(hidden, weight, bias)`")
    if isinstance(head, nn.Module) and isinstance(getattr(head, "base_layer", None), nn.Linear):
        return (f"{name}, an adapter around an nn.Linear (from `{type(head).__module__.split('.')[0]}`), which "
                "adds to what the projection computes")
    if isinstance(head, nn.Module):
        return f"{name} (from `{type(head).__module__}`), not an nn.Linear"
    return f"{name}, not an nn.Module"


def unroute(module: nn.Module) -> None:
    """Take a route off `module` (the causal LM itself), if it has one."""
    for table in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(table.items()):
            if isinstance(hook, (HeadRoute, _HeadClose)):
                if isinstance(hook, HeadRoute):
                    hook.close()
                del table[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
