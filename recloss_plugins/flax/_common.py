"""Pieces shared by the NNX and linen heads (and `make_loss_fn`): argument checks, strategy
construction, table unwrapping, dense scores, partition specs."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

import recloss


def check_layout(layout):
    """Raises TypeError unless ``layout`` is a `recloss.MeshLayout` or None."""
    if layout is not None and not isinstance(layout, recloss.MeshLayout):
        raise TypeError(f"layout must be a recloss.MeshLayout or None, got {type(layout).__name__}")


def check_head(num_items, features, tied: bool, use_bias: bool, layout):
    """Raises unless a head's constructor arguments fit together.

    ``features`` (D) must be a positive int; ``num_items`` (V) a positive int,
    or None for a tied head without bias (the borrowed table sets V);
    ``layout`` a `recloss.MeshLayout` or None.
    """
    if isinstance(features, bool) or not isinstance(features, int) or features <= 0:
        raise ValueError(f"features must be a positive int (the hidden size D), got {features!r}")
    if num_items is not None and (isinstance(num_items, bool) or not isinstance(num_items, int)
                                  or num_items <= 0):
        raise ValueError(f"num_items must be a positive int (V) or None, got {num_items!r}")
    if num_items is None and (not tied or use_bias):
        raise ValueError("num_items is needed to own a table or a bias; only a tied head without bias "
                         "(tied=True, use_bias=False) may leave it None")
    check_layout(layout)


def partition_specs(strategy: recloss.Strategy, layout, default, owner: str) -> recloss.Specs:
    """``strategy``'s `recloss.Specs` under ``layout``, or under ``default`` when ``layout`` is None.

    Raises ValueError when both are None; ``owner`` names what ``default`` came
    from (the head, make_loss_fn) for that message.
    """
    chosen = layout if layout is not None else default
    if chosen is None:
        raise ValueError(f"partition_specs needs a recloss.MeshLayout (none was given here or to {owner})")
    return strategy.partition_specs(chosen)


def build_strategy(strategy: Any, options: Any, option_kwargs: Mapping[str, Any]) -> recloss.Strategy:
    """The `recloss.Strategy` for a head.

    ``strategy``: a registered name (str) or a ready `recloss.Strategy`;
    ``options``: a `recloss.LossOptions`, a mapping of LossOptions fields, or
    None; ``option_kwargs``: LossOptions fields overriding ``options``.
    """
    if isinstance(strategy, recloss.Strategy):
        if options is not None or option_kwargs:
            raise ValueError(f"strategy is already a recloss.Strategy ({strategy!r}); pass options only "
                             "together with a strategy name")
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a strategy name (one of {recloss.available_strategies()}) or a "
                        f"recloss.Strategy, got {type(strategy).__name__}")
    kwargs = dict(option_kwargs)
    if isinstance(options, Mapping):
        kwargs = {**dict(options), **kwargs}
        options = None
    elif options is not None and not isinstance(options, recloss.LossOptions):
        raise TypeError(f"options must be a recloss.LossOptions, a mapping of its fields or None, got "
                        f"{type(options).__name__}")
    return recloss.get_strategy(strategy, options, **kwargs)


def sampled_inputs(key, log_q) -> dict:
    """The extra call arguments of a sampled strategy (`recloss.sampled_loss`'s ``key`` and ``log_q``),
    those given only: other strategies then refuse them by name, a sampled one names a missing key."""
    return {name: v for name, v in (("key", key), ("log_q", log_q)) if v is not None}


def unwrap(x):
    """The array inside an nnx.Variable / linen boxed param (``.unbox()``), else ``x``."""
    get_value = getattr(x, "get_value", None)
    if callable(get_value) and not isinstance(x, jax.Array):
        return get_value()
    if hasattr(x, "unbox") and callable(x.unbox):
        return x.unbox()
    return x


def check_table(table, features: int, num_items: Optional[int]):
    """Raises unless ``table`` is [num_items, features] (any rows when num_items is None)."""
    shape = tuple(getattr(table, "shape", ()))
    if len(shape) != 2 or shape[1] != features:
        raise ValueError(f"the item table must have shape [V, {features}] (features={features}), got "
                         f"shape {shape}")
    if num_items is not None and shape[0] != num_items:
        raise ValueError(f"the item table has {shape[0]} rows but the head was built with "
                         f"num_items={num_items}")


def cast(x, dtype):
    return x if x is None or dtype is None else x.astype(dtype)


def dense_scores(hidden, table, bias, options: recloss.LossOptions):
    """The loss's logits ``cap(hidden · tableᵀ + bias) / temperature`` over the real catalogue: [..., V]
    float32, cap(x) = c·tanh(x/c) with ``logit_soft_cap`` c (else x).

    Builds the full [..., V] array: for inference over small catalogues only.
    Rows past ``options.vocab_size`` (padding) are dropped; ``temperature`` is 1
    unless a softmax strategy sets it (neither it nor the cap changes the ranking, though the cap
    can tie logits it saturates).
    """
    scores = jnp.einsum("...d,vd->...v", hidden, table, preferred_element_type=jnp.float32)
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    scores = recloss.soft_cap(scores, options.logit_soft_cap)
    if options.temperature != 1.0:
        scores = scores / options.temperature
    if options.vocab_size is not None:
        scores = scores[..., :options.vocab_size]
    return scores


def item_table(tied: bool, table, owned, features: int, num_items: Optional[int], example: str):
    """The [V, D] table a head scores against: ``table`` for a tied head, else ``owned()``.

    ``example`` shows how to pass the shared table, for the error a tied head gives without one.
    """
    if tied:
        if table is None:
            raise ValueError("this MultiLabelHead is tied (tied=True) and owns no table: pass the shared "
                             f"[V, D] table, e.g. {example}")
        table = unwrap(table)
        check_table(table, features, num_items)
        return table
    if table is not None:
        raise ValueError("this MultiLabelHead owns its table (tied=False); table= is only for heads "
                         "built with tied=True")
    return owned()
