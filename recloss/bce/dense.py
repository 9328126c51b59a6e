"""The dense BCE baseline: logits [M, V_local] and a multi-hot label matrix, autodiff gradients.

What users write today, kept as the `dense_bce` strategy and as a check on
the blocked ones; memory O(M·V).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recloss import softcap, targets as targets_lib
from recloss.bce.bernoulli import elementwise_loss
from recloss.options import LossOptions


def dense_bce(hidden, table, bias, targets, row_weights, opts: LossOptions, *, vocab_offset=0,
              vocab_size: int):
    """Dense baseline on one shard: logits [M, V_local] (soft-capped with ``logit_soft_cap``) and
    a multi-hot label matrix.

    Args:
      hidden: [M, D]; table: [V_local, D]; bias: [V_local] or None;
      targets: [M, L] global ids; row_weights: [M] float32 scale applied to
      each position's (already vocab-reduced) loss.
      vocab_offset: global id of table row 0. vocab_size: the real V.
    Returns:
      (weighted loss rows [M], per-row counts {predicted, tp, targets} [M] f32 for `metrics.cut_metrics`).
    """
    m, v_local = hidden.shape[0], table.shape[0]
    logits = jnp.dot(hidden, table.T, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)[None, :]
    logits = softcap.soft_cap(logits, opts.logit_soft_cap)
    ids, valid = targets_lib.local_targets(targets, opts.pad_id, vocab_offset, v_local, vocab_size)
    rows = jnp.broadcast_to(jnp.arange(m)[:, None], ids.shape)
    labels = jnp.zeros((m, v_local), jnp.float32).at[rows, jnp.where(valid, ids, v_local)].set(
        1.0, mode="drop")
    live = (jnp.arange(v_local) + vocab_offset) < vocab_size
    per_logit = jnp.where(live[None, :], elementwise_loss(logits, labels, opts), 0.0)
    loss_rows = row_weights * jnp.sum(per_logit, axis=-1)
    pred = jnp.where(live[None, :], logits > opts.threshold, False)
    stop = jax.lax.stop_gradient
    counts = {
        "predicted": jnp.sum(stop(pred), axis=-1, dtype=jnp.float32),
        "tp": jnp.sum(stop(pred) & (labels > 0), axis=-1, dtype=jnp.float32),
        "targets": jnp.sum(labels, axis=-1),
    }
    return loss_rows, counts
