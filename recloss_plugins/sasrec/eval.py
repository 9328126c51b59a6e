"""Full-catalogue ranking evaluation without a [users, V] score matrix.

`blocked_top_k` walks the table in blocks of ``block_v`` rows, keeping a
running top-K per user: memory O(U·(K + block_v)). `sharded_top_k` runs it on each chip's rows of a
table split over a mesh (its vocab and fsdp axes) and merges the chips' top-K: no chip holds the table. `ranking_metrics` turns
the top-K ids and each user's held-out items into Hit@K, Recall@K and NDCG@K.
"""

from __future__ import annotations

import functools
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnames=("k", "block_v", "vocab_size", "pad_id"))
def blocked_top_k(hidden, table, bias=None, *, k: int, block_v: int, vocab_size: int, pad_id: int = 0,
                  offset=0):
    """Top-K items per row of ``hidden`` over the whole catalogue, in vocab blocks.

    Scores are s[u, v] = hidden[u]·table[v] (+ bias[v]), float32. Ids equal to
    ``pad_id`` or >= ``vocab_size`` (table padding rows) are never returned
    while a real item is left; if fewer than K real items exist, the extra
    slots hold id -1 with score -inf.

    Args:
      hidden: [U, D]. table: [V_rows, D], V_rows >= vocab_size. bias: [V_rows] or None.
      k: K. block_v: table rows per block. vocab_size: real V (ids 0..V-1).
      offset: the global id of ``table``'s row 0 (an int or a traced int32; a shard of a larger table).
    Returns:
      (scores [U, K] float32 descending, ids [U, K] int32).
    """
    u, d = hidden.shape
    rows = table.shape[0]
    bv = max(1, min(block_v, rows))
    nb, tail = divmod(rows, bv)
    kb = min(k, bv)
    h = hidden.astype(jnp.float32)

    def merge(carry, blk, b_blk, start):
        """The running top-K merged with the [bv, D] block of rows ``start`` … (rows past the table: padding)."""
        best_s, best_i = carry
        n = blk.shape[0]
        s = jnp.dot(h, blk.astype(jnp.float32).T, preferred_element_type=jnp.float32)
        if b_blk is not None:
            s = s + b_blk.astype(jnp.float32)[None]
        ids = offset + start + jnp.arange(n, dtype=jnp.int32)
        ok = (ids != pad_id) & (ids < vocab_size) & (ids < offset + rows)
        s = jnp.where(ok[None], s, -jnp.inf)
        top_s, top_pos = jax.lax.top_k(s, kb)
        top_i = jnp.where(jnp.isfinite(top_s), ids[top_pos], -1)
        all_s = jnp.concatenate([best_s, top_s], axis=1)
        all_i = jnp.concatenate([best_i, top_i], axis=1)
        new_s, pos = jax.lax.top_k(all_s, k)
        return new_s, jnp.take_along_axis(all_i, pos, axis=1)

    def step(carry, j):
        start = j * bv
        blk = jax.lax.dynamic_slice_in_dim(table, start, bv)
        b_blk = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, bv)
        return merge(carry, blk, b_blk, start), None

    carry = (jnp.full((u, k), -jnp.inf, jnp.float32), jnp.full((u, k), -1, jnp.int32))
    carry, _ = jax.lax.scan(step, carry, jnp.arange(nb))
    if tail:   # the rows past the last whole block, padded to one block (a copy of < bv rows, not the table's)
        pad = lambda x: jnp.pad(x[nb * bv:], ((0, bv - tail),) + ((0, 0),) * (x.ndim - 1))
        carry = merge(carry, pad(table), None if bias is None else pad(bias), nb * bv)
    scores, ids = carry
    return scores, ids


