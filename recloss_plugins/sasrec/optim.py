"""The trainer's optimizer: global-norm clipping, then AdamW for the dense model and, with
``item_optimizer: rowwise_adagrad``, row-wise AdaGrad for the item tables.

Row-wise AdaGrad keeps one float32 scalar per item row (an embedding engine's usual choice): for a
table E [V, D] (or the bias b [V], whose rows are scalars) with clipped gradient G at step t,

    a_v ← a_v + mean_d G_vd²                      (a_v starts at item_adagrad_initial_accumulator)
    E_v ← E_v − η_t · G_v / (√a_v + item_adagrad_eps)

η_t is the run's schedule (linear warm-up, cosine decay) rescaled to peak at ``item_learning_rate``
(0: at ``learning_rate``). Clipping sees every gradient, the tables' included, before the split;
AdamW's decoupled weight decay applies to the dense matrices only, never to the item tables under
row-wise AdaGrad. Its state is V floats per table where AdamW's is 2·V·D.

With ``item_table_dtype: bfloat16`` the tables are stored in bfloat16 (half their HBM); the sweeps still
sum in float32 and round each gradient once. An update smaller than half a bfloat16 step of its entry
(2⁻⁹ of it) would be lost to round-to-nearest: `apply_updates` rounds p + u stochastically instead
(`stochastic_round`), so every update moves its entry by its exact size in expectation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from recloss_plugins.sasrec.parallel import path_names

#: ``item_optimizer``'s values.
ITEM_OPTIMIZERS = ("adamw", "rowwise_adagrad")
# The parameters ``item_optimizer`` applies to: the item tables and the per-item bias (their paths).
ITEM_PARAMS = (("item_emb", "embedding"), ("out_table",), ("out_bias",))


class RowwiseAdagradState(NamedTuple):
    """``accumulator``: a float32 [rows] per parameter (its leading axis); ``count``: steps taken."""
    accumulator: Any
    count: Any


def rowwise_adagrad(learning_rate, *, eps: float = 1e-8, initial_accumulator: float = 0.0
                    ) -> optax.GradientTransformation:
    """Row-wise AdaGrad (the module docstring's update) as an optax transformation; ``learning_rate``
    a float or a schedule of the step count. Updates are float32 [rows, ...] like the gradients."""

    def init(params):
        acc = jax.tree.map(lambda p: jnp.full(p.shape[:1], initial_accumulator, jnp.float32), params)
        return RowwiseAdagradState(acc, jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        del params
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate

        def row_mean_square(g):
            g = g.astype(jnp.float32)
            return jnp.mean(jnp.square(g).reshape(g.shape[0], -1), axis=1)

        acc = jax.tree.map(lambda a, g: a + row_mean_square(g), state.accumulator, updates)

        def step(g, a):   # float32 whatever g's dtype: `apply_updates` rounds p + u once
            scale = lr / (jnp.sqrt(a) + eps)
            return -scale.reshape(scale.shape + (1,) * (g.ndim - 1)) * g.astype(jnp.float32)

        return jax.tree.map(step, updates, acc), RowwiseAdagradState(acc, state.count + 1)

    return optax.GradientTransformation(init, update)


def is_item_param(names: tuple) -> bool:
    """Whether the parameter at key path ``names`` is an item table (or the per-item bias)."""
    return names in ITEM_PARAMS


def make_optimizer(cfg, schedule) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) (when > 0), then AdamW with ``schedule`` (decay on matrices), or with
    ``item_optimizer: rowwise_adagrad`` AdamW for the dense parameters and `rowwise_adagrad` for
    `ITEM_PARAMS`."""
    decayed = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    adamw = optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                        weight_decay=cfg.weight_decay, mask=decayed)
    if cfg.item_optimizer == "rowwise_adagrad":
        peak = cfg.item_learning_rate or cfg.learning_rate
        item_schedule = lambda count: schedule(count) * (peak / cfg.learning_rate)
        labels = lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: "items" if is_item_param(path_names(path)) else "dense", params)
        inner = optax.multi_transform(
            {"dense": adamw, "items": rowwise_adagrad(item_schedule, eps=cfg.item_adagrad_eps,
                                                      initial_accumulator=cfg.item_adagrad_initial_accumulator)},
            labels)
    else:
        inner = adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), inner) if cfg.grad_clip > 0 else inner


def stochastic_round(x, key):
    """float32 ``x`` rounded to bfloat16 up or down at random, with the chance of rounding up the
    fraction of the way to the upper neighbour: E[round(x)] = x. (Adds 16 random bits below bfloat16's
    mantissa, then truncates them.)"""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)


def apply_updates(params, updates, key):
    """``params + updates``: float32 parameters as optax adds them; a bfloat16 one (the item tables
    under ``item_table_dtype: bfloat16``) from its float32 sum by `stochastic_round`, with its own key."""
    leaves, tree = jax.tree.flatten(params)
    ups = tree.flatten_up_to(updates)
    keys = jax.random.split(key, len(leaves))
    out = [stochastic_round(p.astype(jnp.float32) + u.astype(jnp.float32), k) if p.dtype == jnp.bfloat16
           else (p + u).astype(p.dtype) for p, u, k in zip(leaves, ups, keys)]
    return jax.tree.unflatten(tree, out)
