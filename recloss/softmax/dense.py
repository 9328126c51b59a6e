"""The dense softmax baseline: logits [M, V_local] materialised, autodiff gradients (memory O(M·V))."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recloss import softcap
from recloss.softmax import partition


def dense_lse(hidden, table, bias, *, temperature: float, vocab_offset, vocab_size: int, argmax: bool,
              soft_cap=None):
    """One shard's log-partition from dense logits x = cap(hidden·tableᵀ + bias)/τ.

    Args: hidden [M, D], table [V_local, D], bias [V_local] or None; vocab_offset:
    global id of table row 0; vocab_size: the real V (later columns are dead); soft_cap: c of
    cap(y) = c·tanh(y/c), or None (no cap).
    Returns: (lse [M] f32, differentiable; (row max [M], argmax global id [M] int32) or None).
    """
    x = jnp.dot(hidden, table.T, preferred_element_type=jnp.float32)
    if bias is not None:
        x = x + bias.astype(jnp.float32)[None, :]
    x = softcap.soft_cap(x, soft_cap)
    if temperature != 1.0:
        x = x * (1.0 / temperature)
    cols = jnp.arange(table.shape[0]) + vocab_offset
    live = (cols < vocab_size)[None, :]
    xm = partition.masked(x, live)
    m = jax.lax.stop_gradient(jnp.max(xm, axis=-1))      # the shift needs no gradient: it cancels
    s = jnp.sum(jnp.where(live, jnp.exp(xm - m[:, None]), 0.0), axis=-1)
    lse = partition.lse_of(m, s)
    aux = None
    if argmax:
        aux = (m, (jnp.argmax(jax.lax.stop_gradient(xm), axis=-1) + vocab_offset).astype(jnp.int32))
    return lse, aux
