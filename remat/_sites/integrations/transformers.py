"""Hugging Face transformers layers under rerun: the KV-cache rule.

Imported only when a rematerialized module comes from transformers (see `remat._sites.integrations.comes_from`);
it reads arguments and class attributes by name and never imports transformers itself.
See NOTE [ Caches of transformers layers ].
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any

from torch import nn

from ..._core.torch_compat import when_traced

__all__ = ["CACHE_ARGUMENTS", "CacheOff"]

logger = logging.getLogger("remat")

# NOTE [ Caches of transformers layers ]
# In training, transformers models build a KV cache by default and hand it to every layer, which appends to it.
# Rerun calls a layer's forward again in backward, so the cache would be updated a second time: the recompute
# saves other tensors than forward (a `RecomputeMismatchError` with a padded batch, always on T5's decoder) or,
# worse, silently succeeds and doubles the cache the model returned, keeping a second copy of every key and value.
#
# Rules:
# 1. As transformers' own checkpointing (`GradientCheckpointingLayer`) does for checkpointed layers in training,
#    remat switches the cache off for the layers it reruns in training: the layer gets `use_cache=False` and None
#    for every cache argument, unless its class declares `_can_checkpoint_with_cache = True` (layers that only
#    read the cache). Forward and recompute then see the same arguments, and the cache the model returns is the
#    one it had before the layers ran (empty, for a fresh one).
# 2. remat logs one line per model when it does.
# 3. Layers in eval mode, sites that are off (the switch, `no_grad`) and `strategy="replay"` keep the cache:
#    replay runs the recorded ops again, not the Python that updates it.
#
# Implementation notes:
# 1. (rule 1) `use_cache` defaults to the config's, True for most decoders; each layer appends its keys and values
#    with `cache.update(...)` (T5's cross-attention also flips `cache.is_updated[layer]` and, once flipped, reads
#    keys from the cache instead of projecting them; T5's decoder gets a cache in training because its copy of the
#    config keeps `use_cache=True`, which only the encoder's copy turns off).
# 2. (rule 1) The forward pre-hook that opens a rerun site on a transformers layer in training rewrites the
#    arguments, by keyword or by position (GPT-2 passes its cache positionally). `@remat` on a layer class
#    applies the same rule in its wrapper.
# 3. (rule 2) The layers of a model share one rule (so do a layer class's layers rematerialized one by one, as
#    `remat(layer)` in a loop), which logs for the first layer handed a cache it has not seen, and the layers of
#    one model's forward are handed the one cache the model made.
#
# NOTE [ Caches under torch.compile ]
# 1. Compiled paths take the same cache rule as eager ones (`CacheOff.compiled`): the same arguments, rewritten in
#    traced code, and one log line when dynamo traces it, with no state kept.
#
# Implementation notes:
# 1. (rule 1) Inside a compiled frame a rematerialized layer is torch's checkpoint operator (NOTE [ Under
#    torch.compile ]), and dynamo refuses a cache update inside it ("Mutating a variable from outside the scope of
#    this HOP"): it breaks the graph and runs the layer in eager code, where the site keeps everything
#    (docs/benchmarks.md).
# 2. (rule 1) The signature is read in eager code beforehand (`know`); a weak set of what was logged would break the
#    graph, so none is kept.

CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past", "cache_params")
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_positions: dict[type, dict[str, int]] = {}


def _argument_positions(kind: type) -> dict[str, int]:
    """Index in `args` (self excluded) of `use_cache` and each cache argument of `kind.forward`."""
    found = _positions.get(kind)
    if found is None:
        try:
            parameters = list(inspect.signature(kind.forward).parameters.values())  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            parameters = []
        names = [parameter.name for parameter in parameters if parameter.kind in _POSITIONAL][1:]
        wanted = ("use_cache", *CACHE_ARGUMENTS)
        found = _positions[kind] = {name: index for index, name in enumerate(names) if name in wanted}
    return found


class CacheOff:
    """Switch the KV cache off for a rematerialized transformers layer in training; see the NOTE above.

    Called by the site's forward pre-hook with the call's `(module, args, kwargs)`; returns the arguments to
    use instead, or None when nothing changes. One instance is shared by the layers of one model (or of one class,
    for layers rematerialized one by one), and it logs one line per model.

    >>> import torch
    >>> class Layer(torch.nn.Module):
    ...     def forward(self, x, past_key_values=None, use_cache=False):
    ...         return x
    >>> CacheOff()(Layer(), (1, "cache"), {"use_cache": True})
    ((1, None), {'use_cache': False})
    """

    __slots__ = ("caches", "done", "logged")

    def __init__(self) -> None:
        self.logged = False
        self.done: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # layers whose model's line is settled
        self.caches: weakref.WeakSet[Any] = weakref.WeakSet()  # caches of the calls that logged

    def __reduce__(self) -> tuple[type[CacheOff], tuple[()]]:
        return CacheOff, ()  # a copied or unpickled model is a new model: it logs its own line

    def _first_of_its_model(self, module: nn.Module, cache: Any) -> bool:
        """Whether this layer's call is the first of its model to lose its cache (then the rule logs).

        The layers of one model's forward share the cache object the model made, so the first layer that is
        handed an unseen cache logs, and later layers of that call and of later calls stay quiet (also when
        the rule is shared by a layer class: `remat(layer)` in a loop). Without a cache object (or one that
        cannot be held weakly) the rule logs once.
        """
        if module in self.done:
            return False
        self.done.add(module)
        first = not self.logged
        if cache is not None:
            try:
                first = cache not in self.caches
                self.caches.add(cache)
            except TypeError:
                pass
        self.logged = True
        return first

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        rewritten = _without_cache(module, args, kwargs)
        if rewritten is None:
            return None
        new_args, new_kwargs, changed, cache = rewritten
        if self._first_of_its_model(module, cache):
            logger.warning(
                "remat: caching is off in the rematerialized %s layers in training (%s), as transformers' own "
                "gradient checkpointing does: rerun calls a layer again in backward and would update its cache "
                "twice. Use strategy='replay' to keep the cache.",
                type(module).__qualname__,
                ", ".join(changed),
            )
        return new_args, new_kwargs

    @staticmethod
    def compiled(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The same arguments while dynamo traces the layer (NOTE [ Caches under torch.compile ])."""
        rewritten = _without_cache(module, args, kwargs)
        if rewritten is None:
            return None
        when_traced(_log_compiled)
        return rewritten[0], rewritten[1]

    @staticmethod
    def know(kind: type) -> None:
        """Read `kind.forward`'s signature now, in eager code, so that a traced call finds it in the table."""
        _argument_positions(kind)


