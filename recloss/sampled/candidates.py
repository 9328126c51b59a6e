"""The math of the sampled objectives, on the logits of a few candidate ids per position.

Candidates are C global ids shared by every position (the K drawn negatives,
the batch's targets). Each vocab shard computes the logits of the ids it owns
and the shards' parts are summed (`candidate_logits`): an [M, C] array, never
[M, V]. ``live [M, C]`` marks the candidates that enter a position's loss.

sampled_softmax, per position with targets T (k = |T|) and corrected logits
s = x − log(expected count) (`softmax_rows`):

    ℓ = (1/k)·Σ_{t∈T} [ log(exp(s_t) + Σ_{c live} exp(s_c)) − s_t ]

gbce (gSASRec), with β the calibration exponent (`gbce_rows`):

    ℓ = β·Σ_{t∈T} softplus(−x_t) + Σ_{c live} softplus(x_c)      (= −log σ(x_t)^β − Σ log(1 − σ(x_c)))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recloss.softmax.partition import NEG


def candidate_logits(hidden, ids, shard):
    """x[m, c] = hidden[m]·table[ids[c]] + bias[ids[c]] for global ids [C] shared by all rows.

    Each vocab shard contributes the rows it owns and the shards' [C, D] parts are summed, so every
    shard holds the C candidate rows and computes the whole [M, C] product: the collective moves C·D
    values, not M·C (docs/design.md "The sampled objective").

    Args: hidden [M, D], ids [C] int32 global ids (an id no shard owns, e.g. −1, gives 0), shard:
    the `recloss.shard.VocabShard` (table [V_local, D] from global id ``shard.offset``, bias, and
    the sum over the vocab shards' parts). Returns [M, C] float32, differentiable in hidden, table,
    bias; O(M·C·D).
    """
    table, bias = shard.table, shard.bias
    local = ids - shard.offset
    own = (local >= 0) & (local < table.shape[0])
    local = jnp.where(own, local, 0)
    rows = shard.vocab_sum(jnp.where(own[:, None], jnp.take(table, local, axis=0), 0))        # [C, D]
    x = jnp.dot(hidden, rows.T, preferred_element_type=jnp.float32)
    if bias is not None:
        b = shard.vocab_sum(jnp.where(own, jnp.take(bias, local, axis=0), 0))
        x = x + b.astype(jnp.float32)[None, :]
    return x


def hits(target_ids, valid, ids):
    """[M, C] bool: candidate c is one of row m's valid targets (target_ids, valid [M, L]; ids [C])."""
    return jnp.any(valid[:, None, :] & (target_ids[:, None, :] == ids[None, :, None]), axis=-1)


def softmax_rows(st, valid, sc, live):
    """Per row the mean over its valid targets of the CE of each target among itself and the live
    candidates: st, valid [M, L]; sc, live [M, C] (corrected logits). Returns [M] f32 (0 without targets)."""
    scm = jnp.where(live, sc, NEG)
    top = jax.lax.stop_gradient(jnp.max(scm, axis=-1, initial=NEG))                  # NEG when none is live
    mass = jnp.sum(jnp.where(live, jnp.exp(scm - top[:, None]), 0.0), axis=-1)      # Σ exp(s_c − top)
    ok = mass > 0
    lse = jnp.where(ok, top + jnp.log(jnp.where(ok, mass, 1.0)), NEG)                  # log Σ_live exp(s_c)
    # log(exp(s_t) + exp(lse)) − s_t = softplus(lse − s_t): accurate when the target dominates.
    ce = jax.nn.softplus(lse[:, None] - st)
    k = jnp.sum(valid, axis=-1, dtype=jnp.float32)
    return jnp.sum(jnp.where(valid, ce, 0.0), axis=-1) / jnp.maximum(k, 1.0)


def gbce_beta(num_negatives: int, vocab_size: int, t: float) -> float:
    """gSASRec's β = α·(t·(1 − 1/α) + 1/α) with α = K/(V − 1), the negative sampling rate (capped at 1:
    K ≥ V − 1 negatives cover the catalogue, and β = 1 gives plain BCE)."""
    alpha = 1.0 if vocab_size <= 1 else min(1.0, num_negatives / (vocab_size - 1))
    return alpha * (t * (1.0 - 1.0 / alpha) + 1.0 / alpha)


def gbce_rows(xt, valid, xc, live, beta: float):
    """β·Σ_t softplus(−x_t) + Σ_{c live} softplus(x_c) per row [M] f32 (xt, valid [M, L]; xc, live [M, C])."""
    pos = jnp.sum(jnp.where(valid, jax.nn.softplus(-xt), 0.0), axis=-1)
    neg = jnp.sum(jnp.where(live, jax.nn.softplus(xc), 0.0), axis=-1)
    return beta * pos + neg


def top1(xt, valid, xc, live):
    """[M] bool: the best valid target's logit beats every live candidate's (ties are misses)."""
    best = jnp.max(jnp.where(valid, xt, NEG), axis=-1, initial=NEG)
    rival = jnp.max(jnp.where(live, xc, NEG), axis=-1, initial=NEG)
    return jnp.any(valid, axis=-1) & (best > rival)