def sharded_top_k(hidden, table, bias, *, layout, k: int, block_v: int, vocab_size: int, pad_id: int = 0):
    """`blocked_top_k` of a table whose rows are split over ``layout``'s table axes (vocab, fsdp; a
    `recloss.MeshLayout`), without gathering it: each chip ranks its own rows for its share of the
    users, the chips of one table copy exchange their K candidates per user (an all-gather of
    [U, K] scores and ids), and the merge keeps the first K (ties to the smaller id, as one chip would).

    hidden [U, D] (users split over the mesh axes that do not split the table), table [V_rows, D],
    bias [V_rows] or None. Returns (scores [U, K], ids [U, K]) as `blocked_top_k`.
    """
    from jax.sharding import PartitionSpec as P

    table_axes = tuple(a for a in layout.table_axes if layout.axis_size(a) > 1)
    if not table_axes:
        return blocked_top_k(hidden, table, bias, k=k, block_v=block_v, vocab_size=vocab_size, pad_id=pad_id)
    mesh = layout.mesh
    users = tuple(a for a in mesh.axis_names if a not in table_axes and layout.axis_size(a) > 1)
    users = users if hidden.shape[0] % max(1, int(np.prod([layout.axis_size(a) for a in users]))) == 0 else ()
    u_spec = P(users or None, None)
    rows = table.shape[0] // int(np.prod([layout.axis_size(a) for a in table_axes]))

    def local(h, e, b):
        index = 0
        for a in table_axes:                      # the row split's order: the first axis is the major one
            index = index * layout.axis_size(a) + jax.lax.axis_index(a)
        s, i = blocked_top_k(h, e, b, k=k, block_v=block_v, vocab_size=vocab_size, pad_id=pad_id,
                             offset=index * rows)
        s = jax.lax.all_gather(s, table_axes, axis=1, tiled=True)      # [U_local, shards·K], shard order
        i = jax.lax.all_gather(i, table_axes, axis=1, tiled=True)
        top, pos = jax.lax.top_k(s, k)
        return top, jnp.take_along_axis(i, pos, axis=1)

    t = table_axes[0] if len(table_axes) == 1 else table_axes
    fn = jax.shard_map(local, mesh=mesh, in_specs=(u_spec, P(t, None), None if bias is None else P(t)),
                   out_specs=(u_spec, u_spec), check_vma=False)
    return fn(hidden, table, bias)