def _without_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], list[str], Any] | None:
    """`(args, kwargs)` with the cache off, what changed and the cache handed in; None when nothing changes."""
    if not module.training:
        return None
    positions = _argument_positions(type(module))
    keep_cache = bool(getattr(module, "_can_checkpoint_with_cache", False))
    new_args: list[Any] | None = None
    new_kwargs: dict[str, Any] | None = None
    changed: list[str] = []
    cache: Any = None
    for name in ("use_cache", *CACHE_ARGUMENTS):
        if name != "use_cache" and keep_cache:
            break
        off = False if name == "use_cache" else None
        if name in kwargs:
            value = kwargs[name]
        elif positions.get(name, len(args)) < len(args):
            value = args[positions[name]]
        else:
            continue
        if not (bool(value) if name == "use_cache" else value is not None):
            continue
        if name in kwargs:
            new_kwargs = dict(kwargs) if new_kwargs is None else new_kwargs
            new_kwargs[name] = off
        else:
            new_args = list(args) if new_args is None else new_args
            new_args[positions[name]] = off
        changed.append(f"`{name}={off}`")
        cache = value if cache is None and name != "use_cache" else cache
    if not changed:
        return None
    return (
        tuple(new_args) if new_args is not None else args,
        new_kwargs if new_kwargs is not None else kwargs,
        changed,
        cache,
    )


_logged_compiled: list[bool] = []


def _log_compiled(ctx: object) -> None:
    """Log once per process, while dynamo traces a rematerialized layer handed a cache, that its cache is off
    (this runs in eager code at trace time: it may keep state)."""
    if _logged_compiled:
        return
    _logged_compiled.append(True)
    logger.warning(
        "remat: caching is off in rematerialized transformers layers in training under torch.compile, as "
        "transformers' own gradient checkpointing does (a cache update inside torch's checkpoint breaks the graph "
        "and would leave the layer unrematerialized). Use strategy='replay' in eager code to keep the cache."
    )
