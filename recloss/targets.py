"""Target ids: padding, duplicates, invalid ids, vocab offsets and the gather of target logits.

A position's target set T is its unique ids in ``[0, vocab_size)``; ``pad_id``
is padding; any other id is ignored and counted as invalid. On a vocab shard
that owns global ids ``[vocab_offset, vocab_offset + V_local)`` only the owned
ids are corrected there, so summing shards gives each target exactly once.
"""

from __future__ import annotations

import jax.numpy as jnp


def unique_sorted(targets):
    """Sorts each row of ``targets [M, L]`` and marks repeats: returns (sorted ids, first-occurrence mask)."""
    ids = jnp.sort(targets.astype(jnp.int32), axis=-1)
    first = jnp.concatenate(
        [jnp.ones(ids.shape[:-1] + (1,), bool), ids[..., 1:] != ids[..., :-1]], axis=-1)
    return ids, first


def local_targets(targets, pad_id: int, vocab_offset, v_local: int, vocab_size: int):
    """Target ids local to a vocab shard.

    Args:
      targets: [M, L] global ids. vocab_offset: global id of the shard's first
      row (int or traced scalar). v_local: rows on the shard. vocab_size: real V.
    Returns:
      (local ids [M, L] int32 in [0, v_local) where valid, valid mask [M, L]):
      valid = first occurrence, not pad_id, in [0, vocab_size), owned by this shard.
    """
    ids, valid = valid_targets(targets, pad_id, vocab_size)
    local = ids - vocab_offset
    valid = valid & (local >= 0) & (local < v_local)
    return jnp.where(valid, local, 0), valid


def valid_targets(targets, pad_id: int, vocab_size: int):
    """Each row's target set T: (sorted ids [M, L] int32, valid mask [M, L]) where valid marks
    the first occurrence of an id that is not ``pad_id`` and lies in [0, vocab_size)."""
    ids, first = unique_sorted(targets)
    return ids, first & (ids != pad_id) & (ids >= 0) & (ids < vocab_size)


def invalid_count(targets, pad_id: int, vocab_size: int):
    """Number of entries of ``targets`` that are neither ``pad_id`` nor in [0, vocab_size)."""
    t = targets.astype(jnp.int32)
    bad = (t != pad_id) & ((t < 0) | (t >= vocab_size))
    return jnp.sum(bad, dtype=jnp.float32)


def gather_logits(hidden, table, bias, ids):
    """Logits of the gathered target ids: x[m, l] = hidden[m] · table[ids[m, l]] + bias[ids[m, l]].

    Args:
      hidden: [M, D]; table: [V_local, D]; bias: [V_local] or None;
      ids: [M, L] local ids from `local_targets` (0 where invalid: mask with ``valid``).
    Returns:
      [M, L] float32, differentiable in hidden, table and bias. Costs O(M·L·D).
    """
    rows = jnp.take(table, ids, axis=0)                    # [M, L, D]
    x = jnp.einsum("md,mld->ml", hidden, rows, preferred_element_type=jnp.float32)
    if bias is not None:
        x = x + jnp.take(bias, ids, axis=0).astype(jnp.float32)
    return x
