"""`MultiLabelHead` for Flax linen: the item table (owned or borrowed) plus the recloss loss.

    head = MultiLabelHead(num_items=V, features=D, strategy="cutbce", options={"label_smoothing": 0.1})
    head = MultiLabelHead(num_items=V, features=D, strategy="cutce", options={"z_loss": 1e-4})  # softmax CE
    variables = head.init(key, hidden, targets)
    out = head.apply(variables, hidden, targets, weights)     # recloss.LossOutput

Tied embeddings: ``tied=True`` and pass the shared table at call time, e.g.
inside a parent module ``self.head(h, targets, weights, table=self.embed.embedding)``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax.numpy as jnp

import recloss
from recloss_plugins.flax import _common


def _default_table_init(features: int):
    return nn.initializers.normal(stddev=features ** -0.5)


class MultiLabelHead(nn.Module):
    """Linen's `recloss_plugins.flax.MultiLabelHead`: item table E [V, D] (param 'table'), optional bias
    b [V] (param 'bias'), and the configured strategy's loss on logits ``hidden[...]·E[v] + b[v]``
    without building [..., V] (for the blocked strategies), as the NNX head computes it.

    Attributes:
      num_items: V (None allowed only for a tied head without bias).
      features: D, the hidden size.
      strategy: a registered strategy name or a `recloss.Strategy`.
      options: a `recloss.LossOptions` or a dict of its fields (None = defaults); an
        option of the other objective (e.g. pos_weight for "cutce") is an error.
      tied: own no table; every call passes ``table=`` [V, D].
      use_bias: own a bias [V] (zeros at init).
      layout: a `recloss.MeshLayout` to run the loss sharded (shard_map).
      dtype: if set, hidden, table and bias are cast to it before the loss.
      param_dtype: dtype of the owned parameters.
      table_init: initializer of the table (None = normal with stddev D^-1/2).
    """

    num_items: Optional[int]
    features: int
    strategy: Any = "cutbce"
    options: Any = None
    tied: bool = False
    use_bias: bool = False
    layout: Optional[recloss.MeshLayout] = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    table_init: Optional[Callable] = None
    bias_init: Callable = nn.initializers.zeros_init()

    def __post_init__(self):
        # Fail at construction, not at the first init/apply.
        _common.check_head(self.num_items, self.features, self.tied, self.use_bias, self.layout)
        self.loss_strategy  # validates strategy and options
        super().__post_init__()

    @property
    def loss_strategy(self) -> recloss.Strategy:
        """The configured `recloss.Strategy`."""
        return _common.build_strategy(self.strategy, self.options, {})

    def setup(self):
        if not self.tied:
            init = self.table_init or _default_table_init(self.features)
            self.table = self.param("table", init, (self.num_items, self.features), self.param_dtype)
        if self.use_bias:
            self.bias = self.param("bias", self.bias_init, (self.num_items,), self.param_dtype)

    def item_table(self, table=None):
        """The [V, D] table: the owned param, or ``table`` for a tied head."""
        return _common.item_table(self.tied, table, lambda: self.table, self.features, self.num_items,
                                  "self.head(h, targets, table=self.embed.embedding)")

    def _bias(self):
        return self.bias if self.use_bias else None

    def __call__(self, hidden, targets, weights=None, table=None, *, key=None, log_q=None) -> recloss.LossOutput:
        """Loss and metrics: hidden [..., D], targets [..., L] int ids, weights [...] or None;
        key, log_q: a sampled strategy's (`recloss.sampled_loss`; the key is required there).

        Returns `recloss.LossOutput` (loss float32 scalar for reduction
        'mean'/'sum', [...] for 'none'; metrics dict of scalars).
        """
        e = _common.cast(self.item_table(table), self.dtype)
        return self.loss_strategy(_common.cast(hidden, self.dtype), e, targets, weights,
                                  _common.cast(self._bias(), self.dtype), layout=self.layout,
                                  **_common.sampled_inputs(key, log_q))

    def scores(self, hidden, table=None):
        """Dense logits ``hidden·Eᵀ + b`` [..., V] float32 (rows past ``vocab_size`` dropped), divided
        by ``temperature`` when a softmax strategy sets one (the logits its loss sees).

        Materialises [..., V]: for inference over small catalogues only.
        Call with ``head.apply(variables, hidden, method="scores")``.
        """
        e = _common.cast(self.item_table(table), self.dtype)
        return _common.dense_scores(_common.cast(hidden, self.dtype), e, self._bias(),
                                    self.loss_strategy.options)

    def embed(self, ids, table=None):
        """Table rows for item ids [...] -> [..., D]."""
        return jnp.take(self.item_table(table), ids, axis=0)

    def partition_specs(self, layout: Optional[recloss.MeshLayout] = None) -> recloss.Specs:
        """`recloss.Specs` under ``layout`` (default: the head's); callable on an unbound module."""
        return _common.partition_specs(self.loss_strategy, layout, self.layout, "the head")
