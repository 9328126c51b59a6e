"""The log-partition math of the softmax objective.

For one position with logits ``x_v = (a·e_v + b_v)/τ`` and k = |T| ≥ 1 unique
valid targets, the multi-positive cross-entropy (the mean of the per-target
CEs, sharing Z) with label smoothing ε and z-loss λ is

    ℓ = Z − Σ_v q_v·x_v + λ·Z²,   q_v = (1−ε)·[v∈T]/k + ε/V,   Z = logsumexp_v x_v
      = Z + λ·Z² − (1−ε)/k · Σ_{t∈T} x_t − (ε/V) · Σ_v x_v

    ∂ℓ/∂x_v = (1 + 2λZ)·softmax(x)_v − q_v.

Z is the only dense part: per shard a blocked sweep keeps a running (max m,
Σ exp(x − m)) per row (`tile_lse`, `merge_lse`), and the shards' log-partitions
are combined into the global Z before anything is normalised (`global_lse`).
The targets' part is O(L·D) gathers; ε/V·Σ_v x_v is one [D] column sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Stand-in for −inf in masked maxima: exp(NEG − m) is 0 for any real m, and NEG − NEG = 0 keeps
# an all-masked running (max, sum) at (NEG, 0) without the NaN of −inf − (−inf).
NEG = -1e30
# Above every real id: the loser of a tie-to-the-smallest-id argmax.
BIG_ID = jnp.iinfo(jnp.int32).max


def masked(x, live):
    """Logits with dead columns (``live`` False; None = all live) set to NEG."""
    return x if live is None else jnp.where(live, x, NEG)


def tile_lse(xm, live):
    """Per-row (max m [R], Σ_live exp(x − m) [R]) of a masked logit tile ``xm`` [R, C]."""
    m = jnp.max(xm, axis=-1)
    p = jnp.exp(xm - m[:, None])
    if live is not None:
        p = jnp.where(live, p, 0.0)
    return m, jnp.sum(p, axis=-1)


def merge_lse(m1, s1, m2, s2):
    """Two running (max, sum-exp) pairs as one."""
    m = jnp.maximum(m1, m2)
    return m, s1 * jnp.exp(m1 - m) + s2 * jnp.exp(m2 - m)


def log(s):
    """log s (s > 0) with one Newton step, y + s·exp(−y) − 1 for y = log s.

    Z's absolute error is the relative error of every probability exp(x − Z) the gradient uses.
    On a TPU v5e (jax 0.10.2, libtpu 0.0.42.1) float32 log is off by ~1e-5 absolute at the values a
    log-partition takes, exp by ~1e-6 relative (median), so the step takes Z's error to exp's:
    measured there at 'highest' matmul precision, cutce's and cutce_pallas's dA went from 1.2e-5 to
    7.6e-7 relative error against float64 (dense_ce: 3.0e-7). Two transcendentals per row, not per logit.
    """
    y = jnp.log(s)
    return y + jax.lax.stop_gradient(s * jnp.exp(-y) - 1.0)    # d/ds is 1/s: log's own


def lse_of(m, s):
    """log Σ exp from a running (max, sum-exp): m + log s, and −inf for an empty sum (no live column)."""
    ok = s > 0
    return jnp.where(ok, m + log(jnp.where(ok, s, 1.0)), -jnp.inf)


def global_lse(lse_local, shard):
    """The global Z [M] from each vocab shard's log-partition [M] (max over shards, then a sum);
    ``shard``: the `recloss.shard.VocabShard` whose vocab reductions combine them."""
    top = shard.vocab_max(jax.lax.stop_gradient(lse_local))    # the shift cancels: no gradient (pmax has none)
    return top + log(shard.vocab_sum(jnp.exp(lse_local - top)))


def global_argmax(row_max, row_id, shard):
    """The global argmax id [M] from each shard's (row max, its global id); ties go to the smallest id."""
    row_max = jax.lax.stop_gradient(row_max)
    top = shard.vocab_max(row_max)
    cand = jnp.where(row_max == top, row_id, BIG_ID)
    return -shard.vocab_max(-cand)
