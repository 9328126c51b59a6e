"""Target ids: padding, duplicates, invalid ids, vocab offsets and the gather of target logits.

A position's target set T is its unique ids in ``[0, vocab_size)``; ``pad_id``
is padding; any other id is ignored and counted as invalid. On a vocab shard
that owns global ids ``[vocab_offset, vocab_offset + V_local)`` only the owned
ids are corrected there, so summing shards gives each target exactly once.
"""

from __future__ import annotations

import jax
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


def rows_with_targets(targets, w, pad_id: int, vocab_size: int):
    """The weights w [M] of the positions with at least one valid target, 0 elsewhere."""
    _, valid = valid_targets(targets, pad_id, vocab_size)
    return jnp.where(jnp.any(valid, axis=-1), w, 0.0)


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

    The VJP is our own (`_gather_bwd`): with cotangent g [M, L],
    dhidden[m] = Σ_l g[m,l]·table[ids[m,l]] (the rows gathered again, not saved) and
    dtable = Σ g[m,l]·hidden[m] added at ids[m,l] by `scatter_rows`, chunk by chunk of
    rows at large M, so no one scatter grows with M (autodiff's one scatter of all
    M·L rows compiles far slower for TPU at large M; docs/measurements.md "Measured choices").
    """
    return _gather(hidden, table, bias, ids)


def take_logits(hidden, table, bias, ids):
    """(rows [M, L, D] = table[ids], x [M, L] f32 = hidden·rows + bias[ids]): the gathered rows, for
    a caller that uses them again (`recloss.sweep.sparse_part`), and their logits."""
    rows = jnp.take(table, ids, axis=0)
    x = jnp.einsum("md,mld->ml", hidden, rows, preferred_element_type=jnp.float32)
    if bias is not None:
        x = x + jnp.take(bias, ids, axis=0).astype(jnp.float32)
    return rows, x


def _gather_fwd_value(hidden, table, bias, ids):
    return take_logits(hidden, table, bias, ids)[1]


@jax.custom_vjp
def _gather(hidden, table, bias, ids):
    return _gather_fwd_value(hidden, table, bias, ids)


def _gather_fwd(hidden, table, bias, ids):
    return _gather_fwd_value(hidden, table, bias, ids), (hidden, table, bias, ids)


def _gather_bwd(res, g):
    hidden, table, bias, ids = res
    g = g.astype(jnp.float32)
    rows = jnp.take(table, ids, axis=0)
    dh = jnp.einsum("ml,mld->md", g.astype(rows.dtype), rows, preferred_element_type=jnp.float32)
    de, db = scatter_rows(hidden, g, ids, table.shape[0], bias is not None, dtype=table.dtype)
    return (dh.astype(hidden.dtype), de.astype(table.dtype),
            None if bias is None else db.astype(bias.dtype), None)


_gather.defvjp(_gather_fwd, _gather_bwd)


# Rows per scatter of `scatter_rows`. One scatter of all M·L updates (or a sort of
# the ids) compiles slowly for XLA:TPU at large M, small scatters quickly. Up to
# SCATTER_ONE_ROWS rows it is one scatter, above it a chain of SCATTER_ROWS-row
# scatters, each adding into the previous one's result. Either way the first
# scatter's operand is zeros in the table's dtype, so XLA rewrites the backward's
# ``dE_background + dE_correction`` into the scatters applied to the background's dE
# buffer in place: no second table-sized buffer (a lax.scan over the chunks would carry
# one more [V_local, D]). The figures behind both: docs/measurements.md "Measured choices".
SCATTER_ROWS = 2048
SCATTER_ONE_ROWS = 4096


def _row_chunks(m: int):
    """The static row slices of the backward: all M rows up to SCATTER_ONE_ROWS, else chunks of
    SCATTER_ROWS (the last one may be shorter)."""
    if m <= SCATTER_ONE_ROWS:
        return [slice(None)]
    return [slice(i, i + SCATTER_ROWS) for i in range(0, m, SCATTER_ROWS)]


def scatter_rows(hidden, g, ids, rows: int, with_bias: bool, dtype=jnp.float32, into=None):
    """(dE [rows, D] in ``dtype``, db [rows] f32 or None) with dE[v] = Σ_{ids[m,l] = v} g[m,l]·hidden[m],
    added to ``into`` = (dE₀ [rows, D], db₀ [rows] or None) when given (in their dtypes), else to zeros.

    The transpose of `gather_logits` in its table and bias. The products are f32;
    they are added in ``dtype`` (the table's), so XLA can fold the scatters into
    the background's dE buffer of that dtype, as autodiff's scatter was (an f32
    one beside a bf16 dE would be a second [rows, D] buffer). Up to
    ``SCATTER_ONE_ROWS`` rows this is one scatter; above, one scatter per chunk of
    ``SCATTER_ROWS`` rows, chained (each adds into the last one's result, in
    place), so no scatter grows with M and nothing is carried through a loop.
    """
    d = hidden.shape[1]
    de, db = (None, None) if into is None else into
    if into is not None:
        dtype = de.dtype
    for sl in _row_chunks(ids.shape[0]):
        h_c, g_c, ids_c = hidden[sl], g[sl], ids[sl]
        upd = (g_c[:, :, None] * h_c.astype(jnp.float32)[:, None, :]).reshape(-1, d)
        flat = ids_c.reshape(-1).astype(jnp.int32)
        de = (jnp.zeros((rows, d), dtype) if de is None else de).at[flat].add(upd.astype(dtype))
        if with_bias:
            db = (jnp.zeros((rows,), jnp.float32) if db is None else db).at[flat].add(g_c.reshape(-1))
    return de, db
