"""A loss function built from a trainer's config: ``make_loss_fn(config)(hidden, table, targets, weights)``.

    loss_fn = make_loss_fn({"loss": "cutbce", "label_smoothing": 0.1, "loss_block_v": 2048})
    loss_fn = make_loss_fn({"loss": "cutce", "z_loss": 1e-4, "temperature": 0.5})   # softmax CE
    loss_fn = make_loss_fn({"loss": "sampled_softmax", "num_negatives": 1024})       # fn(..., key=k)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        hidden, table, targets, weights)
    table_sharding = NamedSharding(mesh, loss_fn.partition_specs(layout).table)

Config keys (a dict, an ``ml_collections.ConfigDict`` or anything with
``to_dict()``):

* ``loss``: the strategy name, one of `recloss.available_strategies()`
  (default ``"cutbce"``): a BCE strategy (``dense_bce``, ``cutbce``,
  ``cutbce_pallas``) computes `recloss.bce_loss`, a softmax one (``dense_ce``,
  ``cutce``, ``cutce_pallas``) `recloss.softmax_loss`, a sampled one (``sampled_softmax``,
  ``gbce``) `recloss.sampled_loss` (then call ``fn(..., key=k, log_q=...)``).
* every `recloss.LossOptions` field under its own name (``block_v``,
  ``threshold``, ``label_smoothing``, ...) or with a ``loss_`` prefix
  (``loss_block_v``, ``loss_threshold``, ...), as MaxText-style trainer
  configs spell them. Values convert as `recloss_plugins.config.LOSS_OPTION_KEYS`
  (the mapping every plugin shares) says: ``0`` for ``block_v``, ``block_n``
  and ``vocab_size`` means "not set" (None), the trainer configs' convention.
  An option of the other objective (BCE: ``vocab_reduction``, ``pos_weight``,
  ``focal_*``, ``threshold``; softmax: ``z_loss``, ``temperature``) must be
  absent or at its default.

Any other key is an error unless ``strict=False`` (then keys outside the
loss's are ignored, so a whole trainer config can be passed; a key that starts
with ``loss_`` but names no option is still an error, as it is a typo).
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, Mapping, Optional, Tuple

import recloss
from recloss_plugins.config import (OPTION_PREFIX, build_loss_options, check_strategy_options, option_for,
                                    option_keys)
from recloss_plugins.flax import _common

STRATEGY_KEY = "loss"
DEFAULT_STRATEGY = "cutbce"


def config_to_dict(config) -> Dict[str, Any]:
    """A plain dict of ``config``'s top-level keys (dict, Mapping, ConfigDict or ``to_dict()``/``get_keys()``)."""
    if isinstance(config, Mapping):
        return dict(config)
    for method in ("to_dict", "get_keys"):
        fn = getattr(config, method, None)
        if callable(fn):
            out = fn()
            if isinstance(out, Mapping):
                return dict(out)
    raise TypeError(f"config must be a dict, a Mapping or an ml_collections.ConfigDict, got "
                    f"{type(config).__name__}")


def _unknown_key_error(key: str) -> ValueError:
    close = difflib.get_close_matches(key, (STRATEGY_KEY,) + option_keys(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"unknown loss config key {key!r}{hint}; valid keys are {STRATEGY_KEY!r}, the "
                      f"recloss.LossOptions fields {recloss.LossOptions.field_names()} and the same "
                      f"fields prefixed with {OPTION_PREFIX!r}")


def resolve_config(config, *, strict: bool = True) -> Tuple[str, recloss.LossOptions]:
    """(strategy name, LossOptions) that ``config`` asks for; see the module docstring for keys.

    Raises ValueError naming the key for an unknown key (with a suggestion), a
    key given twice under both spellings with different values, an unknown
    strategy, an option value LossOptions rejects, or an option the strategy's
    objective does not take set to a value other than its default (``{"loss":
    "cutce", "pos_weight": 2}``).
    """
    items = config_to_dict(config)
    name = items.pop(STRATEGY_KEY, DEFAULT_STRATEGY)
    if not isinstance(name, str):
        raise ValueError(f"config key {STRATEGY_KEY!r} must be a strategy name (str), got {name!r}; "
                         f"available: {recloss.available_strategies()}")
    if name not in recloss.available_strategies():
        close = difflib.get_close_matches(name, recloss.available_strategies(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"config key {STRATEGY_KEY!r}={name!r} is not a recloss strategy: available are "
                         f"{recloss.available_strategies()}{hint}")
    options = {}
    for key, value in items.items():
        if isinstance(key, str) and option_for(key) is not None:
            options[key] = value
        elif strict or (isinstance(key, str) and key.startswith(OPTION_PREFIX)):
            raise _unknown_key_error(str(key))
    built = build_loss_options(options)
    check_strategy_options(name, options)
    return name, built


def make_loss_fn(config, *, layout: Optional[recloss.MeshLayout] = None, strict: bool = True):
    """``fn(hidden, table, targets, weights=None, bias=None, *, key=None, log_q=None) -> (loss, metrics)``
    for ``config`` (``key``/``log_q``: a sampled strategy's, see `recloss.sampled_loss`).

    The function is the configured strategy's entry point with its options
    (`recloss.bce_loss` for a BCE strategy, `recloss.softmax_loss` for a
    softmax one, ``fn.strategy.objective`` says which): hidden [..., D], table
    [V, D], targets [..., L] int ids, weights [...] (None = 1), bias [V] or
    None; loss is Σ w·ℓ / Σ w for the default reduction='mean' (see the entry
    point for ℓ and the metrics: BCE tp/fp/fn/tn, softmax top1 and mean_lse).
    It is pure, so it can be jitted and differentiated
    (``jax.value_and_grad(fn, has_aux=True)``).

    Attributes of the returned function: ``strategy`` (the `recloss.Strategy`),
    ``options`` (its LossOptions), ``layout``, and ``partition_specs(layout)``
    (a `recloss.Specs`: where to place hidden/targets/weights/table/bias under
    a mesh layout; ``layout`` defaults to the one given here).

    Args:
      config: dict / ConfigDict with ``loss`` and option keys (module docstring).
      layout: a `recloss.MeshLayout` to run the loss sharded under shard_map.
      strict: reject keys that are not loss keys (False: ignore them).
    """
    _common.check_layout(layout)
    name, options = resolve_config(config, strict=strict)
    strategy = recloss.get_strategy(name, options)

    def loss_fn(hidden, table, targets, weights=None, bias=None, *, key=None, log_q=None):
        out = strategy(hidden, table, targets, weights, bias, layout=layout, **_common.sampled_inputs(key, log_q))
        return out.loss, out.metrics

    def partition_specs(layout_: Optional[recloss.MeshLayout] = None) -> recloss.Specs:
        return _common.partition_specs(strategy, layout_, layout, "make_loss_fn")

    loss_fn.__doc__ = (f"recloss loss {name!r} with {options}: (hidden [..., D], table [V, D], "
                       "targets [..., L], weights [...] | None, bias [V] | None) -> (loss, metrics)")
    loss_fn.__name__ = f"recloss_{name}"
    loss_fn.strategy = strategy
    loss_fn.options = options
    loss_fn.layout = layout
    loss_fn.partition_specs = partition_specs
    return loss_fn


__all__ = ["config_to_dict", "make_loss_fn", "resolve_config"]
