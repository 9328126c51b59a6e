"""`MultiLabelHead` for Flax NNX: the item table (owned or borrowed) plus the recloss loss.

    head = MultiLabelHead(num_items, dim, strategy="cutbce", label_smoothing=0.1, rngs=nnx.Rngs(0))
    out = head(hidden, targets, weights)        # recloss.LossOutput(loss, metrics)
    head = MultiLabelHead(num_items, dim, strategy="cutce", z_loss=1e-4, rngs=nnx.Rngs(0))   # softmax CE

Tied embeddings: build with ``tied=True`` and pass the shared table at call
time, ``head(hidden, targets, weights, table=model.embed.embedding)``; the
gradient flows into the borrowed parameter.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax.numpy as jnp
from flax import nnx

import recloss
from recloss_plugins.flax import _common


class MultiLabelHead(nnx.Module):
    """Multi-label output head: item table E [V, D], optional bias b [V], a full-catalogue loss.

    The loss is the configured strategy's objective on logits ``x[..., v] =
    hidden[...]·E[v] + b[v]``, without building [..., V] (for the blocked
    strategies): `recloss.bce_loss` for a BCE strategy (``cutbce``, metrics
    tp/fp/fn/tn), `recloss.softmax_loss` for a softmax one (``cutce``, logits
    divided by ``temperature``; metrics top1, mean_lse).

    Args:
      num_items: V, rows of the table (and of the bias). May be None for a
        tied head without bias (the borrowed table sets V).
      features: D, the hidden size.
      strategy: a registered strategy name or a `recloss.Strategy`.
      options: a `recloss.LossOptions` (or a dict of its fields); keyword
        ``**option_kwargs`` (LossOptions fields) override it. An option of the
        other objective (e.g. ``pos_weight`` with ``strategy="cutce"``) is an error.
      tied: own no table; every call passes ``table=`` (an array or nnx.Param
        [V, D], e.g. the input embedding).
      use_bias: own a bias [V] (zeros at init).
      layout: a `recloss.MeshLayout` to run the loss sharded (shard_map).
      dtype: if set, hidden, table and bias are cast to it before the loss.
      param_dtype: dtype of the owned parameters.
      table_init: initializer of the table (default normal with stddev D^-1/2).
      rngs: nnx.Rngs; needed when the head owns a table.
    """

    def __init__(self, num_items: Optional[int], features: int, *, strategy: Any = "cutbce",
                 options: Any = None, tied: bool = False, use_bias: bool = False,
                 layout: Optional[recloss.MeshLayout] = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, table_init: Optional[Callable] = None,
                 bias_init: Callable = nnx.initializers.zeros_init(), rngs: Optional[nnx.Rngs] = None,
                 **option_kwargs):
        _common.check_head(num_items, features, tied, use_bias, layout)
        self.strategy = _common.build_strategy(strategy, options, option_kwargs)
        self.num_items, self.features = num_items, features
        self.tied, self.layout, self.dtype = bool(tied), layout, dtype
        if not tied or use_bias:
            if rngs is None:
                raise ValueError("rngs (an nnx.Rngs) is needed to initialise the head's parameters")
        if tied:
            self.table = None
        else:
            init = table_init or nnx.initializers.normal(stddev=features ** -0.5)
            self.table = nnx.Param(init(rngs.params(), (num_items, features), param_dtype))
        self.bias = (nnx.Param(bias_init(rngs.params(), (num_items,), param_dtype)) if use_bias else None)

    @property
    def options(self) -> recloss.LossOptions:
        return self.strategy.options

    def item_table(self, table=None):
        """The [V, D] table: the owned one, or ``table`` (array or nnx.Param) for a tied head."""
        return _common.item_table(self.tied, table, lambda: self.table[...], self.features, self.num_items,
                                  "head(hidden, targets, table=model.embed.embedding)")

    def _bias(self):
        return None if self.bias is None else self.bias[...]

    def __call__(self, hidden, targets, weights=None, *, table=None, key=None, log_q=None) -> recloss.LossOutput:
        """Loss and metrics of the configured strategy.

        Args:
          hidden: [..., D] float. targets: [..., L] int item ids (``pad_id``
            pads). weights: [...] or None (= 1). table: the shared [V, D] table
            (tied heads only). key, log_q: a sampled strategy's (`recloss.sampled_loss`):
            the jax.random key of this call's negatives (required there) and the log proposal [V].
        Returns: `recloss.LossOutput` (loss float32 scalar for reduction
          'mean'/'sum', [...] for 'none'; metrics dict of scalars).
        """
        e = _common.cast(self.item_table(table), self.dtype)
        return self.strategy(_common.cast(hidden, self.dtype), e, targets, weights,
                             _common.cast(self._bias(), self.dtype), layout=self.layout,
                             **_common.sampled_inputs(key, log_q))

    def scores(self, hidden, *, table=None):
        """Dense logits ``hidden·Eᵀ + b`` [..., V] float32 (rows past ``vocab_size`` dropped), divided
        by ``temperature`` when a softmax strategy sets one (the logits its loss sees).

        Materialises [..., V]: for inference over small catalogues only; for
        large ones use `recloss_plugins.sasrec.eval.blocked_top_k` (top-K over
        the catalogue a vocabulary block at a time).
        """
        e = _common.cast(self.item_table(table), self.dtype)
        return _common.dense_scores(_common.cast(hidden, self.dtype), e, self._bias(), self.options)

    def embed(self, ids, *, table=None):
        """Table rows for item ids [...] -> [..., D] (to use the head's table as the input embedding)."""
        return jnp.take(self.item_table(table), ids, axis=0)

    def partition_specs(self, layout: Optional[recloss.MeshLayout] = None) -> recloss.Specs:
        """`recloss.Specs` (hidden, targets, weights, table, bias, ...) under ``layout`` (default: the head's)."""
        return _common.partition_specs(self.strategy, layout, self.layout, "the head")