def eval_batch_rows(eval_batch_size: int, batch_shards: int) -> int:
    """Users in one global evaluation batch: ``eval_batch_size`` rounded up to the batch shards."""
    return -(-eval_batch_size // batch_shards) * batch_shards


def ranking_metrics(top_ids, targets, *, pad_id: int = 0) -> Dict[str, jax.Array]:
    """Per-user Hit@K, Recall@K, NDCG@K.

    T_u = unique ids of targets[u] other than ``pad_id``; rel_r = [top_ids[u, r] ∈ T_u].

        hit    = [Σ_r rel_r ≥ 1]
        recall = Σ_r rel_r / |T_u|
        ndcg   = Σ_r rel_r / log2(r + 2)  /  Σ_{r < min(|T_u|, K)} 1 / log2(r + 2)

    Args: top_ids [U, K] int (ranked, distinct); targets [U, L] int.
    Returns: dict of [U] float32 (0 for users with no valid target) and
      'valid' [U] bool (|T_u| ≥ 1).
    """
    top_ids = jnp.asarray(top_ids)
    targets = jnp.asarray(targets)
    k = top_ids.shape[1]
    rel = jnp.any((top_ids[:, :, None] == targets[:, None, :]) & (targets[:, None, :] != pad_id), axis=2)
    rel = rel.astype(jnp.float32)
    srt = jnp.sort(targets, axis=1)
    first = jnp.concatenate([jnp.ones_like(srt[:, :1], bool), srt[:, 1:] != srt[:, :-1]], axis=1)
    n_t = jnp.sum(first & (srt != pad_id), axis=1).astype(jnp.float32)
    discount = 1.0 / jnp.log2(jnp.arange(k, dtype=jnp.float32) + 2.0)
    dcg = jnp.sum(rel * discount, axis=1)
    ideal = jnp.sum(jnp.where(jnp.arange(k)[None] < n_t[:, None], discount[None], 0.0), axis=1)
    valid = n_t > 0
    safe = jnp.where(valid, 1.0, 0.0)
    return {
        "hit": (jnp.sum(rel, axis=1) > 0).astype(jnp.float32) * safe,
        "recall": jnp.sum(rel, axis=1) / jnp.maximum(n_t, 1.0) * safe,
        "ndcg": dcg / jnp.where(valid, ideal, 1.0) * safe,
        "valid": valid,
    }


def popularity_top_k(counts: np.ndarray, k: int, *, pad_id: int = 0, chunk: int = 1 << 22) -> np.ndarray:
    """[K] ids of the most frequent items (ties: smaller id first), never ``pad_id``.

    Args: counts [V] item counts (a memory-mapped popularity.npy is read ``chunk`` ids at a time:
    O(chunk + K) memory at any V). Returns int32 [K] (-1 fills when V-1 < K)."""
    ids, vals = np.zeros(0, np.int64), np.zeros(0, np.float64)
    for lo in range(0, len(counts), chunk):
        c = np.asarray(counts[lo:lo + chunk], np.float64).copy()
        if lo <= pad_id < lo + c.size:
            c[pad_id - lo] = -np.inf
        live = np.flatnonzero(np.isfinite(c))
        if live.size > k:   # this chunk's K best (ties to the smaller id): all above the K-th value, then its first ties
            kth = np.partition(c[live], live.size - k)[live.size - k]
            above = live[c[live] > kth]
            live = np.concatenate([above, live[c[live] == kth][:k - above.size]])
        ids, vals = np.concatenate([ids, live + lo]), np.concatenate([vals, c[live]])
        order = np.lexsort((ids, -vals))[:k]
        ids, vals = ids[order], vals[order]
    return np.concatenate([ids, -np.ones(k - ids.size, np.int64)]).astype(np.int32)


def summarize(per_user: Dict[str, np.ndarray], k: int) -> Dict[str, float]:
    """Means over valid users: {'hit@K', 'recall@K', 'ndcg@K', 'users'}."""
    valid = np.asarray(per_user["valid"], bool)
    n = int(valid.sum())
    out = {"users": float(n)}
    for name in ("hit", "recall", "ndcg"):
        vals = np.asarray(per_user[name], np.float64)[valid]
        out[f"{name}@{k}"] = float(vals.mean()) if n else 0.0
    return out


def _allgather_sum(x: np.ndarray) -> np.ndarray:
    """Σ over processes of a small host array (itself with one process)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(np.asarray(x)[None], tiled=True)).sum(axis=0)


def evaluate(program, params, split, *, max_users: int = 0, popularity_counts=None,
             replicated: bool = False) -> Dict[str, Dict[str, float]]:
    """Hit/Recall/NDCG@K of the model (and of the most-popular baseline) on ``split``:
    {'model': {'hit@K', 'recall@K', 'ndcg@K', 'users'}, 'popularity': ...}.

    Users are scored in global eval batches of eval_batch_size rounded up to the batch shards, padded
    with dummy users that are dropped. ``split`` is this process's share of the users (the Grain
    pipeline): each process feeds its rows of every batch (`parallel.put_process_local`), for as many
    batches as the process with the most users needs, and the per-user metric sums are added across
    processes; ``max_users`` caps each process at ceil(max_users / process_count) users (0 = all).
    With ``replicated`` every process holds every user (an in-memory dataset): the batches are fed
    whole (`parallel.put_global`, any mesh), every process sees every score, and ``max_users`` caps
    the users in all."""
    from recloss_plugins.sasrec import parallel

    cfg, k = program.cfg, program.cfg.eval_top_k
    P_ = jax.process_count()
    bs = eval_batch_rows(cfg.eval_batch_size, program.layout.batch_shards)
    in_sh = jax.sharding.NamedSharding(program.mesh, program.layout.batch_spec(2))
    len_sh = jax.sharding.NamedSharding(program.mesh, program.layout.batch_spec(1))
    if replicated:
        n = split.num_users if not max_users else min(max_users, split.num_users)
        lo, hi = 0, bs
        feed = lambda x, sh: parallel.put_global(x, sh)            # noqa: E731
        total = np.asarray                                          # every process already has it all
        num_batches = -(-n // bs)
    else:
        n = split.num_users if not max_users else min(-(-max_users // P_), split.num_users)
        lo, hi = parallel.process_rows(in_sh, bs)
        feed = lambda x, sh: parallel.put_process_local(x, sh, bs)  # noqa: E731
        total = _allgather_sum
        counts = np.zeros(P_, np.int64)
        counts[jax.process_index()] = n
        num_batches = int(-(-_allgather_sum(counts).max() // (hi - lo)))
    local = hi - lo
    tops = []
    for b in range(num_batches):
        a, z = min(b * local, n), min((b + 1) * local, n)
        inputs = np.zeros((local, cfg.max_seq_len), np.int32)
        lengths = np.ones(local, np.int32)
        inputs[:z - a] = split.inputs[a:z]
        lengths[:z - a] = split.lengths[a:z]
        _, ids = program.eval_top_k(params, feed(inputs, in_sh), feed(lengths, len_sh))
        tops.append(parallel.to_host(ids)[lo:hi][:z - a])
    top = np.concatenate(tops) if tops else np.zeros((0, k), np.int32)
    targets = split.targets[:n]

    def combined(top_ids):
        per = ranking_metrics(top_ids, targets) if n else {m: np.zeros(0) for m in ("hit", "recall", "ndcg", "valid")}
        valid = np.asarray(per["valid"], bool)
        sums = np.array([valid.sum()] + [np.asarray(per[m], np.float64)[valid].sum()
                                          for m in ("hit", "recall", "ndcg")])
        tot = total(sums)
        users = int(round(tot[0]))
        return {"users": float(users), **{f"{m}@{k}": float(tot[i + 1] / users) if users else 0.0
                                          for i, m in enumerate(("hit", "recall", "ndcg"))}}

    out = {"model": combined(top)}
    if popularity_counts is not None:
        out["popularity"] = combined(np.broadcast_to(popularity_top_k(popularity_counts, k), (n, k)))
    return out
